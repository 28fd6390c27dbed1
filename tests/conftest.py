"""Test-session setup.

Unless ``EXPEDITOR_GPU_TESTS=1`` asks for real CUDA, Triton kernels run under the Triton
interpreter on CPU tensors; this must be set before anything imports triton, hence at
import time here. ``dtype=auto`` is float32 on the CPU (``EXPEDITOR_CPU_BF16=0``). The
Hypothesis profile is loaded here too (:mod:`support.hypothesis_profiles` says which
there are).

Session fixtures shared by the test modules: the tiny checkpoints (``model``, the
default llama one; ``tiny_checkpoint(arch)`` for any architecture) and the
correctness oracle (``hf_oracle``), each made once per session, so a module, or a
shuffled order that sets a module's fixtures up again, pays for none of them twice.
The checkpoints are shared read-only: a test that changes a checkpoint's files makes
its own with ``make_tiny_model``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import settings

if os.environ.get("EXPEDITOR_GPU_TESTS") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
# dtype=auto computes in float32 here, as the exact oracle tests need, even on a CPU with
# bfloat16 arithmetic (the bf16 tests ask for it by name); daemons the tests start inherit it.
os.environ.setdefault("EXPEDITOR_CPU_BF16", "0")

from support.hypothesis_profiles import hypothesis_profile

settings.load_profile(hypothesis_profile())

if TYPE_CHECKING:
    from support.hf_reference import Oracle


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_checkpoint(arch)``: the tiny checkpoint of ``arch`` (seed 0, the ``tiny``
    preset) in a directory named after it, written on first use."""
    from gpu_worker.tiny_model import make_tiny_model

    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = make_tiny_model(tmp_path_factory.mktemp(arch) / arch, arch=arch)
        return made[arch]

    return get


@pytest.fixture(scope="session")
def model(tiny_checkpoint: Callable[[str], Path]) -> Path:
    """The default tiny checkpoint: llama, as ``expeditor serve`` embeds it."""
    return tiny_checkpoint("llama")


@pytest.fixture(scope="session")
def hf_oracle() -> Oracle:
    """transformers' greedy outputs, computed once per (checkpoint, prompts, length,
    device); each call gets lists of its own."""
    from support.hf_reference import hf_greedy

    computed: dict[tuple[str, tuple[tuple[int, ...], ...], int, str], list[list[int]]] = {}

    def greedy(
        checkpoint: Path, prompts: list[list[int]], max_new_tokens: int, device: str = "cpu"
    ) -> list[list[int]]:
        key = (str(checkpoint), tuple(map(tuple, prompts)), max_new_tokens, device)
        if key not in computed:
            computed[key] = hf_greedy(checkpoint, prompts, max_new_tokens, device)
        return [list(tokens) for tokens in computed[key]]

    return greedy


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
