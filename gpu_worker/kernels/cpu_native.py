"""The CPU worker's native attention: ``paged_attention_cpu.c``, compiled once per machine.

On a CPU the torch path (:mod:`gpu_worker.cpu_plan`) spends most of an attention layer on
bookkeeping, not arithmetic: planning groups, gathering each group's K/V out of the paged
cache into a padded copy, masks, one SDPA call per group. The C kernel instead attends
every sequence of the step straight from the block tables, each key and value row read
once for all the query heads of its KV head, with an online softmax (decodes, prompt
chunks, windows and soft-capping alike), and stores the step's new K/V in their slots.
A sequence with more than :data:`PROMPT_ROWS` query rows (a prompt chunk) attends with
one SDPA call instead, where SDPA's blocked matmuls beat the kernel's vector-at-a-time
loops: a whole prompt over the step's own K/V with SDPA's causal mask, a later chunk over
its blocks gathered from the cache with a mask of its positions (and window); a layer
with soft-capping, which SDPA cannot apply, runs every sequence through the kernel.
:func:`plan_native_step` makes that split once per step (masks once per window).

Build: the first worker on a machine compiles the source with the system C compiler
(``$CC``, else ``cc``/``gcc``) into ``kernels/`` of expeditor's cache directory
(:func:`cache_dir`: ``$EXPEDITOR_CACHE_DIR``, else ``~/.cache/expeditor``), named by a
hash of the source, flags, compiler and CPU, so later workers load it in milliseconds; a
build is written under a temporary name and renamed, so concurrent workers never load
half a file. No compiler, a failed build or ``EXPEDITOR_NATIVE_CPU=0`` leaves
:func:`native_kernels` returning None, and the torch path runs instead (the worker logs
why once). Results equal the torch reference up to float rounding
(tests/kernels/test_cpu_native.py).

The kernel trusts its indices, so :func:`check_step` validates a step's metadata against
the cache (block ids in range, lengths within the tables, the index arrays' types and
layout) before the first layer calls it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from shared.paths import cache_dir as expeditor_cache_dir

__all__ = [
    "Chunk",
    "NativeKernels",
    "NativeStep",
    "check_step",
    "native_kernels",
    "plan_native_step",
    "supports",
]

log = logging.getLogger("expeditor.worker")

SOURCE = Path(__file__).with_name("paged_attention_cpu.c")
FLAGS = (
    "-O3",
    "-fPIC",
    "-shared",
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
)
"""Reassociation lets the compiler vectorise the dot products and sums; infinities (the
masked scores) keep their meaning."""
TUNE = ("-march=native",)
"""Tried first (the kernel runs where it is built); dropped if the compiler refuses."""
MAX_HEAD_DIM = 256
MAX_BLOCK_SIZE = 256
"""The kernel's limits (``MAX_HEAD_DIM``, ``MAX_BLOCK`` in the source)."""
PROMPT_ROWS = 16
"""Sequences with more query rows than this attend through SDPA, the rest through the
kernel."""

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


def cache_dir() -> Path:
    """Where built kernels are kept: ``kernels/`` in expeditor's cache directory
    (``$EXPEDITOR_CACHE_DIR``, else ``$XDG_CACHE_HOME/expeditor``, else
    ``~/.cache/expeditor``; the systemd worker unit sets it to its CacheDirectory)."""
    return expeditor_cache_dir() / "kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _version(compiler: str) -> str:
    try:
        done = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout


def _cpu_id() -> bytes:
    """What ``-march=native`` compiled for: the CPU's model and feature flags (a cache
    directory shared by different machines keeps one build per kind of CPU)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor().encode()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.startswith(wanted)})).encode()


def build(directory: Path | None = None) -> Path:
    """The compiled library's path, building it if this machine has none yet (raises
    ``RuntimeError`` saying why it cannot)."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler (set CC, or install cc/gcc)")
    source = SOURCE.read_bytes()
    directory = directory or cache_dir()
    errors = []
    for tune in (TUNE, ()):
        flags = (*FLAGS, *tune)
        key = hashlib.sha256(
            b"\0".join(
                [
                    source,
                    " ".join(flags).encode(),
                    _version(compiler).encode(),
                    platform.machine().encode(),
                    _cpu_id(),
                ]
            )
        ).hexdigest()[:16]
        target = directory / f"paged_attention_cpu-{key}.so"
        if target.exists():
            return target
        directory.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(dir=directory, suffix=".so.partial")
        os.close(fd)
        try:
            try:
                done = subprocess.run(
                    [compiler, *flags, "-o", partial, str(SOURCE), "-lm"],
                    capture_output=True,
                    text=True,
                    timeout=300,
                    check=False,
                )
            except (OSError, subprocess.SubprocessError) as exc:
                raise RuntimeError(f"{compiler} did not run: {exc}") from None
            if done.returncode == 0:
                os.replace(partial, target)
                return target
            errors.append(f"{compiler} {' '.join(flags)}: {done.stderr.strip()[-500:]}")
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    raise RuntimeError("the C compiler failed: " + " | ".join(errors))


