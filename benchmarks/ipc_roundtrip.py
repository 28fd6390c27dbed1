"""The plan/result round trip over ZeroMQ at 256 running requests, against a bare ZeroMQ
ping-pong of the same bytes, in one run.

"expeditor" = the scheduler side encodes a BatchPlan (256 decodes, 16 of them with a new
block), sends it ROUTER -> DEALER over ipc://, the worker side decodes it, encodes a
StepResult (256 sampled tokens) and sends it back, the scheduler decodes it. Building
the plan and the result is the scheduler's and the worker's own work and is not timed.
"bare" = the same two payloads as pre-encoded bytes, no encoding or decoding.

    .venv/bin/python benchmarks/ipc_roundtrip.py [--iters 2000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time

import zmq

from ipc.schema import (
    BatchPlan,
    BlockUpdate,
    StepResult,
    control_decoder,
    encode,
    worker_decoder,
)


def make_plan(step: int, running: int) -> BatchPlan:
    ids = [f"req-{i}" for i in range(running)]
    return BatchPlan(
        step=step,
        num_scheduled_tokens=dict.fromkeys(ids, 1),
        block_updates=[
            BlockUpdate(seq_id=ids[i], appended=[1000 + i]) for i in range(0, running, 16)
        ],
    )


def make_result(plan: BatchPlan) -> StepResult:
    return StepResult(
        step=plan.step, sampled_token_ids={sid: [123] for sid in plan.num_scheduled_tokens}
    )


def run(iters: int, running: int, codec: bool) -> list[float]:
    ctx = zmq.Context()
    address = f"ipc://{tempfile.mkdtemp()}/rt.sock"
    router = ctx.socket(zmq.ROUTER)
    router.bind(address)
    plan_bytes = encode(make_plan(0, running))
    result_bytes = encode(make_result(make_plan(0, running)))

    plans = [make_plan(step, running) for step in range(iters)] if codec else []
    result = make_result(make_plan(0, running))

    def worker() -> None:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, b"w0")
        dealer.connect(address)
        dealer.send(b"hello")
        for _ in range(iters):
            frame = dealer.recv()
            if codec:
                plan = control_decoder.decode(frame)
                assert isinstance(plan, BatchPlan)
                dealer.send(encode(result))
            else:
                dealer.send(result_bytes)
        dealer.close()

    thread = threading.Thread(target=worker)
    thread.start()
    identity, _ = router.recv_multipart()
    times = []
    for step in range(iters):
        started = time.perf_counter()
        if codec:
            router.send_multipart([identity, encode(plans[step])])
            reply = worker_decoder.decode(router.recv_multipart()[1])
            assert isinstance(reply, StepResult)
        else:
            router.send_multipart([identity, plan_bytes])
            router.recv_multipart()
        times.append(time.perf_counter() - started)
    thread.join()
    router.close()
    ctx.term()
    return times[iters // 10 :]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--running", type=int, default=256)
    args = parser.parse_args()
    bare = run(args.iters, args.running, codec=False)
    full = run(args.iters, args.running, codec=True)
    plan_bytes = len(encode(make_plan(0, args.running)))
    result_bytes = len(encode(make_result(make_plan(0, args.running))))
    report = {
        "running": args.running,
        "plan_bytes": plan_bytes,
        "result_bytes": result_bytes,
        "bare_us_median": statistics.median(bare) * 1e6,
        "expeditor_us_median": statistics.median(full) * 1e6,
        "ratio": statistics.median(full) / statistics.median(bare),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
