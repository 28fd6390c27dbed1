"""Grammar compiles run on their own two threads, at lower CPU priority than the rest
of the scheduler process (Linux sets niceness per thread)."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from scheduler_svc.structured_output import COMPILE_NICE, COMPILE_THREADS


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_compile_threads_are_nicer_than_the_process() -> None:
    def niceness() -> tuple[str, int]:
        tid = threading.get_native_id()
        return threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, tid)

    ours = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    name, theirs = COMPILE_THREADS.submit(niceness).result()
    assert name.startswith("grammar")
    assert theirs == min(19, ours + COMPILE_NICE)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == ours  # ours unchanged
