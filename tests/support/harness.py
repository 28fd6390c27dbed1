"""The scheduler harness of the core tests: the real core and step engine driving a fake
worker that checks every plan and every K/V slot it reads, the invariants asserted after
every planning and update.

Step-exact by default (each step's result is applied before the next plan);
``overlap_scheduling=True`` plans ahead as the daemon does. Tests that watch or lose
steps build their own :class:`StepEngine` on ``h.sched`` and ``h.worker``.
"""

from __future__ import annotations

from typing import Any

import pytest

from ipc.schema import BatchPlan, StepResult
from scheduler_svc.core.introspection import check_invariants
from scheduler_svc.core.request import RejectedError, Request
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.step_records import StepOutput
from scheduler_svc.fake_worker import FakeModel, FakeWorker
from scheduler_svc.simulator import SimResult, Simulation, TraceRequest
from scheduler_svc.step_engine import InlineExecutor, StepEngine
from scheduler_svc.traces import generate_trace
from shared.config import SchedulerConfig
from shared.sampling import SamplingParams

BS = 4


class Harness:
    def __init__(
        self,
        eos_at: dict[str, int] | None = None,
        *,
        kv_bytes_per_block: int = 1 << 20,
        kv_window: int = 0,
        kv_groups: tuple[int, ...] = (),
        **config: object,
    ) -> None:
        """``config``: SchedulerConfig fields over the defaults below; ``eos_at``: the
        fake model's EOS positions (request id -> 1-based output index); ``kv_window``:
        the model's sliding window on every layer, ``kv_groups``: its layer groups'
        windows (a worker hello's)."""
        defaults: dict[str, object] = {
            "block_size": BS,
            "num_gpu_blocks": 64,
            "num_cpu_blocks": 0,
            "max_num_seqs": 8,
            "max_num_batched_tokens": 64,
            "max_model_len": 128,
            "watermark": 0.0,
            # Step-exact scenarios: each step's result is applied before the next plan
            # (tests/core/test_overlap.py covers planning ahead).
            "overlap_scheduling": False,
        }
        defaults.update(config)
        self.cfg = SchedulerConfig(**defaults)  # type: ignore[arg-type]
        self.model = FakeModel(eos_at=eos_at)
        self.sched = Scheduler(
            self.cfg,
            eos_token_ids=[self.model.eos_token_id],
            kv_bytes_per_block=kv_bytes_per_block,
            kv_window=kv_window,
            kv_groups=kv_groups,
        )
        self.kv_groups = kv_groups
        self.worker = self.new_worker()
        self.engine = StepEngine(self.sched, InlineExecutor(self._execute), check_invariants=True)
        self.plans: list[BatchPlan] = []
        """Every plan :meth:`step` ran, in order."""
        self.result: StepResult | None = None
        """The fake worker's latest result."""
        self._last: StepOutput | None = None
        self.requests: dict[str, Request] = {}

    def new_worker(self) -> FakeWorker:
        """A fake worker for this scheduler's cache (its windows verified once the
        scheduler gives blocks back behind them)."""
        window = self.sched.kv.window
        return FakeWorker(
            self.model,
            block_size=self.cfg.block_size,
            num_gpu_blocks=self.cfg.num_gpu_blocks or 0,
            num_cpu_blocks=self.cfg.num_cpu_blocks,
            verify_kv=True,
            window=window,
            groups=tuple(w if window else 0 for w in self.kv_groups),
        )

    def _execute(self, plan: BatchPlan) -> StepResult:
        self.result = self.worker.execute(plan)  # the current worker (restart_worker)
        return self.result

    def add(
        self,
        request_id: str,
        prompt: int | list[int],
        *,
        priority: int = 0,
        client: str = "",
        **params: object,
    ) -> Request:
        tokens = self.model.prompt(request_id, prompt) if isinstance(prompt, int) else prompt
        params.setdefault("temperature", 0.0)
        request = self.sched.add_request(
            request_id,
            tokens,
            SamplingParams(**params),  # type: ignore[arg-type]
            priority=priority,
            client=client,
        )
        self.requests[request_id] = request
        return request

    def check(self, plan: BatchPlan | None = None) -> None:
        assert check_invariants(self.sched) == []
        if plan is not None:
            assert plan.total_tokens <= self.cfg.max_num_batched_tokens
            assert len(plan.num_scheduled_tokens) <= self.cfg.max_num_seqs
            assert sum(s.slots_needed for s in self.sched.running) <= self.cfg.max_num_seqs

    def step(self) -> StepOutput:
        """One engine step (the invariants checked after planning and updating); its
        output (its plan is ``.plan``, the worker's result :attr:`result`)."""
        output = self._last = self.engine.step()
        self.plans.append(output.plan)
        self.check(output.plan)
        assert not output.lost
        return output

    @property
    def last(self) -> StepOutput:
        """The output of the latest :meth:`step`."""
        assert self._last is not None, "no step yet"
        return self._last

    def run(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.engine.has_work():
                return
            self.step()
        raise AssertionError(f"no end within {max_steps} steps")

    def reference(self, request: Request, sample_index: int = 0) -> tuple[list[int], str]:
        return self.model.reference_output(
            request.request_id,
            sample_index,
            len(request.prompt_token_ids),
            request.params,
            self.cfg.max_model_len,
        )

    def assert_reference_outputs(self) -> None:
        for request in self.requests.values():
            assert request.finished, request.request_id
            assert len(request.seqs) == request.params.n
            for seq in request.seqs:
                tokens, reason = self.reference(request, seq.sample_index)
                assert seq.output_token_ids == tokens, seq.seq_id
                assert seq.finish_reason == reason, seq.seq_id


def trace_config(**fields: object) -> SchedulerConfig:
    """The scheduler of the trace tests run through :class:`Simulation`: blocks of BS
    tokens, 56 of them on the device and 48 in the CPU pool, 12 sequences, 48 tokens a
    step, contexts of 128, no watermark; ``fields`` over those."""
    base: dict[str, object] = {
        "block_size": BS,
        "num_gpu_blocks": 56,
        "num_cpu_blocks": 48,
        "max_num_seqs": 12,
        "max_num_batched_tokens": 48,
        "max_model_len": 128,
        "watermark": 0.0,
    }
    return SchedulerConfig(**{**base, **fields})  # type: ignore[arg-type]


def checked_run(
    trace: list[TraceRequest], cfg: SchedulerConfig, **options: Any
) -> tuple[Simulation, SimResult]:
    """``trace`` through the scheduler and the fake worker (``options``: Simulation's),
    every K/V slot a step reads verified and every invariant checked each step; every
    output exact and no block left over."""
    sim = Simulation(trace, cfg, verify_kv=True, check_invariants=True, **options)
    result = sim.run()
    check_outputs(sim, result)
    assert result.summary["leftover_blocks"] == {"gpu_in_use": 0, "cpu_in_use": 0}
    return sim, result


def mixed_trace(seed: int, longest: int) -> list[TraceRequest]:
    """60 requests for the trace tests: prompts of 4 to ``longest`` tokens, answers of 1
    to ``longest``, n of 1 or 3, EOS and aborts, three shared 12-token prefixes."""
    return generate_trace(
        60,
        seed=seed,
        prompt_len=(4, longest),
        output_len=(1, longest),
        arrival_rate=4.0,
        n_choices=(1, 1, 3),
        eos_fraction=0.3,
        abort_fraction=0.1,
        shared_prefixes=3,
        shared_prefix_len=12,
    )


def rejected(h: Harness, request_id: str, prompt: int | list[int], **params: object):
    with pytest.raises(RejectedError) as info:
        h.add(request_id, prompt, **params)
    return info.value


def restart_worker(h: Harness) -> None:
    """A new worker process: empty device cache, the shared-memory CPU pool kept."""
    cpu_kv = h.worker.cpu_kv
    h.worker = h.new_worker()
    h.worker.cpu_kv = cpu_kv


def check_outputs(sim: Simulation, result: SimResult) -> None:
    """Every sample of a simulated trace produced the fake model's output and finish
    reason (an aborted one: a prefix of that output); refused requests produced none."""
    for req in sim.trace:
        if req.id in result.rejected:
            continue
        for index, (seq_id, tokens) in enumerate(sorted(result.outputs[req.id].items())):
            expected, reason = sim.model.reference_output(
                req.id, index, len(sim.prompt_of(req)), req.params(), sim.config.max_model_len
            )
            if result.seq_finish_reasons[seq_id] == "abort":
                assert tokens == expected[: len(tokens)], seq_id
            else:
                assert (tokens, result.seq_finish_reasons[seq_id]) == (expected, reason), seq_id
