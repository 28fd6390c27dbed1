"""What several test modules use: the transformers oracle, harnesses, ports, waits and
time limits. Test modules import from here (``from support.x import y``), never from
one another (tests/test_layering.py checks it)."""
