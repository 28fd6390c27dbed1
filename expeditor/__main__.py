"""``python -m expeditor``: the ``expeditor`` command line."""

from expeditor.cli import main

main()
