"""What a checkpoint directory says about itself that more than one layer needs.

:func:`checkpoint_max_len` is the one reading of a checkpoint's context limit: the
scheduler caps ``max_model_len`` by it (through the engine builder, in the daemon and in
``LLM`` alike), the workers size their CUDA graphs by it and the gateway reports it.
Read from ``config.json`` directly, so that a process which must not import
transformers (the scheduler, the gateway) reads the same number as one that does.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["capped_max_len", "checkpoint_max_len"]


def checkpoint_max_len(model_dir: str | Path) -> int | None:
    """The checkpoint's ``max_position_embeddings`` (that of ``text_config`` when the
    top level has none, as multimodal checkpoints nest it); None when ``config.json``
    is missing, unreadable or gives no integer."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    value = config.get("max_position_embeddings")
    text = config.get("text_config")
    if value is None and isinstance(text, dict):
        value = text.get("max_position_embeddings")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def capped_max_len(max_model_len: int, model_dir: str | Path) -> int:
    """``max_model_len`` capped by the checkpoint's own limit, when it states one."""
    limit = checkpoint_max_len(model_dir)
    return max_model_len if limit is None else min(max_model_len, limit)