class NativeKernels:
    """The compiled library's two entry points over torch tensors."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        self._attend = lib.expeditor_paged_attention_f32
        self._attend.restype = ctypes.c_int
        self._attend.argtypes = [_P, _I, _I, _P, _P, _I, _P, _I, _I, _P, _I, _P, _P, _P]
        self._attend.argtypes += [_I, _I, _I, _I, _I, _F, _I, _F]
        self._store = lib.expeditor_store_kv_f32
        self._store.restype = None
        self._store.argtypes = [_P, _I, _I, _P, _I, _I, _P, _P, _I, _I, _P, _I, _I, _I]

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write token t's ``key[t]``/``value[t]`` ([tokens, kv_heads, head_dim], rows
        contiguous) to slot ``slot_mapping[t]`` (int64; < 0: not stored)."""
        slots = slot_mapping.contiguous()
        self._store(
            key.data_ptr(),
            key.stride(0),
            key.stride(1),
            value.data_ptr(),
            value.stride(0),
            value.stride(1),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            key_cache.stride(0),
            key_cache.shape[1],
            slots.data_ptr(),
            slots.shape[0],
            key_cache.shape[2],
            key_cache.shape[3],
        )

    def paged_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        seqs: torch.Tensor,
        out: torch.Tensor,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> None:
        """Write the attention of sequences ``seqs`` (int64 indices) into their rows of
        ``out`` ([tokens, heads, head_dim], rows contiguous), over their cached keys
        (int32 metadata, checked by :func:`check_step`)."""
        rc = self._attend(
            query.data_ptr(),
            query.stride(0),
            query.stride(1),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            key_cache.stride(0),
            out.data_ptr(),
            out.stride(0),
            out.stride(1),
            block_tables.data_ptr(),
            block_tables.stride(0),
            seq_lens.data_ptr(),
            query_start_loc.data_ptr(),
            seqs.data_ptr(),
            seqs.shape[0],
            query.shape[1],
            key_cache.shape[2],
            key_cache.shape[3],
            key_cache.shape[1],
            scale,
            window,
            softcap,
        )
        if rc != 0:
            raise ValueError("native attention refused the shapes (see supports())")


@dataclass(slots=True)
class Chunk:
    """A sequence's query rows that attend through SDPA: more than :data:`PROMPT_ROWS`."""

    seq: int
    start: int
    """Its first query row in the step."""
    rows: int
    keys: int
    """Its keys after this step (``rows`` of them new: a whole prompt when equal)."""
    blocks: torch.Tensor | None = None
    """int64: its cache blocks (None for a whole prompt, which reads the step's own K/V)."""
    masks: dict[int, torch.Tensor | None] = field(default_factory=dict)
    """Per window (0: none), the boolean [rows, keys] mask; None: SDPA's own causal one."""

    def mask(self, window: int) -> torch.Tensor | None:
        if window in self.masks:
            return self.masks[window]
        mask = None
        if self.rows != self.keys or (window and window < self.rows):
            pos = torch.arange(self.keys - self.rows, self.keys)[:, None]
            key = torch.arange(self.keys)[None, :]
            mask = key <= pos
            if window:
                mask &= key > pos - window
        self.masks[window] = mask
        return mask


