"""Where a worker's step goes: swap, forward, sampling, as the device spent them.

On CUDA the host only launches work; a timestamp taken after ``model(...)`` returns
marks the end of the launches, not of the forward, whose time would then show up in
whatever waits for the device next (the sampler's read of the tokens). So each mark
also records a CUDA event on the stream, and a step that read its tokens (which waits
for everything before it) measures its parts between events: no synchronisation added.
A step that read nothing, and every step off CUDA, measures on the host clock, where
work is done when the call returns.
"""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["EventClock"]


class EventClock:
    """Named marks of one step at a time: :meth:`start`, :meth:`mark` at each boundary,
    then :meth:`between` two marks."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self._host: dict[str, float] = {}
        self._events: dict[str, Any] = {}

    def start(self) -> None:
        self._host.clear()
        self._events.clear()
        self.mark("start")

    def mark(self, name: str) -> None:
        self._host[name] = time.perf_counter()
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            self._events[name] = event

    def between(self, first: str, last: str, device_done: bool) -> float:
        """Seconds from mark ``first`` to mark ``last``: on the device's clock when
        ``device_done`` (the host has since waited for the stream, so both events have
        happened), else on the host's."""
        if device_done and self.cuda:
            return self._events[first].elapsed_time(self._events[last]) / 1000.0
        return self._host[last] - self._host[first]
