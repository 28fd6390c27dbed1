"""Plain HTTP requests to a gateway (``http://host:port``) with ``http.client``, for
what the openai client would not send or would hide: raw bodies, status codes, headers.
Every call takes the timeout its test allows."""

from __future__ import annotations

import http.client
import json
from typing import Any


def request(
    url: str,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    *,
    timeout: float,
    source: str | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one request to ``url`` (``http://host:port``), sent
    from the address ``source`` when given."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(
        host, int(port), timeout=timeout, source_address=(source, 0) if source else None
    )
    try:
        conn.request(method, path, body, headers or {})
        reply = conn.getresponse()
        return reply.status, dict(reply.getheaders()), reply.read()
    finally:
        conn.close()


def post(
    url: str,
    path: str,
    body: object,
    headers: dict[str, str] | None = None,
    *,
    timeout: float,
    source: str | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of a POST of ``body``: bytes as they are, anything else
    as JSON; the content type is JSON."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return request(
        url,
        "POST",
        path,
        data,
        {"content-type": "application/json", **(headers or {})},
        timeout=timeout,
        source=source,
    )


def post_json(*args: Any, **kwargs: Any) -> tuple[int, Any]:
    """(status, the reply's JSON) of :func:`post` (which takes the same arguments)."""
    status, _, payload = post(*args, **kwargs)
    return status, json.loads(payload)


def get(
    url: str, path: str, headers: dict[str, str] | None = None, *, timeout: float
) -> tuple[int, bytes]:
    """(status, body) of a GET."""
    status, _, payload = request(url, "GET", path, None, headers, timeout=timeout)
    return status, payload


def local(port: int) -> str:
    """The URL of a server on ``port`` of the loopback address."""
    return f"http://127.0.0.1:{port}"
