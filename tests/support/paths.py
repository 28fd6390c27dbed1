"""Where things are in the checkout the tests run from."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The checkout's root (pyproject.toml, systemd/, benchmarks/ ...)."""
