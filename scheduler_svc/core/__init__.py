"""The scheduler core: queues, KV-block accounting, admission, preemption and the step's
plan, as plain data structures and functions.

Everything here is free of I/O, threads and heavy libraries: it imports only ``shared``,
``ipc.schema`` and itself (checked by tests/test_layering.py), so it runs the same in
the daemon, in ``LLM`` and in the simulator, and its tests need no process.
"""
