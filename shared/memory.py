"""Handing freed heap back to the operating system.

glibc's malloc keeps the pages of freed small objects in its arenas: after a large
request (a big JSON body decoded into many objects, a long tokenization) a process's
resident size stays at its peak although the memory is free. ``malloc_trim(0)`` returns
it. A no-op where the C library is not glibc.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util

__all__ = ["Trimmer", "malloc_trim"]

_libc_name = ctypes.util.find_library("c")
_LIBC = ctypes.CDLL(_libc_name) if _libc_name else None
if _LIBC is not None and not hasattr(_LIBC, "malloc_trim"):  # not glibc
    _LIBC = None


def malloc_trim() -> None:
    """Hand freed heap back to the OS (ctypes releases the GIL during the call, so a
    thread may run it while the event loop goes on)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


class Trimmer:
    """Trims on a thread, off the event loop, one trim at a time: a request for a trim
    while one runs makes one more run after it (what was freed meanwhile is returned
    too). Call :meth:`soon` from the event loop."""

    def __init__(self) -> None:
        self._task: asyncio.Task[None] | None = None
        self._again = False
        self.trims = 0
        """Trims done (for tests and logs)."""

    def soon(self) -> None:
        if self._task is not None and not self._task.done():
            self._again = True
            return
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            self._again = False
            await asyncio.to_thread(malloc_trim)
            self.trims += 1
            if not self._again:
                return
