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
in time; a ``TimeoutError``) and :class:`ClientClosedError` (the client was closed
while the call waited). Bad arguments caught before anything is sent raise
``ValueError`` or :class:`shared.errors.InvalidRequestError`.
"""

from __future__ import annotations

from typing import Any

from ipc.schema import ErrorReply

__all__ = [
    "BadRequestError",
    "ClientClosedError",
    "ClientTimeoutError",
    "OverloadedError",
    "RequestRejectedError",
    "ServerError",
    "ShuttingDownError",
    "UnknownRequestError",
    "WorkerLostError",
    "error_from_reply",
]


class ServerError(Exception):
    """The scheduler answered with an ``ErrorReply``; ``str(error)`` is ``"code: message"``.

    ``request_id`` is the request the reply was about, or ``None`` for a frame the
    server could not attribute to a request.
    """

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(code, message, request_id)
        self.code = code
        self.message = message
        self.request_id = request_id

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class BadRequestError(ServerError):
    """``bad_request`` (malformed frame, wrong types, invalid parameters) or
    ``duplicate`` (the request id is already in use)."""


class UnknownRequestError(ServerError):
    """``unknown_request``: the server holds no request with that id (e.g. an Abort for
    a request that finished and was forgotten, or never existed)."""


class RequestRejectedError(ServerError):
    """``rejected``: the request can never fit (prompt + max_tokens beyond max_model_len
    or the whole KV capacity). Retrying the same request will not help."""


class OverloadedError(ServerError):
    """``overloaded``: the waiting queue is full. Back off and retry."""


class WorkerLostError(ServerError):
    """``worker_lost``: no worker was left to finish the request."""


class ShuttingDownError(ServerError):
    """``shutting_down``: the scheduler is stopping and takes no new work."""


_ERRORS_BY_CODE: dict[str, type[ServerError]] = {
    "bad_request": BadRequestError,
    "duplicate": BadRequestError,
    "unknown_request": UnknownRequestError,
    "rejected": RequestRejectedError,
    "overloaded": OverloadedError,
    "worker_lost": WorkerLostError,
    "shutting_down": ShuttingDownError,
}


def error_from_reply(reply: ErrorReply) -> ServerError:
    """The exception for ``reply``: a subclass chosen by its code, or a plain
    :class:`ServerError` for a code this client does not know."""
    error_class = _ERRORS_BY_CODE.get(reply.code, ServerError)
    return error_class(reply.code, reply.message, reply.request_id)


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
