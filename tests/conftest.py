"""Test-session setup.

Unless ``EXPEDITOR_GPU_TESTS=1`` asks for real CUDA, Triton kernels run under the Triton
interpreter on CPU tensors; this must be set before anything imports triton, hence at
import time here. The Hypothesis profile is loaded here too
(:mod:`support.hypothesis_profiles` says which there are).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

if os.environ.get("EXPEDITOR_GPU_TESTS") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from support.hypothesis_profiles import hypothesis_profile

settings.load_profile(hypothesis_profile())


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA device (run with EXPEDITOR_GPU_TESTS=1 on a GPU machine)"
    )


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    """One line, even under -q: the Hypothesis profile, and the order the tests ran in
    with what replays it."""
    if config.pluginmanager.hasplugin("randomly"):
        seed = config.getoption("randomly_seed")
        order = f"shuffled (replay: -p randomly --randomly-seed={seed})"
    else:
        order = "as written (shuffle: -p randomly)"
    profile = settings.get_current_profile_name()
    terminalreporter.write_line(f"hypothesis profile: {profile}; test order: {order}")
