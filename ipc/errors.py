"""Exceptions raised by :mod:`ipc.client`.

A request the scheduler refused or could not finish arrives as an ``ErrorReply``;
:func:`error_from_reply` turns it into a :class:`ServerError` subclass chosen by its
code, so callers can catch what they can act on::

    try:
        completion = client.generate("Hello", max_tokens=32)
    except OverloadedError:
        ...  # back off and retry
    except ServerError as error:
        print(error.code, error.message, error.request_id)

Failures on the client's side of the socket are :class:`ClientTimeoutError` (no answer
in time; a ``TimeoutError``), :class:`ServerUnavailableError` (nothing at all heard from
the server for the client's ``server_timeout_s``; a ``ConnectionError``) and
:class:`ClientClosedError` (the client was closed while the call waited). Bad
arguments caught before anything is sent raise ``ValueError`` or
:class:`shared.errors.InvalidRequestError`.
"""

from __future__ import annotations

from typing import Any

from ipc.schema import ErrorCode, ErrorReply

__all__ = [
    "UNREACHABLE",
    "BadRequestError",
    "ClientClosedError",
    "ClientTimeoutError",
    "InternalServerError",
    "OverloadedError",
    "QuarantinedError",
    "RequestRejectedError",
    "ServerError",
    "ServerUnavailableError",
    "ShuttingDownError",
    "UnknownRequestError",
    "WorkerLostError",
    "error_from_reply",
]


class ServerError(Exception):
    """The scheduler answered with an ``ErrorReply``; ``str(error)`` is ``"code: message"``.

    ``request_id`` is the request the reply was about, or ``None`` for a frame the
    server could not attribute to a request; ``field`` the request field it names, if any.
    """

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        request_id: str | None = None,
        field: str | None = None,
    ) -> None:
        super().__init__(code, message, request_id, field)
        self.code = code
        self.message = message
        self.request_id = request_id
        self.field = field

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class BadRequestError(ServerError):
    """``bad_request`` (malformed frame, wrong types, invalid parameters, a text prompt
    beyond the server's ``max_prompt_bytes``, token ids outside the model's vocabulary)
    or ``duplicate`` (the request id is already in use)."""


class UnknownRequestError(ServerError):
    """``unknown_request``: this client has no request with that id (an Abort of a
    request that never existed, was forgotten long ago, or belongs to another client)."""


class RequestRejectedError(ServerError):
    """``rejected``: the request can never fit (prompt + max_tokens beyond max_model_len
    or the whole KV capacity). Retrying the same request will not help."""


class OverloadedError(ServerError):
    """``overloaded``: the waiting queue is full. Back off and retry."""


class WorkerLostError(ServerError):
    """``worker_lost``: no worker was left to finish the request."""


class ShuttingDownError(ServerError):
    """``shutting_down``: the scheduler is stopping and takes no new work, or it stopped
    (past its ``shutdown_timeout_s``) before this request finished."""


class QuarantinedError(ServerError):
    """``quarantined``: workers died in two steps that ran this request, so the server
    will not run it again (other requests go on). Retrying it will likely fail again."""


class InternalServerError(ServerError):
    """``internal``: a server bug while handling the message (logged there); the server
    keeps serving."""


_ERRORS_BY_CODE: dict[ErrorCode, type[ServerError]] = {
    ErrorCode.BAD_REQUEST: BadRequestError,
    ErrorCode.DUPLICATE: BadRequestError,
    ErrorCode.UNKNOWN_REQUEST: UnknownRequestError,
    ErrorCode.REJECTED: RequestRejectedError,
    ErrorCode.OVERLOADED: OverloadedError,
    ErrorCode.WORKER_LOST: WorkerLostError,
    ErrorCode.SHUTTING_DOWN: ShuttingDownError,
    ErrorCode.QUARANTINED: QuarantinedError,
    ErrorCode.INTERNAL: InternalServerError,
}
"""The exception class of every :class:`~ipc.schema.ErrorCode` (a reply with a code
outside the enum fails decoding before it gets here)."""


def error_from_reply(reply: ErrorReply) -> ServerError:
    """The exception for ``reply``, the subclass its code maps to."""
    return _ERRORS_BY_CODE[reply.code](reply.code, reply.message, reply.request_id, reply.field)


class ClientTimeoutError(TimeoutError):
    """The server did not answer within the client's timeout.

    ``request_id`` names the request (``None`` for inspect/health/ping), ``timeout`` the
    limit in seconds and ``operation`` what timed out (``"generate"``, ``"health"``...).
    """

    def __init__(self, request_id: str | None, timeout: float, operation: str = "request") -> None:
        subject = operation if request_id is None else f"{operation} {request_id!r}"
        super().__init__(f"{subject}: no answer from the server within {timeout:g} s")
        self.request_id = request_id
        self.timeout = timeout
        self.operation = operation

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.request_id, self.timeout, self.operation))


class ClientClosedError(RuntimeError):
    """The client was closed (or its socket failed) while the call was waiting, or a
    call was made on a closed client."""


class ServerUnavailableError(ConnectionError):
    """Nothing at all came from the server for ``silent_s`` seconds while calls were
    waiting (not even a ``Pong`` to the client's pings): it is taken as gone, and every
    waiting call fails with this, whatever its own timeout.

    ``address`` is the server's address. The client stays usable: a later call succeeds
    once the server is back (ZeroMQ reconnects by itself). A request that failed this
    way may still have run on the server if it was only slow.
    """

    def __init__(self, address: str, silent_s: float) -> None:
        super().__init__(
            f"no answer from the server at {address} for {silent_s:.3g} s; is it running?"
        )
        self.address = address
        self.silent_s = silent_s

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.address, self.silent_s))


UNREACHABLE = (ServerUnavailableError, ClientTimeoutError, ClientClosedError)
"""The failures on the client's side: the server is not there, did not answer in time,
or the client closed (catch these as one)."""
