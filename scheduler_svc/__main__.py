"""``python -m scheduler_svc``: the ``expeditor`` command line."""

from scheduler_svc.cli import main

main()
