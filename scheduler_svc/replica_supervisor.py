"""``expeditor serve --data-parallel-size N``: N replicas and one gateway in front.

A replica is one scheduler with its worker group, run by a child ``expeditor serve``
(:mod:`scheduler_svc.supervisor`: it restarts the replica's dead workers and drains its
scheduler on stop). Each replica gets its own endpoints (replica ``i``: a tcp:// port
plus ``i``, an ipc:// path with ``.i`` appended; private sockets in this serve's runtime
directory when none are given), its own KV events (the gateway's prefix affinity reads
them), on CUDA its slice of the GPUs (``CUDA_VISIBLE_DEVICES``: ``tensor_parallel_size``
devices each) and on a CPU its share of the cores (``cpu_threads``, when not set).

With ``--http`` one gateway balances across the replicas (``[gateway]
replica_frontends`` and ``replica_kv_events``; :mod:`expeditor.gateway.replicas`).
serve prints the replicas' frontends on its first line, comma-separated, then the
gateway's URL. A replica that exits is started again (1 s, doubling to 10 s while it
keeps dying at once) at the same addresses; meanwhile the gateway sends its requests to
the others. On SIGINT/SIGTERM the replicas drain first, then the gateway stops.
"""

from __future__ import annotations

import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

import msgspec

from scheduler_svc import sdnotify
from scheduler_svc.supervisor import (
    READY_TIMEOUT_S,
    STOP_GRACE_S,
    child_env,
    gateway_url,
    wait_gateway,
    write_private_config,
)
from shared.config import SchedulerConfig, config_to_toml
from shared.errors import ConfigError
from shared.gateway_config import GatewayConfig, gateway_config_to_toml
from shared.server_config import ServerConfig, server_config_to_toml

__all__ = ["ReplicaSupervisor", "nth_endpoint", "one_replica", "replica_server"]

log = logging.getLogger("expeditor.serve")

RESTART_BACKOFF_MAX_S = 10.0


def nth_endpoint(address: str, index: int) -> str:
    """Replica ``index``'s variant of ``address``: tcp://HOST:PORT -> port + index,
    ipc://PATH -> PATH.index."""
    if address.startswith("tcp://"):
        host, port = address.rsplit(":", 1)
        return f"{host}:{int(port) + index}"
    return f"{address}.{index}"


