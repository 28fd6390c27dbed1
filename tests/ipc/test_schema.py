"""Wire messages: msgpack round trips, the tagged decoder's refusals, frozen structs."""

from __future__ import annotations

import msgspec
import pytest

from ipc.schema import (
    BatchPlan,
    BlockUpdate,
    BlockUsage,
    Delta,
    ErrorCode,
    ErrorReply,
    HealthState,
    HealthStatus,
    InspectReply,
    NewSeq,
    PrefixCacheStats,
    SchedulerSnapshot,
    SeqInfo,
    SeqStatus,
    ServerMessage,
    StepResult,
    StepTimes,
    StepTiming,
    WorkerHello,
    WorkerInfo,
    WorkerStatus,
    decode,
    encode,
    server_decoder,
)
from shared.outputs import FinishReason
from shared.sampling import SamplingParams


def make_plan() -> BatchPlan:
    return BatchPlan(
        step=7,
        num_scheduled_tokens={"a": 5, "b/0": 1, "b/1": 1},
        new_seqs=[
            NewSeq(
                seq_id="a",
                request_id="a",
                sample_index=0,
                token_ids=[5, 6, 7, 8, 9, 10],
                num_prompt_tokens=6,
                num_computed_tokens=1,
                block_ids=[3, 4],
                sampling=SamplingParams(
                    temperature=0.0, max_tokens=8, n=2, stop_token_ids=(4,), stop=("x",)
                ),
            )
        ],
        block_updates=[BlockUpdate(seq_id="b/0", appended=[9], replaced=[(1, 12)])],
        freed_seq_ids=["old"],
        swap_out=[(1, 0), (2, 1)],
        swap_in=[(3, 5)],
        copies=[(7, 12)],
        num_samples={"a": 2},
    )


def make_snapshot() -> SchedulerSnapshot:
    return SchedulerSnapshot(
        step=3,
        num_running=1,
        num_waiting=1,
        num_swapped=0,
        gpu_blocks=BlockUsage(total=10, free=4, cached=2),
        cpu_blocks=BlockUsage(total=8, free=8),
        prefix_cache=PrefixCacheStats(queried_tokens=20, hit_tokens=8),
        preemptions={"swap": 1, "recompute": 2},
        finished={"stop": 1, "length": 0, "abort": 0, "rejected": 1},
        seqs=[
            SeqInfo(
                seq_id="a",
                request_id="a",
                state=SeqStatus.RUNNING,
                priority=0,
                num_prompt_tokens=6,
                num_output_tokens=2,
                num_computed_tokens=7,
                num_gpu_blocks=2,
                num_cpu_blocks=0,
                num_preemptions=1,
            )
        ],
    )


def test_batch_plan_round_trip() -> None:
    plan = make_plan()
    back = decode(encode(plan))
    assert isinstance(back, BatchPlan)
    assert back == plan
    assert back.swap_out == [(1, 0), (2, 1)]
    assert back.block_updates[0].replaced == [(1, 12)]
    assert back.new_seqs[0].sampling == plan.new_seqs[0].sampling
    assert back.new_seqs[0].sampling.stop_token_ids == (4,)
    assert back.num_samples == {"a": 2}
    assert back.total_tokens == 7
    # Batch order is kept.
    assert list(back.num_scheduled_tokens) == ["a", "b/0", "b/1"]


def test_empty_batch_plan_round_trip() -> None:
    plan = BatchPlan(step=0, num_scheduled_tokens={})
    back = decode(encode(plan))
    assert back == plan
    assert back.total_tokens == 0


def test_step_result_round_trip_with_logprobs() -> None:
    result = StepResult(
        step=7,
        sampled_token_ids={"a": [11, 12], "b/0": [13]},
        logprobs={"a": [{11: -0.5, 3: -1.25}, {12: -0.1}], "b/0": [{13: 0.0}]},
        timing=StepTiming(swap_s=0.001, forward_s=0.02, sample_s=0.003, total_s=0.025),
    )
    back = decode(encode(result))
    assert isinstance(back, StepResult)
    assert back == result
    assert back.logprobs is not None
    assert back.logprobs["a"][0] == {11: -0.5, 3: -1.25}
    assert all(isinstance(k, int) for k in back.logprobs["a"][0])


def test_step_result_defaults_round_trip() -> None:
    result = StepResult(step=1, sampled_token_ids={})
    back = decode(encode(result))
    assert back == result
    assert back.logprobs is None
    assert back.timing == StepTiming()


def test_worker_hello_round_trip() -> None:
    hello = WorkerHello(
        rank=1,
        pid=4242,
        device="cuda:1",
        num_gpu_blocks=1000,
        kv_bytes_per_block=2 << 20,
        block_size=16,
        model="tiny",
        eos_token_ids=[2, 7],
    )
    back = decode(encode(hello))
    assert isinstance(back, WorkerHello)
    assert back == hello


def test_snapshot_round_trip() -> None:
    snapshot = make_snapshot()
    back = decode(encode(snapshot))
    assert isinstance(back, SchedulerSnapshot)
    assert back == snapshot
    assert back.prefix_cache.hit_rate == pytest.approx(0.4)


