"""Which process is which, safely across pid reuse: a pid plus its start time names one
process for the life of the machine, and a host id says whether two processes share a
pid namespace (so that one may look the other up in ``/proc``)."""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path


def process_start_time(pid: int) -> int | None:
    """The start time of live process ``pid`` (field 22 of ``/proc/PID/stat``, clock
    ticks since boot), or None when there is no such process or it has exited (a zombie
    nobody reaped yet).

    The comm field (2) may hold spaces and parentheses, so the fields are counted from
    the last ``)``. A zombie group leader whose other threads still run counts as live.
    """
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 1 :].split()  # fields 3 (state) onwards
    state, num_threads, start_time = fields[0], int(fields[17]), int(fields[19])
    if state in ("Z", "X") and num_threads <= 1:
        return None
    return start_time


def process_alive(pid: int, start_time: int) -> bool:
    """Whether the process that had ``start_time`` still runs (pid reuse is not life)."""
    try:
        return process_start_time(pid) == start_time
    except OSError:  # e.g. hidden by hidepid=: assume alive
        return True


@cache
def host_id() -> str:
    """This boot of this machine plus this pid namespace; "" where /proc cannot tell.
    Two processes with the same non-empty host id can check each other's pids."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
    return f"{boot}/{namespace}"
