"""A worker is never lost while alive, and a lost worker is always replaced (issue 29,
item 1): a stalled worker is sent off and restarted, the requests it held complete;
request-sized stop lists are refused before any work; forks carry a reference to
their request's sampling parameters, not copies; the min-tokens mask is built once."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from support.hf_reference import Oracle
from support.http import post_json
from support.limits import SERVE_SAFETY_S
from support.serve import children_in_role, running_http_serve

from gpu_worker.sampler import Sampler
from ipc.client import AsyncClient
from ipc.plan_state import WorkerState, WorkerStateError
from ipc.schema import BatchPlan, InspectReply, NewSeq, WorkerStatus
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.fake_worker import FakeModel, FakeWorker
from scheduler_svc.launch import running_serve
from scheduler_svc.step_engine import InlineExecutor, StepEngine
from shared.config import SchedulerConfig
from shared.errors import InvalidRequestError
from shared.procinfo import process_start_time
from shared.sampling import MAX_STOP_STRING_CHARS, MAX_STOP_TOKEN_IDS, SamplingParams

MAX_TOKENS = 24
WORKER_TIMEOUT_S = 2.0
STALL_S = 20.0
PROMPTS = [[1, *range(3 + i, 40 + 2 * i)] for i in range(12)]


def test_a_stalled_worker_is_replaced_and_its_requests_complete(
    model: Path, hf_oracle: Oracle
) -> None:
    """SIGSTOP freezes the worker, heartbeats included, for longer than worker_timeout_s
    while it runs requests: the scheduler gives up on it, kills it (it could never
    rejoin), serve starts a fresh one, and every request completes exactly."""
    expected = hf_oracle(model, PROMPTS, MAX_TOKENS)
    flags = ("--num-gpu-blocks", "256", "--worker-timeout-s", str(WORKER_TIMEOUT_S))
    with running_serve(model, *flags) as (lines, proc):

        async def scenario() -> tuple[list[list[int]], int, InspectReply, float]:
            async with AsyncClient(lines[0], timeout=SERVE_SAFETY_S) as client:
                tasks = [
                    asyncio.ensure_future(
                        client.generate(prompt_token_ids=p, max_tokens=MAX_TOKENS, temperature=0)
                    )
                    for p in PROMPTS
                ]
                while (await client.inspect()).snapshot.num_running == 0:  # type: ignore[union-attr]
                    await asyncio.sleep(0.01)
                (stalled,) = children_in_role(proc.pid, "worker")
                os.kill(stalled, signal.SIGSTOP)
                stopped_at = time.monotonic()
                try:
                    results = await asyncio.wait_for(asyncio.gather(*tasks), STALL_S)
                finally:
                    if process_start_time(stalled) is not None:
                        os.kill(stalled, signal.SIGCONT)
                return (
                    [r.token_ids for r in results],
                    stalled,
                    await client.inspect(),
                    time.monotonic() - stopped_at,
                )

        outputs, stalled, after, took_s = asyncio.run(scenario())
    assert outputs == expected
    assert took_s < STALL_S  # served again while the old worker would still be frozen
    assert process_start_time(stalled) is None, "the stalled worker was left running"
    ready = [w for w in after.workers if w.state is WorkerStatus.READY]
    assert len(ready) == 1 and ready[0].pid != stalled, after.workers
    assert any(w.pid == stalled and w.state is WorkerStatus.LOST for w in after.workers)


def test_the_outage_request_gets_a_400_and_the_server_keeps_serving(model: Path) -> None:
    """The 1.8 MB request of the report (n=64, 200,000 stop token ids) is refused by
    name; the worker is never lost and the next request is served."""
    flags = ("--worker-timeout-s", str(WORKER_TIMEOUT_S))
    with running_http_serve(model, *flags) as (_, url, proc):
        workers = children_in_role(proc.pid, "worker")
        outage = {
            "prompt": [1, 17, 42],
            "n": 64,
            "max_tokens": 8,
            "min_tokens": 4,
            "stop_token_ids": list(range(200_000)),
        }
        status, body = post_json(url, "/v1/completions", outage, timeout=SERVE_SAFETY_S)
        assert status == 400, body
        assert "stop_token_ids" in body["error"]["message"]
        assert str(MAX_STOP_TOKEN_IDS) in body["error"]["message"]
        # As many stop ids as allowed; below min_tokens they are masked, and ids 0-99
        # stay drawable (the tiny model has 320).
        ids = list(range(100, 100 + MAX_STOP_TOKEN_IDS))
        allowed = dict(outage, stop_token_ids=ids)
        status, body = post_json(url, "/v1/completions", allowed, timeout=SERVE_SAFETY_S)
        assert status == 200, body
        assert len(body["choices"]) == 64
        # Stop ids covering the whole vocabulary leave nothing to draw below min_tokens.
        every = dict(outage, stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)))
        status, body = post_json(url, "/v1/completions", every, timeout=SERVE_SAFETY_S)
        assert status == 400 and "no token could be drawn" in body["error"]["message"], body
        assert "(the request sets min_tokens)" in body["error"]["message"]
        status, body = post_json(
            url, "/v1/completions", {"prompt": [1, 5], "max_tokens": 3}, timeout=SERVE_SAFETY_S
        )
        assert status == 200, body
        assert children_in_role(proc.pid, "worker") == workers  # never lost, never restarted


def test_request_sized_stop_lists_are_refused_by_name() -> None:
    SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)))
    with pytest.raises(InvalidRequestError, match="stop_token_ids: at most") as caught:
        SamplingParams.from_dict({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))})
    assert caught.value.field == "stop_token_ids"
    SamplingParams(stop=["x" * MAX_STOP_STRING_CHARS])
    with pytest.raises(InvalidRequestError, match=r"stop\[1\]: at most") as caught:
        SamplingParams(stop=["ok", "x" * (MAX_STOP_STRING_CHARS + 1)])
    assert caught.value.field == "stop"


def _new(seq_id: str, sampling: SamplingParams | None, request_id: str = "r") -> NewSeq:
    return NewSeq(
        seq_id=seq_id,
        request_id=request_id,
        sample_index=int(seq_id.rsplit("#", 1)[-1]),
        token_ids=[1, 2, 3],
        num_prompt_tokens=3,
        num_computed_tokens=0,
        block_ids=[0],
        sampling=sampling,
    )


def _plan(step: int, new: list[NewSeq], freed: list[str] = ()) -> BatchPlan:  # type: ignore[assignment]
    return BatchPlan(
        step=step,
        num_scheduled_tokens={n.seq_id: 3 for n in new},
        new_seqs=new,
        block_updates=[],
        freed_seq_ids=list(freed),
        reset=False,
        swap_out=[],
        swap_in=[],
        copies=[],
        num_samples={},
    )


def test_a_worker_holds_one_copy_of_a_requests_parameters() -> None:
    params = SamplingParams(n=3, stop_token_ids=[7, 8], temperature=0)
    state = WorkerState(4)
    state.apply(_plan(0, [_new("r#0", params), _new("r#1", None)]))  # in the same plan
    state.apply(_plan(1, [_new("r#2", None)]))  # held by the others
    assert all(state.seqs[f"r#{i}"].sampling is params for i in range(3))
    # The last holders freed in the plan that sends a reference: it still resolves.
    state.apply(_plan(2, [_new("r#3", None)], freed=["r#0", "r#1", "r#2"]))
    assert state.seqs["r#3"].sampling is params
    state.apply(_plan(3, [], freed=["r#3"]))
    assert state.params == {}
    with pytest.raises(WorkerStateError, match="without sampling parameters"):
        state.apply(_plan(4, [_new("r#1", None)]))  # nobody holds them any more


def test_forked_samples_are_sent_with_a_reference() -> None:
    """Through the scheduler core and the fake worker (which checks every K/V slot):
    the forks of an n=8 request reach the worker without parameters of their own; only
    the request's first sequence carries them."""
    model = FakeModel()
    config = SchedulerConfig(
        block_size=4, num_gpu_blocks=64, num_cpu_blocks=0, max_model_len=128, watermark=0.0
    )
    core = Scheduler(config, eos_token_ids=[model.eos_token_id], kv_bytes_per_block=1 << 20)
    worker = FakeWorker(model, block_size=4, num_gpu_blocks=64, num_cpu_blocks=0, verify_kv=True)
    engine = StepEngine(core, InlineExecutor(worker.execute), check_invariants=True)
    params = SamplingParams(n=8, max_tokens=4, temperature=0, stop_token_ids=[*range(300, 800)])
    request = core.add_request("r", model.prompt("r", 9), params)
    sent: list[NewSeq] = []
    while engine.has_work():
        sent.extend(engine.step().plan.new_seqs)
    assert request.finished and len(request.seqs) == 8
    assert [n.seq_id for n in sent if n.sampling is not None] == [request.seqs[0].seq_id]
    assert {n.seq_id for n in sent} == {s.seq_id for s in request.seqs}


