"""The client's DEALER socket: the checks of its CURVE keys, connecting it, and its two
ways of sending a frame (one that gives up when the client fails its calls, one that
never waits)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from ipc.schema import ClientMessage, encode
from shared.errors import InvalidRequestError

__all__ = ["CurveKeys", "connect", "curve_keys", "send", "send_nowait"]

logger = logging.getLogger(__name__)

CurveKeys = tuple[bytes, bytes, bytes]
"""(server key, public key, secret key) of a CURVE client."""


def curve_keys(
    server_key: bytes | None, public_key: bytes | None, secret_key: bytes | None
) -> CurveKeys | None:
    if server_key is None:
        if public_key is not None or secret_key is not None:
            raise ValueError("curve_public_key/curve_secret_key need curve_server_key")
        return None
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq was built without CURVE support")
    if (public_key is None) != (secret_key is None):
        raise ValueError("give both curve_public_key and curve_secret_key, or neither")
    if public_key is None or secret_key is None:
        public_key, secret_key = zmq.curve_keypair()
    for name, key in (("server", server_key), ("public", public_key), ("secret", secret_key)):
        if not isinstance(key, bytes) or len(key) not in (32, 40):
            raise ValueError(f"curve_{name}_key: expected 40 bytes of Z85 or 32 raw bytes")
    return server_key, public_key, secret_key


def connect(
    context: zmq.asyncio.Context, address: str, identity: bytes | None, curve: CurveKeys | None
) -> zmq.asyncio.Socket:
    """A DEALER socket (LINGER 0) connected to ``address``; closed again on any failure."""
    socket = context.socket(zmq.DEALER)
    try:
        socket.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            socket.setsockopt(zmq.ROUTING_ID, identity)
        if curve is not None:
            server_key, public_key, secret_key = curve
            socket.setsockopt(zmq.CURVE_SERVERKEY, server_key)
            socket.setsockopt(zmq.CURVE_PUBLICKEY, public_key)
            socket.setsockopt(zmq.CURVE_SECRETKEY, secret_key)
        socket.connect(address)
    except BaseException:
        socket.close(linger=0)
        raise
    return socket


async def send(
    socket: zmq.asyncio.Socket, message: ClientMessage, stuck_sends: set[asyncio.Future[None]]
) -> None:
    """Send one frame. A send held up by a full socket (the server has read nothing for
    long) adds a future to ``stuck_sends`` and gives up, the frame unsent, once that
    future is done (the client's ``_fail_all`` sets it)."""
    sent = socket.send(_encoded(message))
    if not sent.done():
        given_up = asyncio.get_running_loop().create_future()
        stuck_sends.add(given_up)
        try:
            await asyncio.wait((sent, given_up), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stuck_sends.discard(given_up)
            if not sent.done():
                sent.cancel()
    if not sent.cancelled():
        sent.result()


def send_nowait(socket: zmq.asyncio.Socket | None, message: ClientMessage) -> None:
    """Best-effort send that never waits; nothing without an open socket."""
    if socket is None or socket.closed:
        return
    sent = asyncio.ensure_future(socket.send(_encoded(message), zmq.NOBLOCK))
    sent.add_done_callback(_log_send_failure)


def _encoded(message: ClientMessage) -> bytes:
    """The frame; :class:`InvalidRequestError` for values msgpack cannot carry (a lone
    surrogate in a string, an integer past 64 bits, nesting past the recursion limit)."""
    try:
        return encode(message)
    except RecursionError:
        raise InvalidRequestError("the request cannot be sent: nested too deeply") from None
    except (OverflowError, UnicodeEncodeError, msgspec.EncodeError) as exc:
        raise InvalidRequestError(f"the request cannot be sent: {exc}") from None


def _log_send_failure(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and (error := future.exception()) is not None:
        logger.debug("best-effort send failed: %r", error)
