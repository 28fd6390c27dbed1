"""One step's packed inputs, and their index arrays built without per-token Python."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

__all__ = ["StepInputs", "group_arrays"]


@dataclass(slots=True)
class StepInputs:
    """One packed forward: every scheduled token side by side, sequence by sequence."""

    token_ids: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    """Per sequence, the position of its first new token (its new tokens' positions,
    and K/V slots, run on from there)."""
    tables: list[list[int]] = field(default_factory=list)
    """Per sequence, its block table."""
    query_start_loc: list[int] = field(default_factory=lambda: [0])
    """Offset of each sequence's first token in the packed batch, then the total."""

    def host_arrays(self, block_size: int, num_groups: int = 1) -> dict[str, np.ndarray]:
        """The step's index arrays, built without per-token Python: ``positions`` and
        ``slot_mapping`` (int64, per token), ``block_tables`` (int32, zero-padded),
        ``seq_lens`` and ``query_start_loc`` (int32). With ``num_groups`` layer groups
        (tables holding their blocks side by side, :class:`gpu_worker.kv_cache.
        LayerGroups`) also ``group_tables`` [groups, seqs, width] and ``group_slots``
        [groups, tokens], per group; ``block_tables`` and ``slot_mapping`` are then the
        first group's."""
        num_seqs = len(self.tables)
        query_start_loc = np.array(self.query_start_loc, dtype=np.int64)
        starts = np.array(self.starts, dtype=np.int64)
        num_tokens = query_start_loc[1:] - query_start_loc[:-1]
        total = int(query_start_loc[-1])
        if total == num_seqs and int(num_tokens.min(initial=1)) == 1:
            positions, owner = starts, np.arange(num_seqs)  # one token each
        else:
            positions = np.arange(total, dtype=np.int64) + np.repeat(
                starts - query_start_loc[:-1], num_tokens
            )
            owner = np.repeat(np.arange(num_seqs), num_tokens)
        table_lens = [len(table) for table in self.tables]
        width = max(table_lens, default=0)
        if width and min(table_lens) == width:
            tables = np.array(self.tables, dtype=np.int32)
        else:
            tables = np.zeros((num_seqs, max(width, num_groups)), dtype=np.int32)
            lens = np.array(table_lens, dtype=np.int64)
            tables[np.arange(tables.shape[1])[None, :] < lens[:, None]] = np.fromiter(
                itertools.chain.from_iterable(self.tables),
                dtype=np.int32,
                count=sum(table_lens),
            )
        arrays = {
            "positions": positions,
            "seq_lens": (starts + num_tokens).astype(np.int32),
            "query_start_loc": query_start_loc.astype(np.int32),
        }
        if num_groups > 1:
            groups = np.stack([tables[:, g::num_groups] for g in range(num_groups)])
            offset = positions % block_size
            slots = groups[:, owner, positions // block_size].astype(np.int64) * block_size
            slots += offset
            arrays.update(group_tables=groups, group_slots=slots)
            tables, slots = groups[0], slots[0]
        else:
            slots = tables[owner, positions // block_size].astype(np.int64) * block_size + (
                positions % block_size
            )
        arrays.update(slot_mapping=slots, block_tables=tables)
        return arrays


def group_arrays(arrays: dict[str, np.ndarray], group: int) -> dict[str, np.ndarray]:
    """A grouped step's arrays (:meth:`StepInputs.host_arrays`) as one group's: its
    ``block_tables`` and ``slot_mapping`` in place of the first group's."""
    return arrays | {
        "block_tables": arrays["group_tables"][group],
        "slot_mapping": arrays["group_slots"][group],
    }
