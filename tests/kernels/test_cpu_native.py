"""The native backend (``gpu_worker.attention.native_backend``) against the reference.

Steps come from ``support.attention_cases.make_step``: the worker's cache layout (layer
views of ``[blocks, layers, 2, block_size, kv_heads, head_dim]``), NaN wherever nothing
was stored, shuffled block ids, garbage past each table's entries, tokens without slots.
Every layer goes through ``attention.attend`` (the kernel for short query runs, the
torch backend's SDPA groups for long ones) and through ``store_kv_ref`` +
``paged_attention_ref`` on a copy of the cache.
"""

from __future__ import annotations

import ctypes
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from support.attention_cases import (
    NUM_LAYERS,
    backend_for,
    make_step,
    mixed_seqs,
    paged_attention_ref,
    planned,
)
from support.hf_reference import PROMPTS, hf_greedy

from expeditor.llm import LLM
from gpu_worker import attention
from gpu_worker.attention import native_backend, torch_backend
from gpu_worker.attention.native_backend import NativeBackend, NativeKernels, NativeStep
from gpu_worker.kernels import native_build, store_kv_ref
from gpu_worker.kernels.attention_args import layer_params
from gpu_worker.tiny_model import make_tiny_model
from shared.sampling import SamplingParams

ATOL, RTOL = 2e-5, 1e-4
Tensor = torch.Tensor


@pytest.fixture(scope="module", autouse=True)
def native() -> Iterator[NativeKernels]:
    """The compiled kernels (module-wide, so Hypothesis tests may use them)."""
    if native_build.compiler() is None:
        pytest.skip("no C compiler: the native kernel cannot be built here")
    kernels = native_backend._loaded()
    assert not isinstance(kernels, str), f"a compiler is present but: {kernels}"
    yield kernels


def kernels_at(path: Path) -> NativeKernels:
    """The float32 kernels of the library at ``path``."""
    return NativeKernels(native_build.Library(path, ctypes.CDLL(str(path))))


def split(qkv: Tensor, heads: int, kv_heads: int, fused: bool) -> tuple[Tensor, Tensor, Tensor]:
    """A layer's (q, k, v) [tokens, heads, head_dim]: transposed views of make_step's
    [3, heads', tokens, head_dim], or column views of one fused [tokens, all heads, d]."""
    q, k, v = (t.transpose(0, 1) for t in (qkv[0, :heads], qkv[1, :kv_heads], qkv[2, :kv_heads]))
    if fused:
        packed = torch.cat([q, k, v], 1)
        q, k, v = (
            packed[:, :heads],
            packed[:, heads : heads + kv_heads],
            packed[:, heads + kv_heads :],
        )
    return q, k, v


def run_layers(
    meta: attention.StepMetadata,
    layers: list[Tensor],
    group: int,
    window: int | None = None,
    softcap: float | None = None,
    fused: bool = False,
) -> list[Tensor]:
    kv_heads = meta.layer_caches[0][0].shape[2]
    outs = []
    for layer, qkv in enumerate(layers):
        q, k, v = split(qkv, kv_heads * group, kv_heads, fused)
        with torch.inference_mode():
            outs.append(
                attention.attend(
                    meta, layer, q, k, v, layer_params(q.shape[-1] ** -0.5, window, softcap)
                )
            )
    return outs


def check_native(
    kv: Tensor,
    meta: attention.StepMetadata,
    layers: list[Tensor],
    group: int,
    window: int | None = None,
    softcap: float | None = None,
    fused: bool = False,
) -> list[Tensor]:
    """Run every layer natively and compare outputs and cache with the reference."""
    expected_kv = kv.clone()
    kv_heads = kv.shape[4]
    step = planned(meta, backend_for("native", kv, kv_heads * group))
    meta.backend, meta.plan = step.backend, step.plan  # the caller sees the plan
    assert isinstance(meta.plan, NativeStep)
    outs = run_layers(meta, layers, group, window, softcap, fused)
    for layer, (qkv, out) in enumerate(zip(layers, outs, strict=True)):
        q, k, v = split(qkv, kv_heads * group, kv_heads, fused)
        key_cache, value_cache = expected_kv[:, layer, 0], expected_kv[:, layer, 1]
        store_kv_ref(k, v, key_cache, value_cache, meta.slot_mapping)
        ref = paged_attention_ref(
            q, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            q.shape[-1] ** -0.5, window=window, softcap=softcap,
        )  # fmt: skip
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert torch.isfinite(out).all(), "NaN from an unused cache slot leaked"
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)
    assert torch.equal(kv.nan_to_num(7.0), expected_kv.nan_to_num(7.0))
    return outs


