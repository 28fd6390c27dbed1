"""Who an HTTP request is for, as the scheduler sees it, and what it may ask: the end-user
label the gateway sends with each scheduler request (fair share and the per-user queue
cap count per label), and the floor on the ``priority`` a client may pick.

The label is never a raw key: with an API key it is a hash of the key the client
presented together with the client's address (so holders of one shared key on
different machines are still separate users), else the client's address (an IPv6
client's /64).
"""

from __future__ import annotations

import hashlib
import ipaddress

from starlette.requests import Request

from expeditor.gateway.protocol import GatewayRequestError

__all__ = ["check_priority", "end_user"]


def _address(request: Request) -> str:
    """The client's address; an IPv6 one as its /64 (a host is given a whole /64 and
    could otherwise be as many users as it likes)."""
    client = request.client
    host = client.host if client is not None and client.host else "unknown"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address)


def end_user(request: Request, keyed: bool) -> str:
    """The end-user label of ``request``: ``key:<hash>@<address>`` when the gateway has
    an API key (the request passed its check), else ``addr:<address>``."""
    address = _address(request)
    if not keyed:
        return f"addr:{address}"
    header = request.headers.get("authorization", "")
    token = header.partition(" ")[2].strip().encode()
    digest = hashlib.sha256(b"expeditor-user\0" + token).hexdigest()[:16]
    return f"key:{digest}@{address}"


def check_priority(priority: int, floor: int) -> None:
    """400 naming ``priority`` when it asks for more urgency (a lower value) than
    ``min_client_priority`` allows."""
    if priority < floor:
        raise GatewayRequestError(
            f"priority: {priority} is below this server's min_client_priority={floor} "
            "(lower values are served first; a client may ask for less urgency, not more)",
            param="priority",
        )
