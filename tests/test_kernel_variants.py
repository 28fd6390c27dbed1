"""The paged-attention kernel compiles a bounded number of variants: nothing that
changes from one batch to the next is a specialised argument, and the tile choice has
two outcomes per head layout. (Counted on a fake CUDA target by
benchmarks/kernel_variants.py: 2 variants over 200 batch mixes, 11 before.)"""

from __future__ import annotations

import ast
import inspect
import random
from pathlib import Path

import gpu_worker.kernels.paged_attention as kernels
from gpu_worker.kernels.paged_attention import _tile_config

BATCH_DEPENDENT = {"num_seqs", "bt_s0", "window"}
"""Ints that differ between steps: the sequence count, the block table's row stride (its
width: the longest sequence's blocks), and the window (per layer, any value)."""


def _kernel_decoration() -> tuple[set[str], set[str]]:
    """The kernel's argument names and its ``do_not_specialize`` names, read from the
    source (under the interpreter, which the tests use, the decorated object does not
    keep the latter)."""
    source = Path(inspect.getsourcefile(kernels) or "").read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == "_paged_attention_kernel":
            args = {a.arg for a in node.args.args}
            for decorator in node.decorator_list:
                if isinstance(decorator, ast.Call):
                    for keyword in decorator.keywords:
                        if keyword.arg == "do_not_specialize":
                            return args, set(ast.literal_eval(keyword.value))
            return args, set()
    raise AssertionError("no _paged_attention_kernel in the kernels' source")


def test_batch_dependent_ints_are_not_specialised() -> None:
    args, unspecialised = _kernel_decoration()
    assert BATCH_DEPENDENT <= args  # the names are the kernel's own arguments
    assert BATCH_DEPENDENT <= unspecialised


def test_the_tile_choice_has_two_outcomes_per_head_layout() -> None:
    rng = random.Random(0)
    for queries_per_kv in (1, 4, 8):
        configs = {
            _tile_config(num_tokens, num_seqs, queries_per_kv)
            for num_seqs in (rng.randint(1, 512) for _ in range(300))
            for num_tokens in (num_seqs, num_seqs + rng.randint(0, 8192))
        }
        assert len(configs) <= 2, (queries_per_kv, configs)