def add_trailing(meta: attention.StepMetadata, layers: list[Tensor], n: int) -> list[Tensor]:
    """``n`` tokens without a slot after the last sequence's rows."""
    meta.slot_mapping = torch.cat([meta.slot_mapping, torch.full((n,), -1, dtype=torch.int64)])
    g = torch.Generator().manual_seed(n)
    return [
        torch.cat([x, torch.randn((*x.shape[:2], n, x.shape[3]), generator=g)], 2) for x in layers
    ]


@pytest.mark.parametrize("block_size", [4, 16, 32])
# 20 and 136 end in a partial vector (136: past the kernel's 64 value columns at a time)
@pytest.mark.parametrize("head_dim", [16, 20, 24, 32, 64, 128, 136])
@pytest.mark.parametrize(("num_kv_heads", "group"), [(4, 1), (4, 2), (2, 4), (1, 8)])
def test_mixed_steps_match_reference(
    num_kv_heads: int, group: int, head_dim: int, block_size: int
) -> None:
    """Decodes, chunks after cached prefixes, whole prompts (both sides of PROMPT_ROWS)
    and an idle sequence, on either input layout."""
    seed = num_kv_heads * 1000 + group * 100 + head_dim + block_size
    kv, meta, layers = make_step(
        mixed_seqs(seed, 160), num_kv_heads, group, head_dim, block_size, seed
    )
    check_native(kv, meta, layers, group, fused=(head_dim // 8 + block_size // 4) % 2 == 1)


ROUTED = [(1, 1), (16, 16), (17, 17), (40, 16), (100, 17), (60, 0), (33, 33), (9, 1)]
"""Decode, short prompt, long prompt, short chunk, long chunk, idle, long prompt, decode."""


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("window", [None, 5, 20, 1000])
def test_routing_windows_softcap_and_uncovered_rows(
    monkeypatch: pytest.MonkeyPatch, window: int | None, softcap: float | None
) -> None:
    """Windows under a chunk, between the prompts' lengths and beyond every context;
    soft-capping sends every sequence to the kernel; rows outside sequences are zero."""
    calls: list[Tensor | None] = []

    def spy(*args: object, **kwargs: object) -> Tensor:
        calls.append(kwargs.get("attn_mask"))  # type: ignore[arg-type]
        return torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)  # type: ignore

    monkeypatch.setattr(torch_backend, "F", SimpleNamespace(scaled_dot_product_attention=spy))
    kv, meta, layers = make_step(ROUTED, 2, 4, 24, 4, seed=31, lead_rows=2)
    layers = add_trailing(meta, layers, 3)
    outs = check_native(kv, meta, layers, 4, window, softcap)
    calls.clear()  # the native run's calls only (not the reference's)
    run_layers(meta, layers, 4, window, softcap)
    step = meta.plan
    assert isinstance(step, NativeStep)
    assert step.kernel_seqs.tolist() == [0, 1, 3, 7]
    assert step.all_seqs.tolist() == [0, 1, 2, 3, 4, 6, 7]
    routed = sorted((int(g.rows[0, 0]) - 2, g.blocks is None) for g in step.groups)
    starts = meta.query_start_loc.tolist()
    assert routed == [(starts[2] - 2, True), (starts[4] - 2, False), (starts[6] - 2, True)]
    assert len(calls) == (0 if softcap else 3 * NUM_LAYERS)
    masked = [m is not None for m in calls[:3]]
    if not softcap:  # whole prompts use SDPA's causal mask unless the window cuts them
        assert masked == [window == 5, True, window in (5, 20)]
    tokens = meta.slot_mapping.shape[0]
    for out in outs:
        assert torch.equal(out[:2], torch.zeros_like(out[:2]))
        assert torch.equal(out[tokens - 3 :], torch.zeros_like(out[tokens - 3 :]))
    ref = paged_attention_ref(  # the plain reference too, over the stored cache
        layers[0][0, :8].transpose(0, 1), kv[:, 0, 0], kv[:, 0, 1], meta.block_tables,
        meta.seq_lens, meta.query_start_loc, 24**-0.5, window=window, softcap=softcap,
    )  # fmt: skip
    torch.testing.assert_close(outs[0], ref, atol=ATOL, rtol=RTOL)


def test_steps_without_kernel_or_sdpa_work() -> None:
    """Only long prompts (no kernel call), only decodes (no SDPA), only idle rows."""
    for seqs, lead in (([(20, 20), (40, 40)], 0), ([(5, 1), (70, 1)], 0), ([(12, 0)], 2)):
        kv, meta, layers = make_step(seqs, 2, 2, 16, 4, seed=len(seqs), lead_rows=lead)
        outs = check_native(kv, meta, layers, 2)
        if lead:
            assert all(torch.equal(o, torch.zeros_like(o)) for o in outs)


@st.composite
def random_steps(draw: st.DrawFn) -> list[tuple[int, int]]:
    seqs = []
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["decode", "prompt", "chunk", "idle"]))
        rows = {"decode": 1, "idle": 0}.get(kind, -1)
        rows = draw(st.integers(1, 40)) if rows < 0 else rows
        cached = 0 if kind == "prompt" else draw(st.integers(kind != "decode", 100))
        seqs.append((rows + cached, rows))
    return seqs


