"""Host <-> device transfers of a step, without making the host wait for the device.

A step's index tensors (positions, cache slots, block tables, the LM-head rows, the
sampler's parameters) are built on the host as numpy arrays. :meth:`Staging.to_device`
packs a group of them into one pinned host buffer and sends it with one ``non_blocking``
copy: the host goes on launching kernels while the copy waits its turn on the stream.
(``torch.tensor(list, device="cuda")`` instead copies from pageable memory and blocks
the host until the stream has run everything before it, the previous forward included.)

A pinned buffer may be refilled only once the device has read it: each of the
``SLOTS`` buffers records a CUDA event after its copy and is reused round-robin, waiting
on that event only if the device is that far behind (it never is in steady state: each
step that samples ends by reading its tokens).

:meth:`Staging.to_host` is the one way the step path reads device values back, and it
counts each call in :attr:`Staging.host_syncs`: a decode step makes exactly one (its
tokens, with their logprobs when asked). Off CUDA both directions are plain views.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from gpu_worker.event_clock import EventClock

__all__ = ["SLOTS", "Staging"]

SLOTS = 4
"""Pinned buffers in rotation."""

_ALIGN = 8


class Staging:
    """Transfers of one worker's steps to and from ``device``."""

    def __init__(self, device: torch.device, clock: EventClock | None = None) -> None:
        """``clock``: marked ``"read"`` just before each read (the end of the device's
        work for the step, on its clock)."""
        self.device = device
        self.clock = clock
        self.pinned = device.type == "cuda"
        self.host_syncs = 0
        """Blocking device-to-host reads so far (:meth:`to_host` calls)."""
        self.waits = 0
        """Times a pinned buffer was still being read and the host had to wait."""
        self.bytes_staged = 0
        self._buffers: list[torch.Tensor] = [torch.empty(0, dtype=torch.uint8)] * SLOTS
        self._events: list[Any] = [None] * SLOTS
        self._next = 0

    def to_device(self, arrays: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """The arrays as tensors on the device (same dtypes and shapes), in one copy."""
        if not self.pinned:
            return {
                name: torch.from_numpy(np.ascontiguousarray(a)).to(self.device)
                for name, a in arrays.items()
            }
        layout: list[tuple[str, np.ndarray, int]] = []
        size = 0
        for name, a in arrays.items():
            a = np.ascontiguousarray(a)
            layout.append((name, a, size))
            size += -(-a.nbytes // _ALIGN) * _ALIGN
        host = self._buffer(size)
        raw = host.numpy()
        for _, a, offset in layout:
            raw[offset : offset + a.nbytes] = a.reshape(-1).view(np.uint8)
        device_bytes = torch.empty(size, dtype=torch.uint8, device=self.device)
        device_bytes.copy_(host[:size], non_blocking=True)
        self._record()
        self.bytes_staged += size
        out: dict[str, torch.Tensor] = {}
        for name, a, offset in layout:
            dtype = _TORCH_DTYPES[a.dtype.str[1:]]
            view = device_bytes[offset : offset + a.nbytes].view(dtype)
            out[name] = view.view(a.shape)
        return out

    def to_host(self, tensor: torch.Tensor) -> list[Any]:
        """``tensor.tolist()``: the step's one blocking read (counted)."""
        self.host_syncs += 1
        if self.clock is not None:
            self.clock.mark("read")
        return tensor.tolist()

    def _buffer(self, size: int) -> torch.Tensor:
        slot = self._next
        event = self._events[slot]
        if event is not None and not event.query():
            self.waits += 1
            event.synchronize()
        if self._buffers[slot].numel() < size:
            self._buffers[slot] = torch.empty(
                max(size, 2 * self._buffers[slot].numel(), 4096), dtype=torch.uint8
            ).pin_memory()
        return self._buffers[slot]

    def _record(self) -> None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._events[self._next] = event
        self._next = (self._next + 1) % SLOTS


_TORCH_DTYPES: dict[str, torch.dtype] = {
    "i8": torch.int64,
    "i4": torch.int32,
    "f4": torch.float32,
    "f8": torch.float64,
    "u1": torch.uint8,
    "b1": torch.bool,
}
