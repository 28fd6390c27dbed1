"""Shared by several test modules (from test_scheduler_unit.py)."""

from __future__ import annotations

import pytest

from ipc.schema import BatchPlan, StepResult
from scheduler_svc.core.introspection import check_invariants
from scheduler_svc.core.request import RejectedError, Request
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.step_records import UpdateOutcome
from scheduler_svc.fake_worker import FakeModel, FakeWorker
from scheduler_svc.step_engine import InlineExecutor, StepEngine
from shared.config import SchedulerConfig
from shared.sampling import SamplingParams

BS = 4


class Harness:
    def __init__(self, eos_at: dict[str, int] | None = None, **config: object) -> None:
        defaults: dict[str, object] = {
            "block_size": BS,
            "num_gpu_blocks": 64,
            "num_cpu_blocks": 0,
            "max_num_seqs": 8,
            "max_num_batched_tokens": 64,
            "max_model_len": 128,
            "watermark": 0.0,
            # Step-exact scenarios: each step's result is applied before the next plan
            # (tests/test_overlap.py covers planning ahead).
            "overlap_scheduling": False,
        }
        defaults.update(config)
        self.cfg = SchedulerConfig(**defaults)  # type: ignore[arg-type]
        self.model = FakeModel(eos_at=eos_at)
        self.sched = Scheduler(
            self.cfg, eos_token_ids=[self.model.eos_token_id], kv_bytes_per_block=1 << 20
        )
        self.worker = FakeWorker(
            self.model,
            block_size=self.cfg.block_size,
            num_gpu_blocks=self.cfg.num_gpu_blocks or 0,
            num_cpu_blocks=self.cfg.num_cpu_blocks,
            verify_kv=True,
        )
        self.engine = StepEngine(
            self.sched,
            InlineExecutor(lambda plan: self.worker.execute(plan)),
            check_invariants=True,
        )
        self.plans: list[BatchPlan] = []
        self.requests: dict[str, Request] = {}

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

    def step(self) -> tuple[BatchPlan, StepResult, UpdateOutcome]:
        record = self.engine.step()  # checks the invariants after planning and updating
        self.plans.append(record.plan)
        self.check(record.plan)
        assert record.result is not None
        return record.plan, record.result, record.outcome

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


def rejected(h: Harness, request_id: str, prompt: int | list[int], **params: object):
    with pytest.raises(RejectedError) as info:
        h.add(request_id, prompt, **params)
    return info.value


def restart_worker(h: Harness) -> None:
    """A new worker process: empty device cache, the shared-memory CPU pool kept."""
    cpu_kv = h.worker.cpu_kv
    h.worker = FakeWorker(
        h.model,
        block_size=h.cfg.block_size,
        num_gpu_blocks=h.cfg.num_gpu_blocks or 0,
        num_cpu_blocks=h.cfg.num_cpu_blocks,
        verify_kv=True,
    )
    h.worker.cpu_kv = cpu_kv


def make(
    model: FakeModel | None = None, *, overlap: bool = True, **config: object
) -> tuple[Scheduler, FakeWorker, FakeModel]:
    fields: dict[str, object] = {
        "block_size": BS,
        "num_gpu_blocks": 64,
        "num_cpu_blocks": 32,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "max_model_len": 128,
        "watermark": 0.0,
        "overlap_scheduling": overlap,
    }
    fields.update(config)
    cfg = SchedulerConfig(**fields)  # type: ignore[arg-type]
    model = model or FakeModel()
    sched = Scheduler(cfg, eos_token_ids=[model.eos_token_id], kv_bytes_per_block=1 << 20)
    worker = FakeWorker(
        model, block_size=BS, num_gpu_blocks=cfg.num_gpu_blocks or 0, num_cpu_blocks=32
    )
    return sched, worker, model


def add(sched: Scheduler, model: FakeModel, request_id: str, length: int, **params: object):
    params.setdefault("temperature", 0.0)
    return sched.add_request(
        request_id,
        model.prompt(request_id, length),
        SamplingParams(**params),  # type: ignore[arg-type]
    )
