"""Where expeditor keeps what it builds or converts once per machine."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """$EXPEDITOR_CACHE_DIR, else $XDG_CACHE_HOME/expeditor, else ~/.cache/expeditor: the
    native kernels' builds and generated checkpoints live under it."""
    if explicit := os.environ.get("EXPEDITOR_CACHE_DIR"):
        return Path(explicit).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "expeditor"
    return Path.home() / ".cache" / "expeditor"
