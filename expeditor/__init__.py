"""What sits on top of the services: the ``expeditor`` command line and the bench harness.

Nothing below this package (``shared``, ``ipc``, ``scheduler_svc``, ``gpu_worker``)
imports it; see the dependency rules in docs/architecture.md.
"""
