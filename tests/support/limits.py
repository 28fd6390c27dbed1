"""How long tests wait before they fail: safety nets against a hang, far beyond what
anything needs when it works, never a measure of speed. One value per kind of wait."""

from __future__ import annotations

SAFETY_S = 30.0
"""A blocking call or a condition inside the test process (sockets, threads, an
in-process scheduler)."""

SERVE_SAFETY_S = 120.0
"""A condition that real ``expeditor serve`` processes must bring about (a worker
replaced, a request aborted, a drain finished) or a request sent to one."""

DAEMON_SAFETY_S = 60.0
"""A worker daemon's fake model load, waiting for the heartbeats it sends meanwhile."""