@dataclass(slots=True)
class NativeStep:
    """How a step's sequences split between the kernel and SDPA (every layer alike)."""

    all_seqs: torch.Tensor
    """int64 [num_seqs]: every sequence with query rows (a layer with soft-capping)."""
    kernel_seqs: torch.Tensor
    """int64: the sequences with at most :data:`PROMPT_ROWS` query rows."""
    chunks: list[Chunk]
    """The others, each one SDPA call."""
    uncovered: list[tuple[int, int]]
    """Query row ranges no sequence owns (zero in the output)."""

    def attend(
        self,
        kernels: NativeKernels,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """One layer's attention (its new K/V already stored): [tokens, heads, head_dim]."""
        out = torch.empty_like(query)
        for lo, hi in self.uncovered:
            out[lo:hi].zero_()
        sdpa = bool(self.chunks) and not softcap
        seqs = self.kernel_seqs if sdpa else self.all_seqs
        if seqs.numel():
            kernels.paged_attention(
                query,
                key_cache,
                value_cache,
                block_tables,
                seq_lens,
                query_start_loc,
                seqs,
                out,
                scale,
                window,
                softcap,
            )
        if not sdpa:
            return out
        for chunk in self.chunks:
            rows = slice(chunk.start, chunk.start + chunk.rows)
            if chunk.blocks is None:
                k, v = key[rows], value[rows]
            else:
                kv_shape = (-1, *key_cache.shape[2:])
                k = key_cache.index_select(0, chunk.blocks).view(kv_shape)[: chunk.keys]
                v = value_cache.index_select(0, chunk.blocks).view(kv_shape)[: chunk.keys]
            mask = chunk.mask(window)
            out[rows] = F.scaled_dot_product_attention(
                query[rows].transpose(0, 1)[None],
                k.transpose(0, 1)[None],
                v.transpose(0, 1)[None],
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=True,
            )[0].transpose(0, 1)
        return out


def plan_native_step(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    num_tokens: int,
) -> NativeStep:
    """Split a step's sequences (host metadata) for :meth:`NativeStep.attend`."""
    starts = query_start_loc.numpy().astype(np.int64)
    lens = seq_lens.numpy().astype(np.int64)
    q_lens = np.diff(starts)
    long = q_lens > PROMPT_ROWS
    chunks = []
    for index in np.flatnonzero(long).tolist():
        rows, keys = int(q_lens[index]), int(lens[index])
        blocks = None
        if rows != keys:
            blocks = block_tables[index, : -(-keys // block_size)].to(torch.int64)
        chunks.append(Chunk(index, int(starts[index]), rows, keys, blocks))
    uncovered = []
    first, last = (int(starts[0]), int(starts[-1])) if starts.size else (0, 0)
    if first > 0:
        uncovered.append((0, first))
    if last < num_tokens:
        uncovered.append((last, num_tokens))
    return NativeStep(
        all_seqs=torch.from_numpy(np.flatnonzero(q_lens > 0)),
        kernel_seqs=torch.from_numpy(np.flatnonzero((q_lens > 0) & ~long)),
        chunks=chunks,
        uncovered=uncovered,
    )


def native_kernels() -> NativeKernels | None:
    """This process's compiled kernels, or None: the torch path runs (the environment
    sets ``EXPEDITOR_NATIVE_CPU=0``, read at each call, or the build failed, logged once)."""
    if os.environ.get("EXPEDITOR_NATIVE_CPU", "1") == "0":
        return None
    return _loaded()


@functools.cache
def _loaded() -> NativeKernels | None:
    try:
        kernels = NativeKernels(build())
    except (RuntimeError, OSError) as exc:
        log.warning("CPU attention: torch path, the native kernel is unavailable: %s", exc)
        return None
    log.info("CPU attention: native kernel %s", kernels.path.name)
    return kernels


def supports(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether the native kernel takes these tensors: float32 on the CPU, rows contiguous,
    sizes within its scratch."""
    if {query.dtype, key_cache.dtype, value_cache.dtype} != {torch.float32}:
        return False
    if query.device.type != "cpu" or key_cache.device.type != "cpu":
        return False
    _, block_size, kv_heads, head_dim = key_cache.shape
    row = kv_heads * head_dim
    inner = (row, head_dim, 1)
    return (
        head_dim <= MAX_HEAD_DIM
        and block_size <= MAX_BLOCK_SIZE
        and query.shape[1] % kv_heads == 0
        and query.stride(2) == 1
        and tuple(key_cache.stride()[1:]) == inner
        and value_cache.stride() == key_cache.stride()
    )


def check_step(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Raise ``ValueError`` unless every index the kernels will follow is inside the
    cache and the step: query rows increasing within the query, each sequence's rows at
    most its length, its blocks in its table and in the cache, each slot in the cache;
    and the index arrays of the types and layout the kernels read (int32 tables, lengths
    and starts, int64 slots; rows contiguous)."""
    for name, tensor, dtype in (
        ("block_tables", block_tables, torch.int32),
        ("seq_lens", seq_lens, torch.int32),
        ("query_start_loc", query_start_loc, torch.int32),
        ("slot_mapping", slot_mapping, torch.int64),
    ):
        if tensor.dtype != dtype or tensor.device.type != "cpu":
            raise ValueError(
                f"{name} must be {dtype} on the CPU, got {tensor.dtype} on {tensor.device}"
            )
        if tensor.numel() and tensor.stride(-1) != 1:
            raise ValueError(f"{name} must have contiguous rows")
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    starts = query_start_loc.numpy().astype(np.int64)
    lens = seq_lens.numpy().astype(np.int64)
    q_lens = np.diff(starts)
    if starts.size and (starts[0] < 0 or starts[-1] > query.shape[0] or (q_lens < 0).any()):
        raise ValueError(f"query_start_loc {starts.tolist()} outside the step's tokens")
    if (q_lens > lens).any():
        raise ValueError("a sequence has more query rows than keys")
    width = block_tables.shape[1]
    if lens.size and int(lens.max()) > width * block_size:
        raise ValueError(f"a sequence of {int(lens.max())} keys beyond its {width}-block table")
    used = np.arange(width)[None, :] < -(-lens // block_size)[:, None]
    blocks = block_tables.numpy()[used]
    if blocks.size and (int(blocks.min()) < 0 or int(blocks.max()) >= num_blocks):
        raise ValueError(f"block ids outside the cache's {num_blocks} blocks")
    if slot_mapping.numel():
        if slot_mapping.shape[0] > query.shape[0]:
            raise ValueError("more slots than tokens")
        if int(slot_mapping.max()) >= num_blocks * block_size:
            raise ValueError(f"a slot outside the cache's {num_blocks * block_size} slots")
