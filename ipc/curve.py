"""CURVE keys for the daemons and the clients: certificate files as written by
``expeditor keygen`` (the zmq.auth format: ``NAME.key`` holds the public key,
``NAME.key_secret`` both keys), the scheduler's allow-list authenticator, and the
client keyword arguments.

``tcp://`` and abstract ``ipc://@name`` endpoints have no file permissions to guard
them; with CURVE configured the scheduler serves them (and its frontend, always) as a
CURVE server whose ZAP handler admits only the public keys found in
``curve_authorized_clients`` (``*.key`` files, read at start). The handler sets each
connection's ``User-Id`` to the client's public key in Z85.
"""

from __future__ import annotations

import os
from pathlib import Path

import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator

from shared.errors import ConfigError

Z85_KEY_LEN = 40


def endpoint_needs_curve(address: str) -> bool:
    """True for the endpoints nothing but CURVE can guard: tcp:// and ipc://@name."""
    return address.startswith(("tcp://", "ipc://@"))


def load_certificate(path: str, field: str, *, secret: bool) -> tuple[bytes, bytes | None]:
    """(public, secret) keys of a certificate file; ``secret`` requires the secret key."""
    if not Path(path).is_file():
        raise ConfigError(f"{field}: no such certificate file: {path}", field=field)
    try:
        public_key, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{field}: {path}: not a certificate file: {exc}", field=field) from None
    if secret and secret_key is None:
        raise ConfigError(
            f"{field}: {path} holds no secret key; give the NAME.key_secret file "
            "`expeditor keygen` wrote",
            field=field,
        )
    for key in (public_key, secret_key):
        if key is not None and len(key) != Z85_KEY_LEN:
            raise ConfigError(
                f"{field}: {path}: malformed key (not 40 Z85 characters)", field=field
            )
    return public_key, secret_key


def authorized_keys(directory: str) -> set[bytes]:
    """The public keys of the ``*.key`` certificates in ``directory``."""
    field = "curve_authorized_clients"
    if not Path(directory).is_dir():
        raise ConfigError(f"{field}: no such directory: {directory}", field=field)
    return {
        load_certificate(str(path), field, secret=False)[0]
        for path in sorted(Path(directory).glob("*.key"))
    }


def client_curve_options(server_key_file: str, client_key_file: str) -> dict[str, bytes]:
    """Keyword arguments for :class:`ipc.client.Client` / ``AsyncClient``: the server's
    public key (either of its certificate files) and this client's key pair."""
    server_public, _ = load_certificate(server_key_file, "curve_server_key", secret=False)
    public_key, secret_key = load_certificate(client_key_file, "curve_client_key", secret=True)
    assert secret_key is not None
    return {
        "curve_server_key": server_public,
        "curve_public_key": public_key,
        "curve_secret_key": secret_key,
    }


def check_serve_keys(server_key_file: str, client_key_file: str, authorized_dir: str) -> None:
    """``serve`` with CURVE: the server's secret certificate, and a client key of its own
    (for its health checks on the frontend) that the allow-list admits."""
    load_certificate(server_key_file, "curve_server_key", secret=True)
    field = "curve_client_key"
    if not client_key_file:
        raise ConfigError(
            f"{field}: serve with CURVE needs a client key of its own for its health checks "
            "(`expeditor keygen DIR --name serve`, then copy DIR/serve.key into "
            "curve_authorized_clients)",
            field=field,
        )
    public_key, _ = load_certificate(client_key_file, field, secret=True)
    if public_key not in authorized_keys(authorized_dir):
        raise ConfigError(
            f"{field}: the public key of {client_key_file} is not in curve_authorized_clients "
            f"({authorized_dir}); copy its .key file there",
            field=field,
        )


class CurveServer:
    """The scheduler's key pair and the ZAP handler admitting the allow-listed clients.

    Create it before binding any socket: a CURVE handshake with no ZAP handler running
    is admitted whatever the client's key.
    """

    def __init__(self, ctx: zmq.asyncio.Context, server_key_file: str, authorized_dir: str) -> None:
        public_key, secret_key = load_certificate(server_key_file, "curve_server_key", secret=True)
        assert secret_key is not None
        self.public_key, self.secret_key = public_key, secret_key
        authorized_keys(authorized_dir)  # refuses a missing or unreadable allow-list
        self.authenticator = AsyncioAuthenticator(ctx)
        self.authenticator.start()
        self.authenticator.configure_curve(domain="*", location=authorized_dir)

    def secure(self, sock: zmq.asyncio.Socket) -> None:
        """Make ``sock`` (not bound yet) a CURVE server."""
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public_key)
        sock.setsockopt(zmq.CURVE_SERVER, 1)

    def stop(self) -> None:
        self.authenticator.stop()


def create_key_pair(directory: Path, name: str) -> tuple[Path, Path]:
    """Write ``directory/name.key`` (public, 0644) and ``name.key_secret`` (0600);
    ``directory`` is created 0700 if missing. Existing files are never overwritten."""
    if not name or "/" in name or name.startswith("."):
        raise ConfigError(f"--name: expected a plain file name, got {name!r}")
    public_file, secret_file = directory / f"{name}.key", directory / f"{name}.key_secret"
    for path in (public_file, secret_file):
        if path.exists():
            raise ConfigError(f"{path} exists; not overwriting it")
    previous = os.umask(0o077)  # the secret file is never readable by others, not even briefly
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        zmq.auth.create_certificates(directory, name)
    except OSError as exc:
        raise ConfigError(f"cannot write keys into {directory}: {exc}") from None
    finally:
        os.umask(previous)
    secret_file.chmod(0o600)
    public_file.chmod(0o644)
    return public_file, secret_file
