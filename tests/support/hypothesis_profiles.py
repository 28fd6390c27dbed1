"""Hypothesis profiles (pick one with ``HYPOTHESIS_PROFILE=<name>``; without it, ``ci``
when the ``CI`` environment variable is set, as CI services set it, else ``dev``):

``ci``
    Derandomized: the examples come from a seed derived from each test, so every run
    tests the same ones and a failure is reproducible; no example database; a failing
    example is printed with its reproduction blob. 300 examples per test (where a test
    does not set its own count).
``dev``
    The default for local runs: 150 random examples each run, failures remembered in
    the local ``.hypothesis/`` database and tried first next time.
``thorough``
    Random like ``dev``, 1000 examples: for a long local run.

None has a deadline: how long an example takes on a shared machine is no test.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from hypothesis import settings

# From Hypothesis's own defaults, not from whichever profile is loaded now (Hypothesis
# loads its built-in "ci" one by itself when CI is set).
_BASE = settings.get_profile("default")
settings.register_profile(
    "ci", _BASE, max_examples=300, derandomize=True, print_blob=True, deadline=None
)  # twice dev's examples: the same ones every run, so more of them
settings.register_profile("dev", _BASE, max_examples=150, deadline=None)
settings.register_profile("thorough", _BASE, max_examples=1000, deadline=None)


def hypothesis_profile(env: Mapping[str, str] = os.environ) -> str:
    """The profile ``env`` asks for: ``HYPOTHESIS_PROFILE``, else ``ci`` under CI."""
    if env.get("HYPOTHESIS_PROFILE"):
        return env["HYPOTHESIS_PROFILE"]
    return "ci" if env.get("CI", "").lower() not in ("", "0", "false", "no") else "dev"
