"""Test-session setup.

Unless ``EXPEDITOR_GPU_TESTS=1`` asks for real CUDA, Triton kernels run under the Triton
interpreter on CPU tensors; this must be set before anything imports triton, hence at
import time here.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("EXPEDITOR_GPU_TESTS") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA device (run with EXPEDITOR_GPU_TESTS=1 on a GPU machine)"
    )
