"""A worker's tensor-parallel group: joining it (torch.distributed, gloo on CPU and NCCL
on CUDA) at the rendezvous the scheduler's setup names.

Every rank of a group runs every plan; rank 0's samples are the ones the scheduler
uses (every rank computes the same full logits, see :mod:`gpu_worker.tensor_parallel`).
A collective that waits longer than :data:`GROUP_TIMEOUT_S` for a peer fails, so a rank
whose peer died does not hang forever; the scheduler restarts the group as a whole.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["GROUP_TIMEOUT_S", "join_group"]

log = logging.getLogger("expeditor.worker")

GROUP_TIMEOUT_S = 120.0
"""How long the rendezvous and each collective wait for the other ranks."""


def join_group(
    rank: int, size: int, addr: str, port: int, device: torch.device
) -> dist.ProcessGroup:
    """Join the group of ``size`` ranks as ``rank`` (blocks until all have joined). Call
    on the thread that runs the steps, with ``device`` made current there
    (:func:`~gpu_worker.model_runner.use_device`): NCCL binds to it."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside a tensor-parallel group of {size}")
    if not addr or not port:
        raise ValueError("the tensor-parallel group needs dist_master_addr and dist_master_port")
    backend = "nccl" if device.type == "cuda" else "gloo"  # device: already current
    host = f"[{addr}]" if ":" in addr else addr
    log.info("rank %d of %d: joining the group at %s:%d (%s)", rank, size, addr, port, backend)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{host}:{port}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=GROUP_TIMEOUT_S),
    )
    group = dist.group.WORLD
    assert group is not None
    return group