@given(
    seqs=random_steps(),
    heads=st.sampled_from([(4, 1), (2, 2), (2, 4), (1, 8)]),
    head_dim=st.sampled_from([16, 24, 32, 64, 128]),
    block_size=st.sampled_from([4, 16, 32]),
    window=st.none() | st.integers(1, 150),
    softcap=st.none() | st.floats(0.5, 50.0),
    lead=st.integers(0, 3),
    trail=st.integers(0, 3),
    fused=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_steps_match_reference(
    seqs: list[tuple[int, int]],
    heads: tuple[int, int],
    head_dim: int,
    block_size: int,
    window: int | None,
    softcap: float | None,
    lead: int,
    trail: int,
    fused: bool,
    seed: int,
) -> None:
    kv, meta, layers = make_step(seqs, heads[0], heads[1], head_dim, block_size, seed, lead)
    layers = add_trailing(meta, layers, trail)
    outs = check_native(kv, meta, layers, heads[1], window, softcap, fused)
    for out in outs:
        outside = torch.cat([out[:lead], out[out.shape[0] - trail :]])
        assert torch.equal(outside, torch.zeros_like(outside))


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "fused"])
def test_store_kv_writes_exactly_the_slotted_rows(layout: str) -> None:
    kv, meta, layers = make_step([(30, 5), (17, 1), (9, 9)], 2, 2, 24, 4, seed=3, lead_rows=2)
    slots = meta.slot_mapping
    slots[4] = -1  # one more token without a slot
    q, k, v = split(layers[1], 4, 2, fused=layout == "fused")
    if layout == "contiguous":
        k, v = k.contiguous(), v.contiguous()
    before, expected = kv.clone(), kv.clone()
    meta = planned(meta, backend_for("native", kv, 4))
    meta.backend.forward(meta, 1, q, k, v, layer_params(0.25, None, None))
    store_kv_ref(k, v, expected[:, 1, 0], expected[:, 1, 1], slots)
    assert torch.equal(kv.nan_to_num(7.0), expected.nan_to_num(7.0))
    changed = (kv.nan_to_num(7.0) != before.nan_to_num(7.0)).any(dim=(-1, -2))  # per slot
    assert int(changed.sum()) == 2 * int((slots >= 0).sum())  # K and V of each slotted token


def _set(name: str, index: object, value: Callable[[Tensor, Tensor], int]) -> Callable:
    def mutate(meta: attention.StepMetadata, kv: Tensor) -> None:
        getattr(meta, name)[index] = value(getattr(meta, name), kv)

    return mutate


