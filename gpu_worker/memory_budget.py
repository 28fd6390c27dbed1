"""How many KV-cache blocks a CUDA worker allocates.

The cache takes what is left of ``total * gpu_memory_utilization`` after everything
else the worker will hold at its busiest:

- torch's peak over a profile run: the weights, a forward at the full token budget and
  the LM head and sampler over ``max_num_seqs`` rows in their most demanding mode
  (seeded top-p with logprobs: the fp32 ``[rows, vocab]`` temporaries, the sort and its
  indices);
- ``reserved``: device buffers allocated later at a fixed size (the swap staging
  buffer, :data:`gpu_worker.kv_cache.SWAP_STAGING_BYTES`);
- memory outside torch's allocator, measured from what the device reports free: the
  CUDA context, library workspaces, communication buffers -- and other processes on the
  same GPU, which the cache must not crowd out either.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MemoryProfile", "describe", "kv_cache_blocks"]


@dataclass(frozen=True, slots=True)
class MemoryProfile:
    """Bytes, read after the profile run (its tensors freed, torch's cache emptied)."""

    total: int
    """The device's memory."""
    free: int
    """What the device reports free now."""
    torch_reserved: int
    """What torch's allocator holds now (the weights, mostly)."""
    torch_peak: int
    """torch's peak allocation during the profile run."""

    @property
    def outside_torch(self) -> int:
        """In use but not by torch's allocator: the CUDA context, libraries, others."""
        return max(self.total - self.free - self.torch_reserved, 0)


def kv_cache_blocks(
    profile: MemoryProfile, utilization: float, reserved: int, bytes_per_block: int
) -> int:
    """Blocks that fit in ``total * utilization`` beside the profile's peak, memory
    outside torch and ``reserved`` bytes allocated later (may be < 1: no room)."""
    budget = (
        int(profile.total * utilization) - profile.torch_peak - profile.outside_torch - reserved
    )
    return budget // bytes_per_block


def describe(profile: MemoryProfile, utilization: float, reserved: int) -> str:
    """The figures behind a budget, for an error or a log line (GiB)."""
    gib = 2**30
    return (
        f"{profile.total / gib:.1f} GiB total at gpu_memory_utilization={utilization}: "
        f"torch peak {profile.torch_peak / gib:.2f} GiB, outside torch "
        f"{profile.outside_torch / gib:.2f} GiB, reserved {reserved / gib:.2f} GiB"
    )