def test_inspect_reply_carries_step_times_and_old_replies_still_decode() -> None:
    times = StepTimes(schedule=0.2, transfer=0.5, forward=3.0, sample=0.4, outputs=0.1, steps=7)
    reply = InspectReply(
        snapshot=make_snapshot(),
        workers=[],
        config={"block_size": 4},
        model="m",
        frontend="f",
        step_times=times,
        step_times_total=msgspec.structs.replace(times, steps=9),
    )
    back = server_decoder.decode(encode(reply))
    assert back == reply and isinstance(back, InspectReply)
    assert back.step_times is not None and back.step_times.steps == 7
    # a server from before step_times: its reply decodes, the fields are None
    raw = msgspec.msgpack.decode(encode(reply))
    del raw["step_times"], raw["step_times_total"]
    old = server_decoder.decode(msgspec.msgpack.encode(raw))
    assert isinstance(old, InspectReply)
    assert old.step_times is None and old.step_times_total is None

    class OldInspectReply(
        msgspec.Struct, frozen=True, kw_only=True, tag="inspect_reply", tag_field="type"
    ):
        snapshot: SchedulerSnapshot | None
        workers: list[WorkerInfo]
        config: dict[str, object]
        model: str
        frontend: str

    # a client from before step_times ignores the fields it does not know
    assert msgspec.msgpack.decode(encode(reply), type=OldInspectReply).model == "m"


def test_frames_carry_their_tag() -> None:
    raw = msgspec.msgpack.decode(encode(make_plan()))
    assert raw["type"] == "plan"
    assert msgspec.msgpack.decode(encode(StepResult(step=0, sampled_token_ids={})))["type"] == (
        "result"
    )


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\xff\xff\xff", b"not msgpack at all"])
def test_decoder_rejects_garbage(data: bytes) -> None:
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        decode(data)


ENUMERATED = [
    # (message, path of the enumerated field, its wire value)
    (ErrorReply(request_id="r", code=ErrorCode.WORKER_LOST, message="m"), ("code",), "worker_lost"),
    (
        Delta(request_id="r", index=0, token_ids=[], text="", finish_reason=FinishReason.LENGTH),
        ("finish_reason",),
        "length",
    ),
    (
        HealthStatus(
            status=HealthState.DEGRADED, workers_ready=0, workers_expected=1, step=0, uptime_s=0
        ),
        ("status",),
        "degraded",
    ),
    (
        InspectReply(
            snapshot=None,
            workers=[WorkerInfo(rank=0, pid=1, device="cpu", state=WorkerStatus.READY)],
            config={},
            model="m",
            frontend="f",
        ),
        ("workers", 0, "state"),
        "ready",
    ),
]


@pytest.mark.parametrize(("message", "path", "wire"), ENUMERATED)
def test_enumerated_values_are_plain_strings_on_the_wire(
    message: ServerMessage, path: tuple[str | int, ...], wire: str
) -> None:
    raw = msgspec.msgpack.decode(encode(message))
    for key in path:
        raw = raw[key]
    assert type(raw) is str and raw == wire
    assert server_decoder.decode(encode(message)) == message


@pytest.mark.parametrize(("message", "path", "wire"), ENUMERATED)
def test_an_unknown_enumerated_value_fails_decoding(
    message: ServerMessage, path: tuple[str | int, ...], wire: str
) -> None:
    raw = msgspec.msgpack.decode(encode(message))
    inner = raw
    for key in path[:-1]:
        inner = inner[key]
    inner[path[-1]] = "something_new"
    with pytest.raises(msgspec.ValidationError, match="Invalid enum value 'something_new'"):
        server_decoder.decode(msgspec.msgpack.encode(raw))


def test_seq_states_in_a_snapshot_are_checked() -> None:
    raw = msgspec.msgpack.decode(encode(make_snapshot()))
    assert raw["seqs"][0]["state"] == SeqStatus.RUNNING.value
    raw["seqs"][0]["state"] = "paused"
    with pytest.raises(msgspec.ValidationError, match=r"\$\.seqs\[0\]\.state"):
        decode(msgspec.msgpack.encode(raw))


def test_decoder_rejects_an_unknown_tag() -> None:
    frame = msgspec.msgpack.encode({"type": "bogus", "step": 1, "num_scheduled_tokens": {}})
    with pytest.raises(msgspec.ValidationError):
        decode(frame)


def test_decoder_rejects_an_untagged_frame() -> None:
    frame = msgspec.msgpack.encode({"step": 1, "num_scheduled_tokens": {}})
    with pytest.raises(msgspec.ValidationError):
        decode(frame)


def test_decoder_rejects_a_non_message_struct() -> None:
    with pytest.raises(msgspec.ValidationError):
        decode(msgspec.msgpack.encode(BlockUsage(total=1, free=1)))


def test_decoder_rejects_wrong_field_types() -> None:
    raw = msgspec.msgpack.decode(encode(make_plan()))
    raw["step"] = "seven"
    with pytest.raises(msgspec.ValidationError):
        decode(msgspec.msgpack.encode(raw))
    raw = msgspec.msgpack.decode(encode(make_plan()))
    del raw["num_scheduled_tokens"]
    with pytest.raises(msgspec.ValidationError):
        decode(msgspec.msgpack.encode(raw))


def test_decoder_validates_nested_sampling_params() -> None:
    raw = msgspec.msgpack.decode(encode(make_plan()))
    raw["new_seqs"][0]["sampling"]["top_p"] = 0.0
    with pytest.raises(msgspec.ValidationError):
        decode(msgspec.msgpack.encode(raw))


@pytest.mark.parametrize(
    ("message", "field", "value"),
    [
        (make_plan(), "step", 8),
        (StepResult(step=0, sampled_token_ids={}), "step", 1),
        (make_snapshot(), "num_running", 5),
        (BlockUpdate(seq_id="a"), "seq_id", "b"),
        (make_plan().new_seqs[0], "num_computed_tokens", 0),
        (
            WorkerHello(
                rank=0,
                pid=1,
                device="cpu",
                num_gpu_blocks=1,
                kv_bytes_per_block=1,
                block_size=16,
                model="m",
            ),
            "rank",
            2,
        ),
    ],
)
def test_structs_are_frozen(message: msgspec.Struct, field: str, value: object) -> None:
    with pytest.raises(AttributeError):
        setattr(message, field, value)