BAD_STEPS = {
    "block id too large": (_set("block_tables", (1, 0), lambda t, kv: kv.shape[0]), "block ids"),
    "block id negative": (_set("block_tables", (2, 2), lambda t, kv: -1), "block ids"),
    "seq_len past table": (_set("seq_lens", 0, lambda t, kv: 100 * kv.shape[3]), "beyond"),
    "rows over keys": (_set("seq_lens", 2, lambda t, kv: 8), "more query rows than keys"),
    "start past tokens": (_set("query_start_loc", -1, lambda t, kv: int(t[-1]) + 1), "outside"),
    "starts decreasing": (_set("query_start_loc", 1, lambda t, kv: int(t[2]) + 1), "outside"),
    "slot past cache": (_set("slot_mapping", -1, lambda t, kv: kv.shape[0] * kv.shape[3]), "slot"),
}


def host_arrays(meta: attention.StepMetadata) -> dict[str, np.ndarray]:
    fields = ("slot_mapping", "block_tables", "seq_lens", "query_start_loc")
    return {name: getattr(meta, name).numpy() for name in fields}


@pytest.mark.parametrize("case", list(BAD_STEPS))
def test_bad_metadata_is_refused_before_the_kernel(case: str) -> None:
    mutate, message = BAD_STEPS[case]
    kv, meta, _ = make_step([(30, 5), (17, 1), (9, 9)], 2, 2, 16, 4, seed=4, lead_rows=1)
    native_backend.check_step(host_arrays(meta), kv.shape[0], 4)  # garbage past the tables
    mutate(meta, kv)
    with pytest.raises(ValueError, match=message):
        native_backend.check_step(host_arrays(meta), kv.shape[0], 4)
    with pytest.raises(ValueError, match=message):  # the plan refuses: no layer runs
        planned(meta, backend_for("native", kv, 4))


INDEX_DTYPES = {
    "int64 block_tables": lambda m: setattr(m, "block_tables", m.block_tables.long()),
    "int64 seq_lens": lambda m: setattr(m, "seq_lens", m.seq_lens.long()),
    "int64 query_start_loc": lambda m: setattr(m, "query_start_loc", m.query_start_loc.long()),
    "int32 slot_mapping": lambda m: setattr(m, "slot_mapping", m.slot_mapping.int()),
    "strided block_tables": lambda m: setattr(
        m, "block_tables", m.block_tables.repeat_interleave(2, 1)[:, ::2]
    ),
}


@pytest.mark.parametrize("case", list(INDEX_DTYPES))
def test_the_kernel_reads_its_own_index_copies(case: str) -> None:
    """Index arrays of other dtypes or strides: the plan's int32/int64 copies, the same
    results."""
    kv, meta, layers = make_step([(30, 1), (50, 1), (20, 20), (45, 3)], 2, 2, 32, 4, seed=1)
    INDEX_DTYPES[case](meta)
    check_native(kv, meta, layers, 2)
    step = meta.plan
    assert (step.tables.dtype, step.lens.dtype, step.starts.dtype) == (torch.int32,) * 3
    assert step.slots.dtype == torch.int64 and step.tables.stride(1) == 1


def test_the_backend_refuses_what_the_kernel_cannot_read() -> None:
    kv, meta, layers = make_step([(30, 1), (20, 20)], 2, 2, 32, 4, seed=2)
    meta = planned(meta, backend_for("native", kv, 4))
    q, k, v = split(layers[0], 4, 2, fused=False)
    key_cache, value_cache = meta.layer_caches[0]
    backend = meta.backend
    for args in (
        (q.double(), k, v, key_cache, value_cache),
        (q, k.transpose(1, 2).contiguous().transpose(1, 2), v, key_cache, value_cache),
        (q[:-1], k[:-1], v[:-1], key_cache, value_cache),  # not the step's tokens
        (q, k, v, key_cache, value_cache.half()),
        (q, k, v, key_cache, value_cache.contiguous()),  # another layout
    ):
        meta.layer_caches[0] = args[3:]
        with pytest.raises(ValueError, match="native attention takes"):
            backend.forward(meta, 0, *args[:3], layer_params(0.25, None, None))
    meta.layer_caches[0] = (key_cache, value_cache)
    assert not meta.plan.caches_checked  # refused steps leave the check to be made
    assert backend.forward(meta, 0, q, k, v, layer_params(0.25, None, None)).shape == q.shape
    assert meta.plan.caches_checked  # once per step: the other layers' caches share it
    layout = SimpleNamespace(
        num_layers=2, num_kv_heads=2, block_size=4, dtype=torch.float32, kv_dtype=None
    )
    cpu = torch.device("cpu")
    for head_dim, ok in ((256, True), (264, False)):
        kernels, why = native_backend.load(
            cpu, SimpleNamespace(**vars(layout), head_dim=head_dim), 4
        )
        assert (kernels is not None) == ok and ("beyond" in why) != ok
    for dtype, ok in ((torch.bfloat16, True), (torch.float16, False)):
        half = SimpleNamespace(**{**vars(layout), "dtype": dtype}, head_dim=32)
        kernels, why = native_backend.load(cpu, half, 4)
        assert (kernels is not None and kernels.dtype == dtype) == ok
        assert ok or "float32, bfloat16 on a CPU" in why


