"""CUDA graphs for decode-only steps.

A decode step of a few dozen sequences launches a few kernels per layer, each taking
the host longer to launch (transformers' eager modules: tens of microseconds per layer)
than the device to run. So at start-up the worker captures the model's forward for
decode-only batches once per batch-size bucket (:func:`graph_buckets`), over static
input tensors, and a decode step whose sequence count fits a bucket copies its inputs
into that bucket's tensors, padded (:func:`pad_decode`), and replays the graph: one
launch for the whole forward. Other steps (prefill chunks, more sequences than the
largest bucket) run eagerly, as do all steps off CUDA or with ``cuda_graphs = false``.

Padding rows are decodes of an empty sequence: token 0 at position 0, no cache slot
(slot -1: nothing stored), a context of one key read from block 0, and their outputs
are dropped. The block table is as wide as ``max_model_len`` needs, so any sequence
fits; the graphs share one memory pool, captured largest first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from gpu_worker.staging import Staging

__all__ = ["DecodeGraphs", "bucket_for", "graph_buckets", "is_decode_only", "pad_decode"]

INPUTS = ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc")
"""A step's host arrays (:meth:`gpu_worker.model_runner.StepInputs.host_arrays` plus
the token ids) that a captured forward reads."""


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes captured: 1, 2, 4, 8, then every multiple of 16 up to
    ``max_num_seqs``, which is always the last (a step pads to the next bucket: at most
    15 padding rows past 8, at most half the batch below)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    small = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    return [*small, *range(16, max_num_seqs, 16), max_num_seqs]


def bucket_for(num_seqs: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding ``num_seqs`` sequences (None: larger than all)."""
    for bucket in buckets:
        if bucket >= num_seqs:
            return bucket
    return None


def is_decode_only(arrays: dict[str, np.ndarray]) -> bool:
    """Every sequence of the step computes exactly one token."""
    seqs = arrays["seq_lens"].shape[0]
    return seqs > 0 and int(arrays["query_start_loc"][-1]) == seqs


def pad_decode(arrays: dict[str, np.ndarray], bucket: int, width: int) -> dict[str, np.ndarray]:
    """A decode-only step's arrays padded to ``bucket`` sequences and a block table
    ``width`` blocks wide (see the module docstring for what a padding row is)."""
    n = arrays["seq_lens"].shape[0]
    table = arrays["block_tables"]
    if n > bucket or table.shape[1] > width:
        raise ValueError(f"{n} sequences x {table.shape[1]} blocks do not fit {bucket} x {width}")
    out = {
        "input_ids": np.zeros(bucket, dtype=np.int64),
        "positions": np.zeros(bucket, dtype=np.int64),
        "slot_mapping": np.full(bucket, -1, dtype=np.int64),
        "block_tables": np.zeros((bucket, width), dtype=np.int32),
        "seq_lens": np.ones(bucket, dtype=np.int32),
        "query_start_loc": np.arange(bucket + 1, dtype=np.int32),
    }
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens"):
        out[name][:n] = arrays[name]
    out["block_tables"][:n, : table.shape[1]] = table
    return out


Forward = Callable[[dict[str, torch.Tensor], Any], torch.Tensor]
"""Inputs by name (device tensors, :data:`INPUTS`) and the attention schedule ->
hidden states [tokens, hidden]."""
Plan = Callable[[dict[str, np.ndarray]], Any]
"""A bucket's padded host arrays -> the attention schedule its graph is captured
with (fixed launches: no split-KV decodes), or None."""


class DecodeGraphs:
    """One captured forward per bucket over static inputs; :meth:`run` replays one."""

    def __init__(
        self,
        forward: Forward,
        plan: Plan,
        *,
        max_num_seqs: int,
        width: int,
        device: torch.device,
        staging: Staging,
    ) -> None:
        self.forward = forward
        self.plan = plan
        self.buckets = graph_buckets(max_num_seqs)
        self.width = width
        self.device = device
        self.staging = staging
        self.graphs: dict[int, Any] = {}
        self._inputs: dict[int, dict[str, torch.Tensor]] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._schedules: dict[int, Any] = {}
        """Each graph's schedule: its device tensors are read by the captured launches,
        so they live as long as the graph."""
        self.replays = 0

    def capture(self) -> None:
        """Capture every bucket, largest first, in one shared memory pool. Each is run
        eagerly once first (compiling its kernels, settling lazy allocations)."""
        pool = torch.cuda.graph_pool_handle()
        for bucket in sorted(self.buckets, reverse=True):
            empty = {
                "seq_lens": np.zeros(0, dtype=np.int32),
                "query_start_loc": np.zeros(1, dtype=np.int32),
                "block_tables": np.zeros((0, 1), dtype=np.int32),
                "input_ids": np.zeros(0, dtype=np.int64),
                "positions": np.zeros(0, dtype=np.int64),
                "slot_mapping": np.zeros(0, dtype=np.int64),
            }
            padded = pad_decode(empty, bucket, self.width)
            static = {name: torch.from_numpy(a).to(self.device) for name, a in padded.items()}
            schedule = self.plan(padded)
            with torch.inference_mode():
                self.forward(static, schedule)  # warm-up
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden = self.forward(static, schedule)
            self.graphs[bucket] = graph
            self._schedules[bucket] = schedule
            self._inputs[bucket] = static
            self._outputs[bucket] = hidden
        torch.cuda.synchronize(self.device)

    def run(self, arrays: dict[str, np.ndarray]) -> torch.Tensor | None:
        """The hidden states of a decode-only step by replaying its bucket's graph, or
        None when the step is not one a graph covers (it then runs eagerly)."""
        if not self.graphs or not is_decode_only(arrays):
            return None
        n = arrays["seq_lens"].shape[0]
        bucket = bucket_for(n, self.buckets)
        if bucket is None or arrays["block_tables"].shape[1] > self.width:
            return None
        sent = self.staging.to_device(pad_decode(arrays, bucket, self.width))
        static = self._inputs[bucket]
        for name in INPUTS:
            static[name].copy_(sent[name], non_blocking=True)
        self.graphs[bucket].replay()
        self.replays += 1
        return self._outputs[bucket][:n]
