"""Fair share reaches the end users of a shared client (issue 29, item 7): requests on one
connection that name different users (``Generate.user``, as the HTTP gateway sends) are
admitted round-robin like separate clients', a user's unfinished requests are capped
(``max_queued_per_user``, answered as overloaded = 429), and the gateway labels users
without raw keys and refuses a priority above its ceiling (item 14)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
import pytest
import zmq
import zmq.asyncio
from starlette.requests import Request
from support.frontend_bench import Bench, running_frontend
from support.limits import SAFETY_S

from expeditor.gateway.identity import check_priority, end_user
from expeditor.gateway.protocol import GatewayRequestError
from expeditor.gateway.responses import error_of
from ipc.errors import OverloadedError, error_from_reply
from ipc.schema import (
    Accepted,
    ErrorCode,
    ErrorReply,
    Generate,
    ServerMessage,
    encode,
    server_decoder,
)
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.frontend import Frontend
from shared.config import SchedulerConfig


@dataclass
class Connection:
    """One client connection to the bench's frontend (as the gateway is one)."""

    bench: Bench
    dealer: zmq.asyncio.Socket

    @property
    def frontend(self) -> Frontend:
        return self.bench.frontend

    @property
    def core(self) -> Scheduler:
        return self.bench.core

    async def generate(self, request_id: str, user: str) -> ServerMessage:
        message = Generate(request_id=request_id, prompt_token_ids=[1, 7, 7], user=user)
        await self.dealer.send(encode(message))
        return server_decoder.decode(await asyncio.wait_for(self.dealer.recv(), SAFETY_S))


@contextlib.asynccontextmanager
async def frontend_with(config: SchedulerConfig) -> AsyncIterator[Connection]:
    async with running_frontend(config) as bench:
        dealer = bench.context.socket(zmq.DEALER)
        dealer.connect(bench.address)
        try:
            yield Connection(bench, dealer)
        finally:
            dealer.close(linger=0)


def test_a_light_user_is_admitted_before_a_heavy_users_backlog_on_one_connection() -> None:
    """One connection (the gateway) queues six requests for user "heavy", then one for
    "light": the first step runs heavy's first and light's (two slots), not heavy's
    first two. Before, every request of the connection was one fair-share client, so
    light waited for heavy's whole backlog."""

    async def main() -> None:
        config = SchedulerConfig(num_gpu_blocks=64, max_model_len=64, max_num_seqs=2)
        async with frontend_with(config) as bench:
            for index in range(6):
                assert isinstance(await bench.generate(f"heavy-{index}", "heavy"), Accepted)
            assert isinstance(await bench.generate("light-0", "light"), Accepted)
            plan = bench.core.schedule()
            assert set(plan.num_scheduled_tokens) == {"heavy-0", "light-0"}

    asyncio.run(main())


def test_a_users_unfinished_requests_are_capped_with_an_overloaded_reply() -> None:
    """max_queued_per_user=3: heavy's fourth request is refused as overloaded (429 in
    the gateway) naming the cap, while light's first is still accepted."""

    async def main() -> None:
        config = SchedulerConfig(num_gpu_blocks=64, max_model_len=64, max_queued_per_user=3)
        async with frontend_with(config) as bench:
            for index in range(3):
                assert isinstance(await bench.generate(f"h{index}", "heavy"), Accepted)
            refused = await bench.generate("h3", "heavy")
            assert isinstance(refused, ErrorReply) and refused.code is ErrorCode.OVERLOADED
            assert "max_queued_per_user=3" in refused.message and "'heavy'" in refused.message
            error = error_from_reply(refused)
            assert isinstance(error, OverloadedError)
            assert error_of(error)["error"]["code"] == 429
            assert isinstance(await bench.generate("l0", "light"), Accepted)
            bench.frontend.end_request("h0")  # one finished: heavy may queue one more
            assert isinstance(await bench.generate("h4", "heavy"), Accepted)

    asyncio.run(main())


def test_the_default_cap_is_a_quarter_of_the_waiting_queue() -> None:
    async def main() -> None:
        config = SchedulerConfig(num_gpu_blocks=64, max_model_len=64, max_waiting_requests=8)
        async with frontend_with(config) as bench:
            assert isinstance(await bench.generate("a", "u"), Accepted)
            assert isinstance(await bench.generate("b", "u"), Accepted)
            refused = await bench.generate("c", "u")
            assert isinstance(refused, ErrorReply) and "max_queued_per_user=2" in refused.message

    asyncio.run(main())


def _request(host: str, authorization: str | None = None) -> Request:
    headers = [(b"authorization", authorization.encode())] if authorization else []
    scope = {"type": "http", "headers": headers, "client": (host, 5000), "method": "POST"}
    return Request(scope)


def test_the_gateway_labels_users_without_putting_keys_on_the_wire() -> None:
    assert end_user(_request("10.0.0.7"), keyed=False) == "addr:10.0.0.7"
    keyed = end_user(_request("10.0.0.7", "Bearer sekrit"), keyed=True)
    assert "sekrit" not in keyed and keyed.startswith("key:")
    # Same key, same machine: one user; another machine or key: another user.
    assert keyed == end_user(_request("10.0.0.7", "Bearer sekrit"), keyed=True)
    assert keyed != end_user(_request("10.0.0.8", "Bearer sekrit"), keyed=True)
    assert keyed != end_user(_request("10.0.0.7", "Bearer other"), keyed=True)


def test_an_ipv6_client_is_one_user_per_64_and_labels_are_bounded() -> None:
    one = end_user(_request("2001:db8:1:2::1"), keyed=False)
    assert one == "addr:2001:db8:1:2::/64"
    assert end_user(_request("2001:db8:1:2:ffff::9"), keyed=False) == one
    assert end_user(_request("2001:db8:1:3::1"), keyed=False) != one
    assert end_user(_request("::ffff:10.0.0.7"), keyed=False) == "addr:10.0.0.7"
    Generate(request_id="r", prompt_token_ids=[1], user="u" * 256)
    with pytest.raises(msgspec.ValidationError, match="length <= 256"):
        msgspec.msgpack.decode(
            encode(Generate(request_id="r", prompt_token_ids=[1], user="u" * 257)),
            type=Generate,
        )


def test_a_priority_above_the_ceiling_gets_400_naming_priority() -> None:
    check_priority(0, 0)
    check_priority(5, 0)  # less urgent than the default: always allowed
    check_priority(-3, -5)
    with pytest.raises(GatewayRequestError) as info:
        check_priority(-1, 0)
    assert info.value.status == 400 and info.value.param == "priority"
    assert "min_client_priority=0" in info.value.message