def test_native_and_torch_backends_agree() -> None:
    kv, meta, layers = make_step(mixed_seqs(5, 120), 2, 4, 32, 16, seed=5, lead_rows=1)
    kv_off = kv.clone()
    on = check_native(kv, meta, layers, 4)
    meta.layer_caches = [(kv_off[:, i, 0], kv_off[:, i, 1]) for i in range(NUM_LAYERS)]
    off = run_layers(planned(meta, backend_for("torch", kv_off, 8)), layers, 4)
    for a, b in zip(on, off, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)
    assert torch.equal(kv.nan_to_num(7.0), kv_off.nan_to_num(7.0))


def test_build_caches_its_library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = native_build.build(tmp_path)
    assert path.parent == tmp_path and [p.name for p in tmp_path.iterdir()] == [path.name]
    mtime = path.stat().st_mtime_ns
    run = native_build.subprocess.run

    def no_compiling(cmd: list[str], **kwargs: object) -> object:
        assert cmd[1:] == ["--version"], f"recompiled: {cmd}"
        return run(cmd, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(native_build.subprocess, "run", no_compiling)
    assert native_build.build(tmp_path) == path and path.stat().st_mtime_ns == mtime
    built = kernels_at(path)  # the cached library works
    monkeypatch.setattr(native_backend, "_loaded", lambda dtype: built)
    kv, meta, layers = make_step(mixed_seqs(16, 40), 2, 2, 16, 4, 3)
    check_native(kv, meta, layers, 2)
    assert meta.backend.kernels is built  # type: ignore[attr-defined]


def test_build_without_a_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("CC", "no-such-compiler-here")
    monkeypatch.setenv("PATH", str(empty))
    with pytest.raises(RuntimeError, match="no C compiler"):
        native_build.build(tmp_path / "kernels")
    assert not (tmp_path / "kernels").exists()
    native_backend._loaded.cache_clear()
    native_build.library.cache_clear()
    try:  # the torch backend runs instead, and says why
        layout = SimpleNamespace(
            num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, kv_dtype=None
        )
        backend, why = attention.choose_backend(
            torch.device("cpu"), SimpleNamespace(**vars(layout), dtype=torch.float32), 4, {}
        )
        assert backend.name == "torch" and "no C compiler" in why
    finally:
        native_backend._loaded.cache_clear()
        native_build.library.cache_clear()


def test_failing_compiler_leaves_no_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    false = shutil.which("false")
    assert false is not None
    monkeypatch.setenv("CC", false)
    with pytest.raises(RuntimeError, match="compiler failed"):
        native_build.build(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_hung_compiler_is_a_failed_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = native_build.subprocess.run

    def hanging(cmd: list[str], **kwargs: object) -> object:
        if cmd[1:] == ["--version"]:
            return run(cmd, **kwargs)  # type: ignore[call-overload]
        raise native_build.subprocess.TimeoutExpired(cmd, 300)

    monkeypatch.setattr(native_build.subprocess, "run", hanging)
    with pytest.raises(RuntimeError, match="did not run"):
        native_build.build(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_builds_are_kept_per_kind_of_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = native_build.build(tmp_path)
    monkeypatch.setattr(native_build, "_cpu_id", lambda: b"model name : another cpu")
    second = native_build.build(tmp_path)
    assert second != first and {p.name for p in tmp_path.iterdir()} == {first.name, second.name}


CPUINFO = Path("/proc/cpuinfo")
CPU_FLAGS = set(CPUINFO.read_text().split()) if CPUINFO.exists() else set()


@pytest.mark.parametrize(
    ("tune", "features"),
    [((), ("openmp",)), (("-march=native", "-mno-avx512f"), ("avx2", "openmp"))],
)
def test_the_portable_and_avx2_builds_match_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tune: tuple[str, ...],
    features: tuple[str, ...],
) -> None:  # fmt: skip
    """Built without ``-march=native`` (x86-64's baseline: SSE vectors) and without
    AVX-512 (AVX2 vectors), the kernel gives the same results, windows and soft-capping
    too."""
    if tune and not {"avx2", "fma"} <= CPU_FLAGS:
        pytest.skip("the CPU has no AVX2")
    monkeypatch.setattr(native_build, "TUNE", tune)
    built = kernels_at(native_build.build(tmp_path))
    assert built.features == features
    monkeypatch.setattr(native_backend, "_loaded", lambda dtype: built)
    for head_dim, block_size, window, softcap in ((20, 4, None, None), (32, 16, 9, 3.0)):
        kv, meta, layers = make_step(mixed_seqs(head_dim, 120), 2, 2, head_dim, block_size, 7)
        check_native(kv, meta, layers, 2, window, softcap)
        assert meta.backend.kernels is built  # type: ignore[attr-defined]


@pytest.mark.skipif("avx512f" not in CPU_FLAGS, reason="the CPU has no AVX-512")
def test_the_native_build_uses_avx512_where_the_cpu_has_it() -> None:
    """``-march=native`` on an AVX-512 CPU builds its vectors as AVX-512 registers (and
    the bf16 dot products where the CPU has AVX-512 BF16): the other tests then run them."""
    kernels = native_backend._loaded(torch.bfloat16)
    assert isinstance(kernels, NativeKernels)
    bf16 = ("avx512_bf16",) if "avx512_bf16" in CPU_FLAGS else ()
    assert kernels.features == ("avx2", "avx512", *bf16, "openmp")


def test_the_kernel_runs_on_torchs_threads() -> None:
    """The OpenMP build shares torch's thread pool (torch.set_num_threads sizes it: one
    runtime in the process, not a second pool competing with torch's), and a call's
    sequences spread over those threads give what one thread gives, bit for bit."""
    kernels = native_backend._loaded(torch.float32)
    assert isinstance(kernels, NativeKernels) and "openmp" in kernels.features
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert kernels.threads() == threads
            kv, meta, layers = make_step(mixed_seqs(32), 2, 2, 32, 16, 11)
            outs.append(check_native(kv, meta, layers, 2))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(one, two) for one, two in zip(*outs, strict=True))


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gemma3"])
def test_engine_greedy_is_the_same_either_way(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunked prompts with prefix hits (block size 4, 24-token chunks): kernel and SDPA
    routes, windows (gemma) and soft-capping (gemma2); both paths equal transformers."""
    checkpoint = make_tiny_model(tmp_path / arch, arch=arch)
    steps: list[NativeStep] = []
    plan = NativeBackend.plan

    def counting(*args: object, **kwargs: object) -> NativeStep:
        steps.append(plan(*args, **kwargs))  # type: ignore[arg-type]
        return steps[-1]

    monkeypatch.setattr(NativeBackend, "plan", counting)
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    outputs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("EXPEDITOR_NATIVE_CPU", flag)
        config = {"block_size": 4, "num_gpu_blocks": 128, "max_num_batched_tokens": 24}
        llm = LLM(checkpoint, device="cpu", dtype=torch.float32, max_model_len=256, **config)
        try:
            outputs[flag] = [c.token_ids for c in llm.generate(PROMPTS, greedy)]
        finally:
            llm.close()
        assert bool(steps) == (flag == "1")
    assert outputs["0"] == outputs["1"]
    chunks = [g.blocks is None for step in steps for g in step.groups]
    assert True in chunks and False in chunks  # whole prompts and later chunks took SDPA
    assert outputs["1"] == hf_greedy(checkpoint, PROMPTS, 10)
