"""CUDA graphs for decode steps, and for speculative decoding's verify steps.

A decode step of a few dozen sequences launches a few kernels per layer, each taking
the host longer to launch (transformers' eager modules: tens of microseconds per layer)
than the device to run. So at start-up the worker captures the model's forward once per
shape: a batch-size bucket (:func:`graph_buckets`) times a number of rows per sequence,
1 (decodes) and, with ``num_speculative_tokens = k``, k + 1 (a verify step: a sequence's
last token and its proposals). A step whose sequences all fit one shape -- each at most
that many rows, no more sequences than the bucket -- copies its inputs into the shape's
static tensors, padded (:func:`pad_step`), and replays the graph: one launch for the
whole forward. Every other step (longer prefill chunks, more sequences than the largest
bucket, a shape past ``max_num_batched_tokens``) runs eagerly, as do all steps off CUDA
or with ``cuda_graphs = false``. Draft-model steps run eagerly too.

Padding never changes a real row. A sequence with fewer rows than its shape gets
padding rows after its own: its key count grows by as many, so its real rows keep their
positions (row i of a sequence with L keys and n rows sits at L - n + i) and see the
same keys; padding rows store nothing (slot -1), attend keys no real row sees, and are
dropped (the replay gathers the real rows, in the step's order, by an index staged with
the inputs). Padding sequences are token 0 at position 0 with one key from block 0.
Positions of padding rows are 0 (only rotary embeddings read them). Block tables are as
wide as ``max_model_len`` plus a verify step's rows need; the graphs share one memory
pool, captured largest first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from gpu_worker.staging import Staging

__all__ = ["DecodeGraphs", "bucket_for", "graph_buckets", "is_decode_only", "pad_step"]

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


def pad_step(
    arrays: dict[str, np.ndarray], bucket: int, width: int, rows: int = 1
) -> dict[str, np.ndarray]:
    """A step's arrays padded to ``bucket`` sequences of ``rows`` rows each and a block
    table ``width`` blocks wide, and ``"rows"``: where the real rows are in the padded
    step (the module docstring says what padding is)."""
    starts = arrays["query_start_loc"].astype(np.int64)
    counts = np.diff(starts)
    n, table = counts.shape[0], arrays["block_tables"]
    if n > bucket or table.shape[1] > width or (n and (counts.max() > rows or counts.min() < 1)):
        raise ValueError(
            f"{n} sequences of up to {counts.max() if n else 0} rows x {table.shape[1]} "
            f"blocks do not fit {bucket} x {rows} rows x {width}"
        )
    tokens = bucket * rows
    # Row r of real sequence s goes to s * rows + r: the real rows first in each sequence.
    seq_of = np.repeat(np.arange(n), counts)
    at = seq_of * rows + np.arange(starts[-1] if n else 0) - starts[:-1][seq_of]
    out = {
        "input_ids": np.zeros(tokens, dtype=np.int64),
        "positions": np.zeros(tokens, dtype=np.int64),
        "slot_mapping": np.full(tokens, -1, dtype=np.int64),
        "block_tables": np.zeros((bucket, width), dtype=np.int32),
        "seq_lens": np.full(bucket, rows, dtype=np.int32),
        "query_start_loc": np.arange(0, tokens + 1, rows, dtype=np.int32),
        "rows": at.astype(np.int64),
    }
    for name in ("input_ids", "positions", "slot_mapping"):
        out[name][at] = arrays[name]
    out["seq_lens"][:n] = arrays["seq_lens"] + (rows - counts)
    out["block_tables"][:n, : table.shape[1]] = table
    if "group_tables" in arrays:  # a cache of layer groups: each group's, padded alike
        tables = arrays["group_tables"]
        out["group_tables"] = np.zeros((tables.shape[0], bucket, width), dtype=np.int32)
        out["group_tables"][:, :n, : tables.shape[2]] = tables
        out["group_slots"] = np.full((tables.shape[0], tokens), -1, dtype=np.int64)
        out["group_slots"][:, at] = arrays["group_slots"]
    return out


Forward = Callable[[dict[str, torch.Tensor], Any], torch.Tensor]
"""Inputs by name (device tensors, :data:`INPUTS`) and the attention schedule ->
hidden states [tokens, hidden]."""
Plan = Callable[[dict[str, np.ndarray]], Any]
"""A shape's padded host arrays -> the attention schedule its graph is captured with
(fixed launches: no split-KV decodes), or None."""
Runs = Callable[[dict[str, np.ndarray]], bool]
"""Whether the backend's captured launches fit a padded step (the backend's
``graph_runs``)."""


class DecodeGraphs:
    """One captured forward per shape (bucket, rows per sequence) over static inputs;
    :meth:`run` replays one."""

    def __init__(
        self,
        forward: Forward,
        plan: Plan,
        *,
        max_num_seqs: int,
        width: int,
        device: torch.device,
        staging: Staging,
        rows: Iterable[int] = (1,),
        max_tokens: int | None = None,
        runs: Runs = lambda arrays: True,
        num_groups: int = 1,
    ) -> None:
        """``rows``: the rows per sequence captured (1, and k + 1 for speculation);
        ``max_tokens``: no shape of more tokens (``max_num_batched_tokens``);
        ``num_groups``: layer groups whose tables and slots the steps carry
        (``group_tables``, ``group_slots``: static inputs too)."""
        self.num_groups = num_groups
        self.forward = forward
        self.plan = plan
        self.runs = runs
        self.buckets = graph_buckets(max_num_seqs)
        self.rows = sorted(set(rows))
        self.shapes = [
            (bucket, r)
            for r in self.rows
            for bucket in self.buckets
            if r == 1 or max_tokens is None or bucket * r <= max_tokens
        ]
        self.width = width
        self.device = device
        self.staging = staging
        self.graphs: dict[tuple[int, int], Any] = {}
        self._inputs: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}
        self._schedules: dict[tuple[int, int], Any] = {}
        """Each graph's schedule: its device tensors are read by the captured launches,
        so they live as long as the graph."""
        self.replays = 0

    def capture(self) -> None:
        """Capture every shape, largest first, in one shared memory pool. Each is run
        eagerly once first (compiling its kernels, settling lazy allocations)."""
        pool = torch.cuda.graph_pool_handle()
        for shape in sorted(self.shapes, key=lambda s: s[0] * s[1], reverse=True):
            empty = {
                "seq_lens": np.zeros(0, dtype=np.int32),
                "query_start_loc": np.zeros(1, dtype=np.int32),
                "block_tables": np.zeros((0, 1), dtype=np.int32),
                "input_ids": np.zeros(0, dtype=np.int64),
                "positions": np.zeros(0, dtype=np.int64),
                "slot_mapping": np.zeros(0, dtype=np.int64),
            }
            if self.num_groups > 1:
                empty["group_tables"] = np.zeros((self.num_groups, 0, 1), dtype=np.int32)
                empty["group_slots"] = np.zeros((self.num_groups, 0), dtype=np.int64)
            padded = pad_step(empty, shape[0], self.width, shape[1])
            del padded["rows"]
            static = {name: torch.from_numpy(a).to(self.device) for name, a in padded.items()}
            schedule = self.plan(padded)
            with torch.inference_mode():
                self.forward(static, schedule)  # warm-up
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden = self.forward(static, schedule)
            self.graphs[shape] = graph
            self._schedules[shape] = schedule
            self._inputs[shape] = static
            self._outputs[shape] = hidden
        torch.cuda.synchronize(self.device)

    def shape_for(self, arrays: dict[str, np.ndarray]) -> tuple[int, int] | None:
        """The smallest captured shape the step fits, or None."""
        n = arrays["seq_lens"].shape[0]
        if not self.graphs or n == 0 or arrays["block_tables"].shape[1] > self.width:
            return None
        most = 1 if is_decode_only(arrays) else int(np.diff(arrays["query_start_loc"]).max())
        for r in self.rows:
            bucket = bucket_for(n, self.buckets) if r >= most else None
            if bucket is not None and (bucket, r) in self.graphs:
                return bucket, r
        return None

    def run(self, arrays: dict[str, np.ndarray]) -> torch.Tensor | None:
        """The hidden states of the step's rows by replaying its shape's graph, or None
        when no graph covers the step (it then runs eagerly)."""
        shape = self.shape_for(arrays)
        if shape is None:
            return None
        padded = pad_step(arrays, shape[0], self.width, shape[1])
        if not self.runs(padded):
            return None
        sent = self.staging.to_device(padded)
        static = self._inputs[shape]
        for name, tensor in static.items():  # INPUTS, and each layer group's
            tensor.copy_(sent[name], non_blocking=True)
        self.graphs[shape].replay()
        self.replays += 1
        out = self._outputs[shape]
        return out[: arrays["seq_lens"].shape[0]] if shape[1] == 1 else out[sent["rows"]]