def test_masks_given_as_arrays_mask_like_lists() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=0)] * 3
    lists = [[1, 2, 49, 70], [], [int(logits[2].argmax())]]
    arrays = [np.asarray(ids, dtype=np.int64) for ids in lists]
    sampler = Sampler()
    by_list = sampler.sample(logits, params, [None] * 3, lists)
    by_array = sampler.sample(logits, params, [None] * 3, arrays)
    assert by_list.token_ids == by_array.token_ids
    masked = logits.clone()
    masked[0, [1, 2, 49]] = -torch.inf
    masked[2, lists[2]] = -torch.inf
    assert by_array.token_ids == masked.argmax(dim=-1).tolist()


def test_finished_requests_and_their_stop_sets_are_not_kept() -> None:
    """Scheduler memory stayed high after requests with many stop ids (item 8): nothing
    in the core keeps a finished request (and so its stop-id set) alive."""
    import gc

    from scheduler_svc.core.request import Request

    model = FakeModel()
    config = SchedulerConfig(
        block_size=4, num_gpu_blocks=64, num_cpu_blocks=0, max_model_len=128, watermark=0.0
    )
    core = Scheduler(config, eos_token_ids=[model.eos_token_id], kv_bytes_per_block=1 << 20)
    worker = FakeWorker(model, block_size=4, num_gpu_blocks=64, num_cpu_blocks=0)
    engine = StepEngine(core, InlineExecutor(worker.execute))
    stops = list(range(300, 300 + MAX_STOP_TOKEN_IDS))
    for index in range(6):
        params = SamplingParams(n=4, max_tokens=6, min_tokens=2, stop_token_ids=stops)
        core.add_request(f"leak{index}", model.prompt(f"leak{index}", 7), params)
    assert len(_live_requests(Request)) == 6
    while engine.has_work():
        engine.step()
    gc.collect()
    assert _live_requests(Request) == []
    assert worker.seqs == {} and worker.state.params == {}


def _live_requests(kind: type) -> list[str]:
    import gc

    return [
        o.request_id
        for o in gc.get_objects()
        if type(o) is kind and o.request_id.startswith("leak")
    ]
