"""The attention kernels compile a bounded number of variants: nothing that changes from
one batch to the next is a specialised argument, and the constexprs of a launch come
from its kind (decode tile, prefill tile, split-KV partial, split-KV reduce) and the
model only: at most 4 compiled attention kernels per dtype, head layout and window /
softcap flags. (Counted on a fake sm_90 target by benchmarks/kernel_variants.py: 4
variants over 200 batch mixes with contexts up to 32k.)"""

from __future__ import annotations

import ast
import importlib
import inspect
import random
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from gpu_worker.kernels.attention_schedule import (
    DECODE,
    KINDS,
    PREFILL,
    REDUCE,
    SPLIT,
    kernel_constexprs,
    plan_attention,
)

# By path: the package re-exports the function paged_attention under the module's name.
main_kernel = importlib.import_module("gpu_worker.kernels.paged_attention")
split_kernels = importlib.import_module("gpu_worker.kernels.split_kv")

KERNELS: dict[str, tuple[ModuleType, set[str], tuple[str, ...]]] = {
    # kernel: (module, its batch-dependent arguments, the kinds of launch it serves)
    "_paged_attention_kernel": (
        main_kernel,
        {"num_launch_seqs", "bt_s0", "window", "q_s0", "q_s1", "o_s0", "o_s1"}
        | {"query_ptr", "block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr"},
        (DECODE, PREFILL),
    ),
    "_split_kv_partial_kernel": (
        split_kernels,
        {"num_split_seqs", "partition_size", "bt_s0", "window", "q_s0", "q_s1"}
        | {"query_ptr", "block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr"},
        (SPLIT,),
    ),
    "_split_kv_reduce_kernel": (
        split_kernels,
        {"window", "partition_size", "o_s0", "o_s1", "seq_lens_ptr", "query_start_loc_ptr"},
        (REDUCE,),
    ),
}
"""Batch-dependent: sequence counts of a launch, the block table's row stride (its
width: the longest sequence's blocks), the addresses of the block table, ``seq_lens``
and ``query_start_loc`` (slices of a staging buffer, 8-byte aligned), the window (per
layer, any value), the partition size, and the query's and output's token and head
strides (transformers hands the query over head-major, so its head stride is the token
count times head_dim)."""


def _kernel_decoration(module: ModuleType, kernel: str) -> tuple[list[str], set[str], set[str]]:
    """A kernel's runtime argument names (in order), constexpr names and ``do_not_specialize``
    names, read from the source (under the interpreter, which the tests use, the
    decorated object does not keep the last)."""
    source = Path(inspect.getsourcefile(module) or "").read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == kernel:
            runtime: list[str] = []
            constexprs: set[str] = set()
            for a in node.args.args:
                is_constexpr = a.annotation is not None and "constexpr" in ast.unparse(a.annotation)
                if is_constexpr:
                    constexprs.add(a.arg)
                else:
                    runtime.append(a.arg)
            unspecialised: set[str] = set()
            for decorator in node.decorator_list:
                if isinstance(decorator, ast.Call):
                    for keyword in decorator.keywords:
                        if keyword.arg == "do_not_specialize":
                            unspecialised = set(ast.literal_eval(keyword.value))
            return runtime, constexprs, unspecialised
    raise AssertionError(f"no {kernel} in {module.__name__}")


LAYOUT = dict(
    queries_per_kv=4,
    head_dim=128,
    block_size=16,
    dtype=torch.bfloat16,
    has_window=True,
    has_softcap=False,
)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_batch_dependent_ints_are_not_specialised(kernel: str) -> None:
    module, batch_dependent, _ = KERNELS[kernel]
    runtime, _, unspecialised = _kernel_decoration(module, kernel)
    assert batch_dependent <= set(runtime)  # the names are the kernel's own arguments
    assert batch_dependent <= unspecialised


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_constexprs_come_from_kernel_constexprs(kernel: str) -> None:
    """Each kernel's constexpr parameters are exactly what kernel_constexprs gives the
    kinds it serves (the launches pass that and nothing else)."""
    module, _, kinds = KERNELS[kernel]
    _, constexprs, _ = _kernel_decoration(module, kernel)
    for kind in kinds:
        assert set(kernel_constexprs(kind, **LAYOUT)) == constexprs


