"""How sequences leave the scheduler core: finished, stopped by a string, aborted, or
sent back to the queue because the device cache was lost with a worker.

:class:`SequenceEnding` is a part of :class:`~scheduler_svc.core.scheduler.Scheduler` (its
base), kept apart so that the step itself reads on its own; it works on the
scheduler's queues, block manager and steps in flight, declared below.
"""

from __future__ import annotations

from collections import deque

from ipc.schema import SeqStatus
from scheduler_svc.core.kv_manager import KVCacheManager
from scheduler_svc.core.policies import FairShareRounds, QueueOrder
from scheduler_svc.core.queues import SeqQueue
from scheduler_svc.core.request import Request, Sequence
from scheduler_svc.core.step_records import InflightStep, StepOutput
from shared.outputs import FinishReason

QUARANTINE_AFTER_FAILED_STEPS = 2
"""A request in this many steps that a worker died in is not run again."""


class SequenceEnding:
    """Ending sequences and requests, and the recovery from a lost device cache."""

    requests: dict[str, Request]
    seqs: dict[str, Sequence]
    running: list[Sequence]
    waiting: SeqQueue
    swapped: SeqQueue
    kv: KVCacheManager
    order: QueueOrder
    fair_share: FairShareRounds
    inflight: deque[InflightStep]
    finished_counts: dict[str, int]
    _running_forks: int
    num_constrained: int
    _freed_seq_ids: list[str]
    _reset_workers: bool

    def abort(self, request_id: str, output: StepOutput | None = None) -> bool:
        """Abort a request in any state (its ends recorded in ``output``, if given);
        False if it is unknown or already finished."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        for seq in list(request.seqs):
            if seq.status is not SeqStatus.FINISHED:
                self._finish(seq, FinishReason.ABORT, output)
        return True

    def _fail(self, seq: Sequence, why: str, output: StepOutput) -> None:
        """Abort ``seq``'s request, a sample of which cannot go on (``why``: for its
        client, through ``output.failed``)."""
        output.failed.append((seq.request.request_id, why))
        self.abort(seq.request.request_id, output)

    def finish_seq(self, seq_id: str, reason: FinishReason = FinishReason.STOP) -> bool:
        """End one sequence early (a stop string the detokenizer found)."""
        seq = self.seqs.get(seq_id)
        if seq is None:
            return False
        self._finish(seq, reason)
        return True

    def _finish(
        self, seq: Sequence, reason: FinishReason, output: StepOutput | None = None
    ) -> None:
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self._running_forks -= seq.pending_forks
            self.kv.free(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SeqStatus.SWAPPED:
            self.swapped.remove(seq)
            self.kv.free_swapped(seq)
        self._forget_on_worker(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        del self.seqs[seq.seq_id]
        if seq.constraint is not None:
            self.num_constrained -= 1
        request = seq.request
        # Samples not forked yet will never be: they end with their parent.
        unforked, seq.pending_forks = seq.pending_forks, 0
        request.num_unfinished -= 1 + unforked
        if output is not None:
            output.finished_seqs.append((request.request_id, seq.sample_index, reason))
        if request.num_unfinished == 0:
            request.finish_reason = reason
            del self.requests[request.request_id]
            for index in range(request.params.n):
                self.seq_ids_taken.remove(request.seq_id(index))
            self.fair_share.depart(self.order.priority_term(request), request.client)
            self.finished_counts[reason.value] += 1
            if output is not None:
                output.finished_requests.append(request.request_id)

    def on_worker_lost(self) -> list[Request]:
        """The device cache is gone: running sequences go back to recompute.

        Sequences swapped out before the step in flight keep their K/V in the CPU pool.
        Those whose swap-out rode on the lost step may never have been copied, so they
        are recomputed too. Every step in flight is discarded (with whatever the driver
        keeps on it): this is the one place that clears them.

        A worker that dies inside a step may have been killed by what the step held:
        each request in it counts one failed step, and one at
        ``QUARANTINE_AFTER_FAILED_STEPS`` is ended (reason abort) instead of re-queued, so
        it cannot crash worker after worker. Returns those requests; the caller tells
        their clients why.
        """
        inflight = list(self.inflight)
        self.inflight.clear()
        # The oldest step was running when the worker died: its requests are suspects.
        suspects = {
            seq.request: None
            for seq_id in (inflight[0].num_scheduled if inflight else ())
            if (seq := self.seqs.get(seq_id)) is not None  # unfinished
        }
        for lost in inflight:
            self.kv.cpu_pool.release(lost.cpu_release)
            for seq in lost.sampling:
                seq.num_placeholders = 0  # never sampled: planned again from known tokens
            for seq in lost.swapped_out:
                if seq.status is SeqStatus.SWAPPED:
                    self.swapped.remove(seq)
                    self.kv.free_swapped(seq)
                    seq.num_computed_tokens = 0
                    seq.status = SeqStatus.WAITING
                    self.waiting.push(seq)
        for seq in list(self.running):
            self.kv.free(seq)
            seq.num_computed_tokens = 0
            seq.on_worker = False
            seq.status = SeqStatus.WAITING
            self.waiting.push(seq)
        self.running.clear()
        self._running_forks = 0
        self._freed_seq_ids = []
        self._reset_workers = True
        self.kv.reset_prefix_cache()  # the host tier too: the lost steps' copies
        quarantined = []
        for request in suspects:
            request.num_failed_steps += 1
            if request.num_failed_steps >= QUARANTINE_AFTER_FAILED_STEPS:
                self.abort(request.request_id)
                quarantined.append(request)
        return quarantined

    def _forget_on_worker(self, seq: Sequence) -> None:
        if seq.on_worker:
            self._freed_seq_ids.append(seq.seq_id)
            seq.on_worker = False
