"""``expeditor serve``: the scheduler and N workers as supervised child processes.

Starts the scheduler, then the workers; waits until the server answers health "ok";
with an HTTP gateway (``serve --http``) starts it and waits until its /health answers
200; prints the frontend address on stdout, then the gateway's URL; restarts a worker
or the gateway when it dies (workers unless told not to); on SIGINT/SIGTERM stops
everything (the scheduler first, which drains) and removes its private runtime
directory. Exits non-zero if the scheduler dies or never becomes ready.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import msgspec

from ipc.client import Client
from ipc.curve import client_curve_options
from ipc.errors import ClientTimeoutError, ServerError
from ipc.schema import HealthState
from scheduler_svc import sdnotify
from shared.config import SchedulerConfig, config_to_toml
from shared.gateway_config import GatewayConfig, gateway_config_to_toml
from shared.server_config import SUPERVISED_ENV, ServerConfig, server_config_to_toml

log = logging.getLogger("expeditor.serve")

READY_TIMEOUT_S = 300.0
RESTART_BACKOFF_MAX_S = 10.0
STOP_GRACE_S = 15.0
"""How long a process gets to exit after SIGTERM (past the scheduler's drain) before
it is killed."""
MAX_FAILED_STARTS = 3
"""A worker that exits non-zero this many times before the server was ever ready is not
restarted again: serve gives up with status 1 (its log says why)."""


class Supervisor:
    def __init__(
        self, server: ServerConfig, config: SchedulerConfig, gateway: GatewayConfig | None = None
    ) -> None:
        self.rundir = Path(tempfile.mkdtemp(prefix="expeditor-"))  # mode 0700
        server = msgspec.structs.replace(
            server,
            frontend=server.frontend or f"ipc://{self.rundir}/frontend.sock",
            worker_endpoint=server.worker_endpoint or f"ipc://{self.rundir}/workers.sock",
        )
        self.server = server
        self.config_path = self.rundir / "expeditor.toml"
        tables = [server_config_to_toml(server), config_to_toml(config)]
        if gateway is not None:
            tables.append(gateway_config_to_toml(gateway))
        write_private_config(self.config_path, tables)
        self.gateway_config = gateway
        self.gateway: subprocess.Popen[bytes] | None = None
        self.gateway_restart_at: float | None = None
        self.scheduler: subprocess.Popen[bytes] | None = None
        self.workers: dict[int, subprocess.Popen[bytes]] = {}
        self.failed_starts: dict[int, int] = {}
        self.ready = False
        self.stopping = False
        self.workers_stopping = False
        self.spawned_at: dict[int, float] = {}
        self.backoff: dict[int, float] = {}
        """Per rank: the restart delay, doubled (0.5 s up to 10 s) while it keeps dying
        within 10 s of starting, so a worker crashing at once is not restarted in a
        tight loop."""
        self.restart_at: dict[int, float] = {}

    def _spawn(self, *args: str) -> subprocess.Popen[bytes]:
        command = [
            sys.executable,
            "-m",
            "expeditor",
            *args,
            "--config",
            str(self.config_path),
        ]
        return subprocess.Popen(command, stdin=subprocess.DEVNULL, env=child_env())

    def _spawn_worker(self, rank: int) -> None:
        self.workers[rank] = self._spawn("worker", "--rank", str(rank))
        self.spawned_at[rank] = time.monotonic()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """The first signal starts an orderly stop; a second one is passed on to the
        draining scheduler, which then stops at once."""
        if self.stopping and self.scheduler is not None and self.scheduler.poll() is None:
            self.scheduler.send_signal(signal.SIGTERM)
        self.stopping = True

    def run(self) -> int:
        """Serve until stopped: 0 after a stop that drained cleanly (the scheduler exited
        0), even one asked for while a worker or the gateway was still starting; 1 when
        the server could not start or its scheduler died."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        status = self._run()
        if self.stopping:  # asked to stop: the drain decides
            return 0 if self.scheduler is None or self.scheduler.returncode == 0 else 1
        return status

    def _run(self) -> int:
        try:
            self.scheduler = self._spawn("scheduler")
            for rank in range(self.server.num_ranks):
                self._spawn_worker(rank)
            if not self._wait_ready():
                return 1
            if self.gateway_config is not None:
                self.gateway = self._spawn("gateway")
                if not self._wait_gateway():
                    return 1
            print(self.server.frontend, flush=True)
            if self.gateway_config is not None:
                print(self.gateway_url, flush=True)
            sdnotify.ready(f"serving on {self.server.frontend}")
            return self._supervise()
        finally:
            self._stop_all()
            shutil.rmtree(self.rundir, ignore_errors=True)

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + READY_TIMEOUT_S
        server = self.server
        curve = (
            client_curve_options(server.curve_server_key, server.curve_client_key)
            if server.curve
            else {}
        )
        with Client(server.frontend, timeout=2.0, **curve) as client:
            while time.monotonic() < deadline and not self.stopping:
                if self.scheduler is None or self.scheduler.poll() is not None:
                    log.error("the scheduler exited during start-up")
                    return False
                if not self._restart_dead_workers():
                    return False
                try:
                    if client.health().status is HealthState.OK:
                        self.ready = True
                        return True
                except (ClientTimeoutError, ServerError):
                    pass
                time.sleep(0.2)
        if not self.stopping:
            log.error("the server did not become ready within %.0f s", READY_TIMEOUT_S)
        return False

    @property
    def gateway_url(self) -> str:
        assert self.gateway_config is not None
        return gateway_url(self.gateway_config)

    def _wait_gateway(self) -> bool:
        assert self.gateway_config is not None
        return wait_gateway(self.gateway_config, lambda: self.gateway, lambda: self.stopping)

    def _restart_dead_gateway(self) -> None:
        gateway = self.gateway
        if gateway is None or gateway.poll() is None or self.workers_stopping:
            return
        now = time.monotonic()
        if self.gateway_restart_at is None:
            log.warning("the gateway exited with %s: restarting in 1 s", gateway.returncode)
            self.gateway_restart_at = now + 1.0
        elif now >= self.gateway_restart_at:
            self.gateway_restart_at = None
            self.gateway = self._spawn("gateway")

    def _restart_dead_workers(self) -> bool:
        """Restart dead workers; False when one keeps failing before the server was ready."""
        for rank, proc in list(self.workers.items()):
            if proc.poll() is None:
                continue
            if not self.ready and proc.returncode != 0:
                self.failed_starts[rank] = self.failed_starts.get(rank, 0) + 1
                if self.failed_starts[rank] >= MAX_FAILED_STARTS:
                    log.error(
                        "worker rank %d failed to start %d times: giving up",
                        rank,
                        self.failed_starts[rank],
                    )
                    return False
            if self.server.restart_workers and not self.workers_stopping:
                now = time.monotonic()
                if rank not in self.restart_at:  # just seen dead: when may it come back?
                    quick = now - self.spawned_at.get(rank, now) < RESTART_BACKOFF_MAX_S
                    delay = min(2 * self.backoff.get(rank, 0.0) or 0.5, RESTART_BACKOFF_MAX_S)
                    self.backoff[rank] = delay if quick else 0.0
                    self.restart_at[rank] = now + self.backoff[rank]
                    log.warning(
                        "worker rank %d exited with %s: restarting in %.1f s",
                        rank,
                        proc.returncode,
                        self.backoff[rank],
                    )
                if now >= self.restart_at[rank]:
                    del self.restart_at[rank]
                    self._spawn_worker(rank)
            else:
                log.error("worker rank %d exited with %s", rank, proc.returncode)
                del self.workers[rank]
        return True

    def _supervise(self) -> int:
        while not self.stopping:
            assert self.scheduler is not None
            if self.scheduler.poll() is not None:
                log.error("the scheduler exited with %s", self.scheduler.returncode)
                return 1
            self._restart_dead_workers()
            self._restart_dead_gateway()
            time.sleep(0.2)
        return 0

    def _stop_all(self) -> None:
        """The scheduler first: it drains (requests in flight finish, for up to
        shutdown_timeout_s) while the workers, restarted if they die, still serve it;
        then the workers."""
        scheduler = self.scheduler
        if scheduler is not None and scheduler.poll() is None:
            scheduler.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + self.server.shutdown_timeout_s + STOP_GRACE_S
            while scheduler.poll() is None and time.monotonic() < deadline:
                self._restart_dead_workers()
                time.sleep(0.1)
        self.workers_stopping = True
        procs = [p for p in (scheduler, self.gateway, *self.workers.values()) if p is not None]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """A supervised child's environment: marked supervised (Ctrl-C is left to serve),
    without systemd's notify socket (serve itself reports readiness)."""
    env = dict(os.environ, **{SUPERVISED_ENV: "1"}, **(extra or {}))
    env.pop("NOTIFY_SOCKET", None)
    return env


def write_private_config(path: Path, tables: list[str]) -> None:
    """A new config file of ``tables``, readable by this user only (it may hold the
    gateway's API key)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write("\n".join(tables))


def gateway_url(config: GatewayConfig) -> str:
    host = config.host
    host = f"[{host}]" if ":" in host else host
    scheme = "https" if config.ssl_certfile else "http"
    return f"{scheme}://{host}:{config.port}"


def wait_gateway(
    config: GatewayConfig,
    process: Callable[[], subprocess.Popen[bytes] | None],
    stopping: Callable[[], bool],
) -> bool:
    """Until the gateway's /health answers 200; False if it exits or never does."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    url = gateway_url(config) + "/health"
    # Our own child's certificate (often self-signed, for another name): the probe
    # asks whether it serves, not who it is.
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    while time.monotonic() < deadline and not stopping():
        proc = process()
        if proc is None or proc.poll() is not None:
            log.error("the gateway exited during start-up")
            return False
        try:
            with urllib.request.urlopen(url, timeout=2.0, context=context) as reply:
                if reply.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    if not stopping():
        log.error("the gateway did not become ready within %.0f s", READY_TIMEOUT_S)
    return False


def run_serve(
    server: ServerConfig,
    config: SchedulerConfig,
    gateway: GatewayConfig | None = None,
    replica: int | None = None,
) -> int:
    """Serve until stopped. ``replica``: run only that one of ``data_parallel_size``
    replicas (one systemd instance per replica), on its own addresses and devices."""
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    if replica is not None:
        from scheduler_svc.replica_supervisor import one_replica

        server, gateway, env = one_replica(server, gateway, replica)
        os.environ.update(env)
        return Supervisor(server, config, gateway).run()
    if server.data_parallel_size > 1:
        from scheduler_svc.replica_supervisor import ReplicaSupervisor

        return ReplicaSupervisor(server, config, gateway).run()
    return Supervisor(server, config, gateway).run()
