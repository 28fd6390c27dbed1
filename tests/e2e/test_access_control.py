"""Access control: CURVE keys (``expeditor keygen``), the allow-list, the insecure_tcp
opt-out and owner-only socket files, with real ``expeditor serve`` processes."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from expeditor.cli import app
from gpu_worker.daemon import run_worker
from ipc.client import Client
from ipc.curve import CurveServer, check_serve_keys, client_curve_options, load_certificate
from ipc.errors import ClientTimeoutError
from scheduler_svc.launch import free_port, running_server
from shared.errors import ConfigError

runner = CliRunner()


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _keygen(directory: Path, name: str) -> tuple[Path, Path]:
    result = runner.invoke(app, ["keygen", str(directory), "--name", name])
    assert result.exit_code == 0, result.output
    return directory / f"{name}.key", directory / f"{name}.key_secret"


def _serve(*flags: str) -> tuple[int, str]:
    """``expeditor serve`` expected to refuse its configuration before starting anything:
    (exit status, stderr with its line wrapping undone)."""
    result = subprocess.run(
        [sys.executable, "-m", "expeditor", "serve", *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return result.returncode, " ".join(result.stderr.split())


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    """server and client A/serve key pairs; an allow-list holding A's and serve's keys."""
    key_dir, authorized = tmp_path / "keys", tmp_path / "authorized"
    server_public, server_secret = _keygen(key_dir, "server")
    a_public, a_secret = _keygen(key_dir, "alice")
    serve_public, serve_secret = _keygen(key_dir, "serve")
    authorized.mkdir()
    shutil.copy(a_public, authorized)
    shutil.copy(serve_public, authorized)
    return {
        "server_public": server_public,
        "server_secret": server_secret,
        "alice": a_secret,
        "serve": serve_secret,
        "authorized": authorized,
    }


# --------------------------------------------------------------------------- keygen


def test_keygen_writes_owner_only_secret_and_refuses_to_overwrite(tmp_path: Path) -> None:
    directory = tmp_path / "new" / "keys"
    old = os.umask(0)
    try:
        result = runner.invoke(app, ["keygen", str(directory), "--name", "alice"])
    finally:
        os.umask(old)
    assert result.exit_code == 0, result.output
    public, secret = directory / "alice.key", directory / "alice.key_secret"
    assert str(public) in result.output and str(secret) in result.output
    assert _mode(directory) == 0o700
    assert _mode(secret) == 0o600
    assert _mode(public) == 0o644
    public_key, secret_key = load_certificate(str(secret), "k", secret=True)
    assert secret_key is not None and len(public_key) == len(secret_key) == 40
    assert load_certificate(str(public), "k", secret=False) == (public_key, None)

    before = secret.read_bytes()
    again = runner.invoke(app, ["keygen", str(directory), "--name", "alice"])
    assert again.exit_code == 2
    assert "exists" in again.output and "not overwriting" in again.output
    assert secret.read_bytes() == before
    bad = runner.invoke(app, ["keygen", str(directory), "--name", "../x"])
    assert bad.exit_code == 2 and "--name" in bad.output


def test_keygen_default_name_is_server(tmp_path: Path) -> None:
    result = runner.invoke(app, ["keygen", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "server.key").is_file() and (tmp_path / "server.key_secret").is_file()


# --------------------------------------------------------------------------- key files


def test_key_file_errors_name_the_field_and_path(keys: dict[str, Path], tmp_path: Path) -> None:
    missing = tmp_path / "nope.key_secret"
    with pytest.raises(ConfigError, match="curve_client_key: no such certificate file") as info:
        client_curve_options(str(keys["server_public"]), str(missing))
    assert str(missing) in str(info.value)
    with pytest.raises(ConfigError, match=r"curve_client_key: .* holds no secret key"):
        client_curve_options(str(keys["server_public"]), str(keys["server_public"]))
    garbage = tmp_path / "garbage.key"
    garbage.write_text("hello\n")
    with pytest.raises(ConfigError, match=r"curve_server_key: .*not a certificate file"):
        client_curve_options(str(garbage), str(keys["alice"]))
    options = client_curve_options(str(keys["server_public"]), str(keys["alice"]))
    assert (
        options["curve_server_key"]
        == load_certificate(str(keys["server_secret"]), "k", secret=True)[0]
    )
    assert set(options) == {"curve_server_key", "curve_public_key", "curve_secret_key"}


def test_serve_keys_must_admit_serves_own_client(keys: dict[str, Path], tmp_path: Path) -> None:
    server, authorized = str(keys["server_secret"]), str(keys["authorized"])
    check_serve_keys(server, str(keys["serve"]), authorized)
    with pytest.raises(ConfigError, match="curve_client_key: serve with CURVE needs"):
        check_serve_keys(server, "", authorized)
    _, stranger = _keygen(tmp_path / "other", "stranger")
    with pytest.raises(ConfigError, match="not in curve_authorized_clients"):
        check_serve_keys(server, str(stranger), authorized)
    with pytest.raises(ConfigError, match=r"curve_server_key: .* holds no secret key"):
        check_serve_keys(str(keys["server_public"]), str(keys["serve"]), authorized)
    with pytest.raises(ConfigError, match="curve_authorized_clients: no such directory") as info:
        check_serve_keys(server, str(keys["serve"]), str(tmp_path / "none"))
    assert str(tmp_path / "none") in str(info.value)


def test_scheduler_refuses_a_missing_allow_list(keys: dict[str, Path], tmp_path: Path) -> None:
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    try:
        with pytest.raises(ConfigError, match="curve_authorized_clients: no such directory"):
            CurveServer(ctx, str(keys["server_secret"]), str(tmp_path / "none"))
    finally:
        ctx.term()


def test_worker_on_a_curve_endpoint_needs_a_client_key(keys: dict[str, Path]) -> None:
    code = run_worker(0, "tcp://127.0.0.1:1", "cpu", curve_server_key=str(keys["server_public"]))
    assert code == 2


def test_serve_with_curve_but_no_client_key_is_refused(keys: dict[str, Path]) -> None:
    code, stderr = _serve(
        "--curve-server-key",
        str(keys["server_secret"]),
        "--curve-authorized-clients",
        str(keys["authorized"]),
    )
    assert code == 2
    assert "curve_client_key: serve with CURVE needs a client key" in stderr


# --------------------------------------------------------------------------- transports


def test_tcp_without_keys_or_opt_out_is_refused() -> None:
    code, stderr = _serve("--frontend", f"tcp://127.0.0.1:{free_port()}")
    assert code == 2
    assert "tcp:// is open to every local user; it needs CURVE" in stderr
    assert "frontend:" in stderr and "insecure_tcp = true" in stderr


def test_abstract_ipc_without_curve_is_refused() -> None:
    code, stderr = _serve("--frontend", "ipc://@expeditor-test-frontend")
    assert code == 2
    assert "frontend: ipc://@expeditor-test-frontend is in the abstract socket namespace" in stderr


def test_client_cli_refuses_half_a_key_pair(keys: dict[str, Path]) -> None:
    result = runner.invoke(
        app,
        ["inspect", "--address", "tcp://127.0.0.1:1", "--curve-server-key", str(keys["alice"])],
    )
    assert result.exit_code == 2
    assert "--curve-client-key" in result.output


def test_insecure_tcp_serves_and_warns(model: Path) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    with running_server(model, "--frontend", address, "--insecure-tcp") as (printed, proc):
        assert printed == address
        with Client(address, timeout=60) as client:
            assert client.generate(prompt_token_ids=[1, 5, 6], max_tokens=2).usage
    assert proc.stderr is not None
    log = proc.stderr.read().decode()
    assert "WARNING" in log and "insecure_tcp" in log and address in log


def test_curve_admits_only_allow_listed_keys(model: Path, keys: dict[str, Path]) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    flags = [
        "--frontend",
        address,
        # The workers authenticate with serve's client key over CURVE too.
        "--worker-endpoint",
        f"tcp://127.0.0.1:{free_port()}",
        "--curve-server-key",
        str(keys["server_secret"]),
        "--curve-authorized-clients",
        str(keys["authorized"]),
        "--curve-client-key",
        str(keys["serve"]),
    ]
    alice = client_curve_options(str(keys["server_public"]), str(keys["alice"]))
    with running_server(model, *flags) as (printed, _):
        assert printed == address
        with Client(address, timeout=60, **alice) as client:
            completion = client.generate(prompt_token_ids=[1, 5, 6], max_tokens=3)
            assert completion.usage.completion_tokens == 3

        # An unknown key pair, and no CURVE at all: the handshake never completes.
        with Client(address, timeout=1.5, curve_server_key=alice["curve_server_key"]) as client:
            with pytest.raises(ClientTimeoutError):
                client.generate(prompt_token_ids=[1, 5, 6], max_tokens=2)
        with Client(address, timeout=1.5) as client:
            with pytest.raises(ClientTimeoutError):
                client.generate(prompt_token_ids=[1, 5, 6], max_tokens=2)

        # The CLI, keys from the environment.
        env = dict(
            os.environ,
            EXPEDITOR_CURVE_SERVER_KEY=str(keys["server_public"]),
            EXPEDITOR_CURVE_CLIENT_KEY=str(keys["alice"]),
        )
        out = subprocess.run(
            [sys.executable, "-m", "expeditor", "inspect", "--address", address, "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            check=True,
        )
        assert json.loads(out.stdout)["workers"][0]["state"] == "ready"


def test_socket_files_are_owner_only_under_umask_000(model: Path, tmp_path: Path) -> None:
    directory = tmp_path / "run" / "expeditor"
    front, workers = directory / "front.sock", directory / "workers.sock"
    old = os.umask(0)  # inherited by serve and its children
    try:
        with running_server(
            model, "--frontend", f"ipc://{front}", "--worker-endpoint", f"ipc://{workers}"
        ) as (address, _):
            assert address == f"ipc://{front}"
            assert stat.S_ISSOCK(front.stat().st_mode)
            assert _mode(front) == 0o600 and _mode(workers) == 0o600
            assert _mode(directory) == 0o700 and _mode(directory.parent) == 0o700
            with Client(address, timeout=60) as client:
                assert client.health().status == "ok"
    finally:
        os.umask(old)