def _gpus_visible() -> list[str] | None:
    """The GPUs this serve may use (CUDA_VISIBLE_DEVICES, else /dev/nvidiaN), None when
    the machine has none."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d for d in visible.split(",") if d.strip()] or None
    devices = sorted(
        int(p.name[len("nvidia") :])
        for p in Path("/dev").glob("nvidia[0-9]*")
        if p.name[len("nvidia") :].isdigit()
    )
    return [str(d) for d in devices] or None


def replica_server(
    server: ServerConfig, index: int, folder: Path | None = None
) -> tuple[ServerConfig, dict[str, str]]:
    """Replica ``index``'s [server] settings and environment: its endpoints (those
    given, offset by ``index``; else private sockets in ``folder``, or none for serve to
    make), its GPUs (``CUDA_VISIBLE_DEVICES``: ``tensor_parallel_size`` devices each) or
    on a CPU its share of the cores (``cpu_threads``, when not set)."""
    size = server.data_parallel_size
    gpus = _gpus_visible() if server.device != "cpu" else None
    ranks = server.tensor_parallel_size

    def endpoint(address: str, name: str) -> str:
        if address:
            return nth_endpoint(address, index)
        return f"ipc://{folder}/{name}" if folder is not None else ""

    threads = server.cpu_threads or (max(1, (os.cpu_count() or 1) // size) if gpus is None else 0)
    replica = msgspec.structs.replace(
        server,
        data_parallel_size=1,
        data_parallel_rank=index,
        frontend=endpoint(server.frontend, "frontend.sock"),
        worker_endpoint=endpoint(server.worker_endpoint, "workers.sock"),
        # connected to one subscriber, every replica's PUB socket goes to the same one
        kv_events_endpoint=server.kv_events_endpoint
        if server.kv_events_connect
        else endpoint(server.kv_events_endpoint, "kv-events.sock"),
        kv_events_replay_endpoint=nth_endpoint(server.kv_events_replay_endpoint, index)
        if server.kv_events_replay_endpoint
        else "",
        cpu_threads=threads,
    )
    env = {}
    if gpus is not None:
        share = [gpus[(index * ranks + r) % len(gpus)] for r in range(ranks)]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(share)
    return replica, env


def one_replica(
    server: ServerConfig, gateway: GatewayConfig | None, index: int
) -> tuple[ServerConfig, GatewayConfig | None, dict[str, str]]:
    """``serve --replica INDEX``: replica ``index`` of ``data_parallel_size`` alone (one
    systemd instance per replica), its gateway (with ``--http``) on port + ``index``."""
    if not 0 <= index < server.data_parallel_size:
        raise ConfigError(
            f"replica: {index} is not one of data_parallel_size "
            f"{server.data_parallel_size} replicas (0 .. {server.data_parallel_size - 1})",
            field="replica",
        )
    replica, env = replica_server(server, index)
    if gateway is not None:
        gateway = msgspec.structs.replace(gateway, port=gateway.port + index)
    return replica, gateway, env


class _Replica:
    def __init__(self, index: int, config_path: Path, env: dict[str, str]) -> None:
        self.index = index
        self.config_path = config_path
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.frontend = ""
        self.spawned_at = 0.0
        self.backoff = 0.0
        self.restart_at: float | None = None

    def spawn(self) -> None:
        command = [sys.executable, "-m", "expeditor", "serve", "--config", str(self.config_path)]
        # A session of its own: a terminal's Ctrl-C reaches this serve only, which
        # stops each replica with one SIGTERM (a second would cut its drain short).
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            env=self.env,
            start_new_session=True,
        )
        self.spawned_at = time.monotonic()


class ReplicaSupervisor:
    def __init__(
        self, server: ServerConfig, config: SchedulerConfig, gateway: GatewayConfig | None
    ) -> None:
        self.rundir = Path(tempfile.mkdtemp(prefix="expeditor-dp-"))  # mode 0700
        self.server = server
        self.size = server.data_parallel_size
        gpus = _gpus_visible() if server.device != "cpu" else None
        ranks = server.tensor_parallel_size
        if gpus is not None and len(gpus) < self.size * ranks:
            log.warning(
                "%d replicas of %d ranks on %d GPUs: replicas share GPUs",
                self.size,
                ranks,
                len(gpus),
            )
        self.replicas: list[_Replica] = []
        events: list[str] = []
        frontends: list[str] = []
        for index in range(self.size):
            folder = self.rundir / f"replica{index}"
            folder.mkdir(mode=0o700)
            replica, env = replica_server(server, index, folder)
            events.append(replica.kv_events_endpoint)
            frontends.append(replica.frontend)
            path = folder / "expeditor.toml"
            write_private_config(path, [server_config_to_toml(replica), config_to_toml(config)])
            self.replicas.append(_Replica(index, path, child_env(env)))
        self.gateway_config = (
            msgspec.structs.replace(
                gateway,
                replica_frontends=",".join(frontends),
                replica_kv_events=",".join(events),
            )
            if gateway is not None
            else None
        )
        self.gateway_path = self.rundir / "gateway.toml"
        if self.gateway_config is not None:
            first = msgspec.structs.replace(
                server,
                data_parallel_size=1,
                frontend=self.gateway_config.replica_list[0],
                worker_endpoint="",
            )
            write_private_config(
                self.gateway_path,
                [server_config_to_toml(first), gateway_config_to_toml(self.gateway_config)],
            )
        self.gateway: subprocess.Popen[bytes] | None = None
        self.stopping = False

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True

    def run(self) -> int:
        """0 after a stop every replica drained cleanly in; 1 when they could not start
        or one did not stop cleanly."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        try:
            started = self._start()
            if started:
                self._supervise()
        finally:
            failed = self._stop_all()
            shutil.rmtree(self.rundir, ignore_errors=True)
        if failed:
            log.error("%d replica(s) did not stop cleanly", failed)
        return 0 if (started or self.stopping) and not failed else 1

    def _start(self) -> bool:
        for replica in self.replicas:
            replica.spawn()
        if not self._wait_replicas():
            return False
        if self.gateway_config is not None:
            self.gateway = self._spawn_gateway()
            if not wait_gateway(self.gateway_config, lambda: self.gateway, lambda: self.stopping):
                return False
        print(",".join(r.frontend for r in self.replicas), flush=True)
        if self.gateway_config is not None:
            print(gateway_url(self.gateway_config), flush=True)
        sdnotify.ready(f"{self.size} replicas serving")
        return True

    def _spawn_gateway(self) -> subprocess.Popen[bytes]:
        command = [sys.executable, "-m", "expeditor", "gateway", "--config", str(self.gateway_path)]
        return subprocess.Popen(
            command, stdin=subprocess.DEVNULL, env=child_env(), start_new_session=True
        )

    def _wait_replicas(self) -> bool:
        """Until every replica printed its frontend (it serves); False if one exits or
        they take longer than READY_TIMEOUT_S."""
        selector = selectors.DefaultSelector()
        for replica in self.replicas:
            assert replica.proc is not None and replica.proc.stdout is not None
            selector.register(replica.proc.stdout, selectors.EVENT_READ, replica)
        deadline = time.monotonic() + READY_TIMEOUT_S
        waiting = len(self.replicas)
        while waiting and not self.stopping:
            if time.monotonic() > deadline:
                log.error("the replicas did not become ready within %.0f s", READY_TIMEOUT_S)
                return False
            for key, _ in selector.select(timeout=0.2):
                replica = key.data
                line = replica.proc.stdout.readline().decode().strip()
                selector.unregister(key.fileobj)
                if not line:
                    log.error("replica %d exited during start-up", replica.index)
                    return False
                replica.frontend = line
                waiting -= 1
        return not self.stopping

    def _supervise(self) -> None:
        while not self.stopping:
            now = time.monotonic()
            for replica in self.replicas:
                proc = replica.proc
                if proc is None or proc.poll() is None:
                    continue
                if replica.restart_at is None:
                    quick = now - replica.spawned_at < RESTART_BACKOFF_MAX_S
                    replica.backoff = (
                        min(2 * replica.backoff or 1.0, RESTART_BACKOFF_MAX_S) if quick else 1.0
                    )
                    replica.restart_at = now + replica.backoff
                    log.warning(
                        "replica %d exited with %s: restarting in %.1f s",
                        replica.index,
                        proc.returncode,
                        replica.backoff,
                    )
                elif now >= replica.restart_at:
                    replica.restart_at = None
                    replica.spawn()
            if self.gateway is not None and self.gateway.poll() is not None:
                log.warning("the gateway exited with %s: restarting", self.gateway.returncode)
                time.sleep(1.0)
                self.gateway = self._spawn_gateway()
            time.sleep(0.2)

    def _stop_all(self) -> int:
        """The replicas first (each drains its scheduler), then the gateway; the number
        of replicas that did not exit 0."""
        procs = [r.proc for r in self.replicas if r.proc is not None and r.proc.poll() is None]
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.server.shutdown_timeout_s + 2 * STOP_GRACE_S
        failed = 0
        for proc in procs:
            try:
                failed += proc.wait(timeout=max(0.1, deadline - time.monotonic())) != 0
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                failed += 1
        if self.gateway is not None and self.gateway.poll() is None:
            self.gateway.send_signal(signal.SIGTERM)
            try:
                self.gateway.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.gateway.kill()
                self.gateway.wait()
        return failed