class _Launches:
    """Stands in for a jitted kernel and runs nothing: records each launch's
    specialisation key as Triton forms it (the constexprs, num_warps, and for each
    runtime argument not in ``do_not_specialize``: a tensor's dtype and whether its
    address is 16-byte aligned, an int's ``== 1`` and ``% 16 == 0``; floats are not
    specialised; a ``do_not_specialize`` tensor keeps its dtype)."""

    def __init__(self, kernel: str, keys: set) -> None:
        self.names, _, self.unspecialised = _kernel_decoration(KERNELS[kernel][0], kernel)
        self.kernel, self.keys = kernel, keys

    def __getitem__(self, grid: tuple[int, ...]):
        def launch(*args: object, **kwargs: object) -> None:
            assert len(args) == len(self.names)  # runtime arguments by position
            key: list[object] = [self.kernel, tuple(sorted(kwargs.items()))]
            for name, value in zip(self.names, args, strict=True):
                if isinstance(value, torch.Tensor):
                    aligned = None if name in self.unspecialised else value.data_ptr() % 16 == 0
                    key.append((name, value.dtype, aligned))
                elif isinstance(value, int) and name not in self.unspecialised:
                    key.append((name, value == 1, value % 16 == 0))
            self.keys.add(tuple(key))

        return launch


@pytest.mark.parametrize(
    ("queries_per_kv", "head_dim", "dtype", "window", "softcap"),
    [(4, 128, torch.bfloat16, None, None), (1, 80, torch.float32, 4096, 30.0)],
)
def test_random_mixes_compile_at_most_four_variants(
    monkeypatch: pytest.MonkeyPatch,
    queries_per_kv: int,
    head_dim: int,
    dtype: torch.dtype,
    window: int | None,
    softcap: float | None,
) -> None:
    """200 batch mixes (1-255 sequences, chunks up to 512, contexts up to 32k, block
    tables 1-2048 wide; block tables, lengths and starts at 8-byte boundaries of one
    staging buffer, as the worker's staging leaves them; the query head-major as
    transformers passes it) through paged_attention_triton with every kernel recorded,
    not run: at most 4 distinct specialisation keys, and every kind of launch among
    them."""
    keys: set = set()
    for kernel, (module, _, _) in KERNELS.items():
        monkeypatch.setattr(module, kernel, _Launches(kernel, keys))
    rng = random.Random(0)
    kv_heads, block_size = 2, 16
    heads = kv_heads * queries_per_kv
    kv = torch.zeros(1, 3, 2, block_size, kv_heads, head_dim, dtype=dtype)
    key_cache, value_cache = kv[:, 1, 0], kv[:, 1, 1]
    kinds: set[str] = set()
    for _ in range(200):
        num_seqs = rng.choice([1, 2, 3, 7, 16, 17, 33, 64, 100, 255])
        q_lens = [1] * num_seqs
        q_lens[0] = rng.choice([0, 1, 2, 8, 100, 512])
        lens = [q + rng.choice([0, 5, 500, 4000, 32000]) for q in q_lens]
        width = max(rng.choice([1, 5, 16, 33, 128]), *(-(-n // block_size) for n in lens))
        starts = np.concatenate([[0], np.cumsum(q_lens)])
        # One staging buffer, each array at an 8-byte boundary (so, at random, 16).
        staged, at = torch.zeros(num_seqs * (width + 2) + 16, dtype=torch.int32), 0
        views = []
        for array in (np.zeros(num_seqs * width), np.array(lens), starts):
            at += rng.choice([0, 2]) + (-at % 2)
            views.append(staged[at : at + len(array)])
            views[-1].copy_(torch.from_numpy(array.astype(np.int32)))
            at += len(array)
        tables, seq_lens, query_start_loc = views[0].view(num_seqs, width), views[1], views[2]
        # Head-major, as transformers' attention hands it over: [tokens, heads, head_dim]
        # with strides (head_dim, tokens * head_dim, 1).
        query = torch.zeros(1, heads, int(starts[-1]), head_dim, dtype=dtype)[0].transpose(0, 1)
        schedule = plan_attention(
            starts,
            np.array(lens),
            num_kv_heads=kv_heads,
            queries_per_kv=queries_per_kv,
            head_dim=head_dim,
            block_size=block_size,
            num_sms=132,
            device="cpu",
        )
        kinds.update(schedule.kinds)
        main_kernel.paged_attention_triton(
            query,
            key_cache,
            value_cache,
            tables,
            seq_lens,
            query_start_loc,
            head_dim**-0.5,
            window=window,
            softcap=softcap,
            schedule=schedule,
        )
    assert kinds == set(KINDS)
    assert len(keys) == 4, sorted(map(str, keys))
