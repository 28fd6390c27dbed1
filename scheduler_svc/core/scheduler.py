"""The scheduler core: one decision per step, no I/O, no torch.

Each step (:meth:`Scheduler.schedule`):

1. reap: finished and aborted sequences already gave their blocks back when they
   ended (in :meth:`Scheduler.update` / :meth:`Scheduler.abort`), and the CPU blocks
   of the previous step's swap-ins were released when its result arrived;
2. budget: ``max_num_batched_tokens`` tokens and ``max_num_seqs`` sequences; admission
   keeps a watermark of free blocks plus one block for each running sequence whose next
   token starts a new block;
3. (priority policy) make room: the best waiting or swapped sequence may preempt running
   sequences ranked after it;
4. running sequences, in queue order, get their next chunk; one that cannot grow
   preempts the lowest-ranked running sequence (swap or recompute by the cost model),
   or itself;
5. if nothing was preempted, swapped and waiting sequences are resumed / admitted in
   queue order (prefix-cache hits first, chunked prefill) until the first that does not
   fit: no overtaking, so nobody starves;
6. the plan: full data for sequences the workers do not know, deltas for the rest.

:meth:`Scheduler.update` then applies the sampled tokens of the oldest step in flight:
it appends them, forks n>1 samples when their prompt completes, stops sequences (EOS,
stop token, max_tokens, max_model_len), frees their blocks, and returns the step's
:class:`~scheduler_svc.core.step_records.StepOutput`. ``Scheduler.inflight`` is the one
queue of planned steps awaiting their results (see
:mod:`scheduler_svc.core.step_records`). Ending (abort, stop strings) and the recovery
from a lost worker live in :mod:`scheduler_svc.core.ending`.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable

from ipc.schema import (
    BatchPlan,
    BlockUpdate,
    ErrorCode,
    SeqStatus,
    StepResult,
)
from scheduler_svc.core.admission import check_request
from scheduler_svc.core.cache_aware import CacheAwareAdmission
from scheduler_svc.core.ending import SequenceEnding
from scheduler_svc.core.kv_groups import GroupedKVCacheManager
from scheduler_svc.core.kv_manager import KVCacheManager
from scheduler_svc.core.policies import (
    FairShareRounds,
    PreemptionCostModel,
    VictimPolicy,
    make_queue_order,
)
from scheduler_svc.core.queues import SeqQueue
from scheduler_svc.core.request import (
    QueueKey,
    RejectedError,
    Request,
    Sequence,
    TokenConstraint,
)
from scheduler_svc.core.speculation import (
    PromptLookup,
    Proposer,
    SpeculationPolicy,
    SpeculativeSteps,
)
from scheduler_svc.core.step_records import InflightStep, StepOutput, WorkerProtocolError
from shared.config import SchedulerConfig
from shared.outputs import FinishReason
from shared.sampling import SamplingParams


def _sort_key(seq: Sequence) -> QueueKey:
    return seq.key


def _no_token(seq: Sequence) -> str:
    """Why the worker could draw no token for ``seq`` (its NO_TOKEN), naming the fields
    of its request that mask or shape tokens."""
    p = seq.request.params
    fields = {
        "allowed_token_ids": p.allowed_token_ids,
        "bad_words": p.bad_words_token_ids,
        "logit_bias": p.logit_bias,
        "structured_outputs": p.structured_outputs is not None,
        "min_tokens": p.min_tokens,
        "repetition_penalty": p.repetition_penalty != 1.0,
    }
    named = ", ".join(name for name, value in fields.items() if value)
    return (
        f"no token could be drawn at output token {len(seq.token_ids) - seq.num_prompt_tokens}:"
        " every token was masked, or the logits overflowed float32"
        + (f" (the request sets {named})" if named else "")
    )


class Scheduler(SequenceEnding, SpeculativeSteps):
    def __init__(
        self,
        config: SchedulerConfig,
        *,
        eos_token_ids: Iterable[int],
        kv_bytes_per_block: int,
        vocab_size: int | None = None,
        proposer: Proposer | None = None,
        drafting: bool = False,
        kv_window: int = 0,
        kv_groups: tuple[int, ...] = (),
    ) -> None:
        """``kv_window``: every layer reads at most that many keys back (0: some layer
        reads the whole context); ``kv_groups``: the workers' cache holds layer groups
        side by side, each group's window (:mod:`scheduler_svc.core.kv_groups`)."""
        if config.num_gpu_blocks is None:
            raise ValueError("the scheduler needs num_gpu_blocks (from config or the workers)")
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        """Token ids that end a sequence unless ignore_eos (a model may list several)."""
        self.vocab_size = vocab_size
        """Prompt token ids must be below it (the model's embedding rows); None = unchecked."""
        self.proposer: Proposer = proposer or PromptLookup(
            config.prompt_lookup_min, config.prompt_lookup_max
        )
        """Speculative decoding's proposals (prompt lookup unless given)."""
        self.drafting = drafting
        """The workers' draft model proposes instead (their hello names one): plans
        carry how many tokens each speculating decode drafts."""
        self.speculation = SpeculationPolicy(
            config.num_speculative_tokens, backoff=config.speculative_backoff
        )
        self._speculating = False
        """Whether the last plan let decodes propose (then nothing is planned ahead)."""
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        pools = {
            "block_size": config.block_size,
            "num_gpu_blocks": config.num_gpu_blocks,
            "num_cpu_blocks": config.num_cpu_blocks,
            "enable_prefix_caching": config.enable_prefix_caching,
            "num_host_blocks": config.prefix_cache_cpu_blocks,
        }
        self.kv: KVCacheManager = (
            GroupedKVCacheManager(
                **pools, groups=tuple(kv_groups), release=config.free_out_of_window_blocks
            )
            if len(kv_groups) > 1
            else KVCacheManager(
                **pools, window=kv_window if config.free_out_of_window_blocks else 0
            )
        )
        self.order = make_queue_order(config)
        self.fair_share = FairShareRounds()
        """Fair-share rounds of the clients with unfinished requests, kept either way;
        the order uses them when ``config.fair_share``."""
        self.admission = (
            CacheAwareAdmission(
                self.kv, max_bypass=config.max_bypass, by_priority=config.policy == "priority"
            )
            if config.cache_aware_admission
            else None
        )
        """Cache-aware admission, when on: which waiting sequence goes next."""
        self.victims = VictimPolicy(config.max_preemptions)
        self.cost_model = PreemptionCostModel.from_config(config, kv_bytes_per_block)
        self.watermark_blocks = config.watermark_blocks(self.kv.pool.num_blocks)
        self.capacity_blocks = (self.kv.pool.num_blocks - self.watermark_blocks) // (
            self.kv.num_groups
        )
        """Blocks of a table (logical blocks of a grouped one) the cache admits at most."""

        self.waiting = SeqQueue()
        self.swapped = SeqQueue()
        self.running: list[Sequence] = []
        """In queue order (best first)."""
        self._running_forks = 0
        """Samples still to fork from running sequences: slots they already hold."""
        self.requests: dict[str, Request] = {}
        """Unfinished requests by id."""
        self.seqs: dict[str, Sequence] = {}
        """Unfinished sequences by id."""
        self.num_constrained = 0
        """Of them, those with a structured-output matcher (none: no plan looks for masks)."""
        self.seq_ids_taken: set[str] = set()
        """Every sequence id of an unfinished request, forked or still to fork: a new
        request may take none of them."""

        self.step = 0
        """Index of the next step to schedule."""
        self._arrivals = 0
        self._freed_seq_ids: list[str] = []
        self._reset_workers = False
        """The next plan must tell workers to forget everything (a worker was lost)."""
        self.max_inflight = 2 if config.overlap_scheduling else 1
        """Steps planned ahead of their results: 2 plans step N+1 while N runs."""
        self.inflight: deque[InflightStep] = deque()
        """Planned steps whose results have not been applied, oldest first: the one
        record of the steps in flight (the driver keeps its futures on them)."""
        self.last_plan_tokens = 0
        """Tokens the last plan scheduled."""
        self.preemptions: dict[str, int] = {"swap": 0, "recompute": 0}
        self.finished_counts: dict[str, int] = {r.value: 0 for r in FinishReason}
        self.finished_counts["rejected"] = 0

    # -- submission -----------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        client: str = "",
        constraint: TokenConstraint | None = None,
    ) -> Request:
        """Queue a request, or raise :class:`RejectedError` saying why it never could run.

        ``client`` names who submitted it; with ``fair_share`` clients at equal priority
        are admitted round-robin. "" is one anonymous client (the in-process engine).
        ``constraint``: the matcher of ``params.structured_outputs``, compiled by the
        caller (required with them).
        """
        try:
            if (params.structured_outputs is None) != (constraint is None):
                raise RejectedError(
                    ErrorCode.BAD_REQUEST,
                    "structured_outputs: a constraint goes with them and only with them",
                    "structured_outputs",
                )
            request = self._validate(request_id, prompt_token_ids, params, priority, client)
        except RejectedError:
            self.finished_counts["rejected"] += 1
            raise
        seq = Sequence(request, 0, list(prompt_token_ids), self.order.key(request, 0))
        if constraint is not None:
            seq.constraint = constraint
            self.num_constrained += 1
        seq.pending_forks = params.n - 1
        request.seqs.append(seq)
        self.requests[request_id] = request
        for index in range(params.n):
            self.seq_ids_taken.add(request.seq_id(index))
        self.seqs[seq.seq_id] = seq
        self.waiting.push(seq)
        return request

    def _validate(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        priority: int,
        client: str,
    ) -> Request:
        max_output = check_request(
            self.config,
            request_id,
            prompt,
            params,
            priority,
            client,
            vocab_size=self.vocab_size,
            capacity_blocks=self.capacity_blocks,
        )
        if request_id in self.requests:
            raise RejectedError(ErrorCode.DUPLICATE, f"request_id {request_id!r} is already in use")
        for index in range(params.n):
            seq_id = request_id if params.n == 1 else f"{request_id}/{index}"
            if seq_id in self.seq_ids_taken:
                raise RejectedError(
                    ErrorCode.DUPLICATE, f"sequence id {seq_id!r} is already in use"
                )
        limit = self.config.max_waiting_requests
        if len(self.waiting) >= limit:
            raise RejectedError(
                ErrorCode.OVERLOADED, f"waiting queue is full ({limit} requests); retry later"
            )
        self._arrivals += 1
        request = Request(
            request_id,
            list(prompt),
            params,
            priority=priority,
            arrival_step=self.step,
            arrival_seq=self._arrivals,
            max_output_tokens=max_output,
            client=client,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            num_speculative_tokens=0
            if params.structured_outputs is not None
            else (
                self.config.num_speculative_tokens
                if params.num_speculative_tokens is None
                else params.num_speculative_tokens
            ),
        )
        request.fair_round = self.fair_share.arrive(self.order.priority_term(request), client)
        return request

    # -- the step -------------------------------------------------------------------------

    def has_work(self) -> bool:
        """Whether a plan is due: sequences to run, or ended ones the workers must drop."""
        return bool(self.running or len(self.waiting) or len(self.swapped) or self._freed_seq_ids)

    def can_plan_ahead(self) -> bool:
        """Whether :meth:`schedule` may plan another step before the oldest result is
        applied: fewer than ``max_inflight`` in flight, none forks n>1 samples (the
        forked sequences are only known from its result), and decodes may not propose
        (a speculating sequence's tokens are only known from its result, and one with a
        token in flight has nothing to propose from): while speculation pays, steps run
        one at a time."""
        inflight = self.inflight
        return (
            len(inflight) < self.max_inflight
            and not (inflight and inflight[-1].num_samples)
            and not self._speculating
        )

    @property
    def cpu_release(self) -> list[int]:
        """CPU blocks of the swap-ins in flight (released when their results arrive)."""
        return [block for step in self.inflight for block in step.cpu_release]

    @property
    def num_running_slots(self) -> int:
        """Running sequences, counting the n>1 samples they will fork."""
        return len(self.running) + self._running_forks

    def schedule(self) -> BatchPlan | None:
        """Plan the next step. With steps in flight (overlapped scheduling) a sequence
        whose last token is not back yet computes it as a placeholder; returns None
        when such a plan would carry nothing for the workers."""
        if self.inflight and not self.can_plan_ahead():
            raise RuntimeError("schedule() called with too many steps in flight")
        cfg = self.config
        kv = self.kv
        step = InflightStep(self.step)
        budget = cfg.max_num_batched_tokens
        proposal_length = self.speculation.length(len(self.running), settled=not self.inflight)
        if self.admission is not None:
            self.admission.begin(self.running)
        self._speculating = proposal_length > 0

        if cfg.policy == "priority":
            self._make_room(step, budget)

        # Running sequences, best first; each may preempt those after it.
        running = self.running
        preempted_here = False
        growth_reserve = 0
        bs = self.block_size
        pool = kv.pool
        ref_cnt = pool.ref_cnt
        last_slot = bs - 1
        window = kv.window
        stride = kv.num_groups  # device blocks a table's logical block takes
        single = stride == 1  # decodes may take the inlined path below
        num_scheduled = step.num_scheduled
        sampling = step.sampling
        index = 0
        while index < len(running) and budget > 0:
            seq = running[index]
            computed = seq.num_computed_tokens
            pending = seq.num_placeholders
            num_new = len(seq.token_ids) + pending - computed
            if pending and self._result_needed(seq):
                index += 1  # it may end with the token in flight: wait for it
                continue
            if window and (computed - window + 1) // bs > seq.num_released:
                self._slide(seq, step)
            if (
                proposal_length
                and num_new == 1
                and not pending
                and not seq.pending_forks
                and self._schedule_proposal(
                    seq, min(proposal_length, budget - 1), len(running) - index - 1, step
                )
            ):
                budget -= step.num_scheduled[seq.seq_id]
                if seq.num_computed_tokens % bs == 0:
                    growth_reserve += stride
                index += 1
                continue
            if num_new == 1 and seq.on_worker and not seq.pending_forks and single:
                # A decode (the common case) without kv.append / InflightStep.add: one
                # inside its own partial block changes nothing; one that opens a block
                # takes one; one that fills its block (or opens the next) registers the
                # full blocks whose tokens are known in the prefix cache.
                slot = computed % bs
                if slot and slot != last_slot:
                    if not pool.num_shared or ref_cnt[seq.block_table[computed // bs]] == 1:
                        num_scheduled[seq.seq_id] = 1
                        seq.num_computed_tokens = computed + 1
                        seq.num_placeholders = pending + 1
                        sampling.append(seq)
                        budget -= 1
                        index += 1
                        continue
                elif self._decode_at_block_edge(seq, slot, step):
                    seq.num_computed_tokens = computed + 1
                    seq.num_placeholders = pending + 1
                    sampling.append(seq)
                    budget -= 1
                    index += 1
                    if slot == last_slot:
                        growth_reserve += 1
                    continue
            if num_new > 1:
                num_new = self._chunk(num_new, budget)
            while not kv.can_append(seq, num_new):
                victim = self.victims.choose(running, index)
                self._preempt(victim, step)
                preempted_here = True
                if victim == index:
                    break
            else:
                self._schedule_seq(seq, num_new, step)
                budget -= num_new
                if seq.num_computed_tokens % bs == 0:
                    growth_reserve += stride
                index += 1

        # Resume swapped and admit waiting sequences, in queue order, no overtaking.
        if not preempted_here:
            reserve = self.watermark_blocks + growth_reserve
            while budget > 0 and self.num_running_slots < cfg.max_num_seqs:
                candidate, from_swapped = self._next_candidate()
                if (
                    candidate is None
                    or candidate.num_placeholders  # preempted with a token in flight
                    or self.num_running_slots + candidate.slots_needed > cfg.max_num_seqs
                ):
                    break
                seq = candidate
                if from_swapped:
                    num_new = self._chunk(seq.num_tokens - seq.num_computed_tokens, budget)
                    hits = kv.find_swap_hits(seq)
                    if not kv.can_swap_in(seq, hits, num_new, reserve):
                        break
                    self.swapped.pop()
                    pairs, cpu_blocks = kv.swap_in(seq, hits)
                    step.swap_in.extend(pairs)
                    step.cpu_release.extend(cpu_blocks)
                    step.swapped_in.append(seq.seq_id)
                else:
                    hits = kv.find_prefix(seq)
                    host = kv.find_host(seq, hits)
                    if host and not self.cost_model.copy_in_pays(len(host), bs, stride):
                        host = []
                    num_new = self._chunk(seq.num_tokens - (len(hits) + len(host)) * bs, budget)
                    if not kv.can_admit(seq, hits, num_new, reserve, len(host)):
                        break
                    self.waiting.remove(seq)
                    copies = kv.admit(seq, hits, host)
                    if copies:  # (tier block, device block): the tier blocks are pinned
                        step.swap_in.extend(copies)
                        step.host_pins.extend(tier for tier, _ in copies)
                    step.prefix_hit_tokens[seq.seq_id] = seq.num_computed_tokens
                seq.status = SeqStatus.RUNNING
                bisect.insort(running, seq, key=_sort_key)
                self._running_forks += seq.pending_forks
                self._schedule_seq(seq, num_new, step)
                budget -= num_new
                if self.admission is not None and not from_swapped:
                    self.admission.admitted(seq)

        if kv.host is not None and kv.host.pending:  # evicted blocks the host tier keeps
            step.swap_out.extend(kv.host.take_pending())
        if self.inflight and not (
            num_scheduled or step.swap_out or self._freed_seq_ids or self._reset_workers
        ):
            return None  # nothing for the workers until a result is back
        plan = step.plan(
            self._freed_seq_ids, reset=self._reset_workers, masks=self.num_constrained > 0
        )
        self._freed_seq_ids = []
        self._reset_workers = False
        self.inflight.append(step)
        self.last_plan_tokens = cfg.max_num_batched_tokens - budget
        self.step += 1
        return plan

    def _result_needed(self, seq: Sequence) -> bool:
        """Whether ``seq``, with tokens in flight, must wait for them before it is planned
        again: it forks when they are back, reaches its length limit with them, or is
        constrained (its next mask follows from them)."""
        return (
            bool(seq.pending_forks)
            or len(seq.token_ids) + seq.num_placeholders >= seq.max_num_tokens
            or seq.constraint is not None
        )

    def _decode_at_block_edge(self, seq: Sequence, slot: int, step: InflightStep) -> bool:
        """Schedule a known decode that opens a block (``slot`` 0: one block from the
        pool) or fills its block (the last slot, not shared), registering the full blocks
        whose tokens are known; False when it needs the general way (copy-on-write, or
        no free block)."""
        kv = self.kv
        pool = kv.pool
        computed = seq.num_computed_tokens
        if slot:
            if pool.num_shared and pool.ref_cnt[seq.block_table[computed // self.block_size]] != 1:
                return False
        elif pool.num_free:
            (block,) = pool.allocate(1)
            seq.block_table.append(block)
            step.block_updates.append(BlockUpdate(seq_id=seq.seq_id, appended=[block]))
        else:
            return False
        step.num_scheduled[seq.seq_id] = 1
        if kv.enable_prefix_caching:
            known = min(computed + 1, len(seq.token_ids))
            if known // self.block_size > seq.num_cached_blocks:
                kv.cache_full_blocks(seq, known)
        return True

    def _chunk(self, num_new: int, budget: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        if threshold and num_new > threshold:
            num_new = threshold
        return min(num_new, budget)

    def _next_candidate(self) -> tuple[Sequence | None, bool]:
        """The best sequence to resume or admit, and whether it is a swapped one."""
        swapped = self.swapped.peek()
        waiting = self.waiting.peek()
        if swapped is not None and (waiting is None or swapped.key < waiting.key):
            return swapped, True
        if self.admission is not None and waiting is not None:
            return self.admission.pick(self.waiting), False
        return waiting, False

    def _make_room(self, step: InflightStep, budget: int) -> None:
        """Priority policy: preempt running sequences ranked after the best queued one
        until its first chunk fits (blocks and sequence slots).

        Fair-share rounds never make a new arrival outrank a running sequence of its
        priority term, so they add no preemptions here (see ``FairShareRounds``)."""
        seq, from_swapped = self._next_candidate()
        if seq is None or not self.running or self.running[-1].key < seq.key:
            return  # nobody running ranks after it: nothing to take room from
        if seq.num_placeholders:
            return  # preempted with a token in flight: admitted once it is back
        kv = self.kv
        if from_swapped:
            hits = kv.find_swap_hits(seq)
            num_new = self._chunk(seq.num_tokens - seq.num_computed_tokens, budget)
            fits = kv.can_swap_in
        else:
            hits = kv.find_prefix(seq)
            num_new = self._chunk(seq.num_tokens - len(hits) * self.block_size, budget)
            fits = kv.can_admit
        while not (
            fits(seq, hits, num_new, self.watermark_blocks)
            and self.num_running_slots + seq.slots_needed <= self.config.max_num_seqs
        ):
            victim = self.victims.choose_for_admission(self.running, seq.key)
            if victim is None:
                return
            self._preempt(victim, step)

    def _slide(self, seq: Sequence, step: InflightStep) -> None:
        """Release ``seq``'s blocks behind every layer's window (workers that hold the
        sequence are told; a new one's table carries the null entries)."""
        released = self.kv.slide(seq)
        if released and seq.on_worker:
            null = self.kv.null_block
            step.block_updates.append(
                BlockUpdate(seq_id=seq.seq_id, replaced=[(i, null) for i in released])
            )

    def _schedule_seq(self, seq: Sequence, num_new: int, step: InflightStep) -> None:
        if self.kv.window:
            self._slide(seq, step)
        appended, cows = self.kv.append(seq, num_new)
        step.add(seq, num_new, appended, cows)
        request = seq.request
        if request.first_scheduled_step is None:
            request.first_scheduled_step = self.step
            self.fair_share.admitted(self.order.priority_term(request), request.fair_round)

    def _preempt(self, index: int, step: InflightStep) -> None:
        seq = self.running.pop(index)
        self._running_forks -= seq.pending_forks
        mode = self.cost_model.choose(seq, self.kv.cpu_pool.num_free)
        if self.kv.window and step.block_updates:  # it may have slid in this plan
            step.block_updates = [u for u in step.block_updates if u.seq_id != seq.seq_id]
        self._forget_on_worker(seq)
        seq.num_preemptions += 1
        if mode == "swap":
            step.swap_out.extend(self.kv.swap_out(seq))
            step.swapped_out.append(seq)
            seq.status = SeqStatus.SWAPPED
            self.swapped.push(seq)
        else:
            self.kv.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SeqStatus.WAITING
            self.waiting.push(seq)
        self.preemptions[mode] += 1
        step.preempted.append((seq.seq_id, mode))

    # -- results --------------------------------------------------------------------------

    def update(self, result: StepResult) -> StepOutput:
        """Apply the oldest step in flight's sampled tokens; stop and free what finished.
        Returns that step's output.

        A sequence preempted after that step was planned still gets its token (it is
        waiting or swapped now); one that ended meanwhile (abort, stop string, or EOS
        of the step before) drops it."""
        if not self.inflight:
            raise RuntimeError("update() without a scheduled step")
        done = self.inflight[0]
        if result.step != done.step:
            raise WorkerProtocolError(f"result for step {result.step}, expected {done.step}")
        self.inflight.popleft()
        # The swap-ins of that step have run: their CPU blocks are free again.
        self.kv.cpu_pool.release(done.cpu_release)
        if done.host_pins:
            self.kv.host.unpin(done.host_pins)  # type: ignore[union-attr]
        sampled = result.sampled_token_ids
        logprobs = result.logprobs or {}
        plain = not logprobs
        output = done.output
        assert output is not None  # made with the plan
        if result.prompt_logprobs:
            for seq_id, chunk in result.prompt_logprobs.items():
                if (seq := self.seqs.get(seq_id)) is not None:
                    output.prompt_logprobs.append((seq.request.request_id, chunk))
        advanced, new_tokens = output.advanced, output.new_tokens
        finished = SeqStatus.FINISHED
        proposals, drafts = done.proposals, done.drafts
        if self.speculation.k and not done.chunked:  # a decode step: what proposals add to
            timing = result.timing
            self.speculation.timed(
                output.plan.total_tokens, timing.forward_s + timing.sample_s + timing.draft_s
            )
        for seq in done.sampling:
            seq.num_placeholders -= 1
            if seq.status is finished:
                continue
            seq_id = seq.seq_id
            tokens = sampled.get(seq_id)
            if (
                tokens
                and len(tokens) == 1
                and tokens[0] >= 0  # NO_TOKEN (-1): _append_token fails the request
                and plain
                and seq.constraint is None
                and not seq.pending_forks
                and not proposals
                and not drafts
            ):
                # One token, nothing to fork, no logprobs: _append_token inlined (a call
                # per token is 6% of the core's time per generated token); keep them alike.
                token = tokens[0]
                token_ids = seq.token_ids
                token_ids.append(token)
                advanced.append(seq)
                new_tokens.append(token)
                if (
                    token in seq.stop_ids
                    and len(token_ids) - seq.num_prompt_tokens > seq.request.params.min_tokens
                ):
                    self._finish(seq, FinishReason.STOP, output)
                elif len(token_ids) >= seq.max_num_tokens:
                    self._finish(seq, FinishReason.LENGTH, output)
                continue
            entries = logprobs.get(seq_id)
            if proposals and (proposal := proposals.get(seq_id)) is not None:
                self._accept(seq, proposal, tokens, entries, output)
                continue
            if drafts and (drafted := drafts.get(seq_id)) is not None:
                self._accept(seq, drafted, tokens, entries, output)
                continue
            if not tokens or len(tokens) != 1 + seq.pending_forks:
                raise WorkerProtocolError(
                    f"{seq_id}: expected {1 + seq.pending_forks} sampled tokens, got {tokens}"
                )
            # Sample i of a fork step (token i, logprobs entry i) belongs to sample i.
            if seq.pending_forks:
                for index, token in enumerate(tokens[1:], start=1):
                    child = self._fork(seq, index)
                    self._append_token(child, token, output, entries[index] if entries else None)
                    if seq.status is finished:  # the sample failed its request: no more forks
                        break
            if seq.status is not finished:
                self._append_token(seq, tokens[0], output, entries[0] if entries else None)
        return output

    def _fork(self, parent: Sequence, sample_index: int) -> Sequence:
        request = parent.request
        child = Sequence(
            request,
            sample_index,
            list(parent.token_ids),
            self.order.key(request, sample_index),
        )
        self.kv.fork(parent, child)
        if parent.constraint is not None:  # before the parent takes its own token
            child.constraint = parent.constraint.fork()
            self.num_constrained += 1
        child.status = SeqStatus.RUNNING
        child.num_preemptions = parent.num_preemptions
        request.seqs.append(child)
        self.seqs[child.seq_id] = child
        bisect.insort(self.running, child, key=_sort_key)
        parent.pending_forks -= 1
        self._running_forks -= 1
        return child

    def _append_token(
        self,
        seq: Sequence,
        token: int,
        output: StepOutput,
        logprobs: dict[int, float] | None = None,
    ) -> None:
        if token < 0:  # ipc.schema.NO_TOKEN: the worker could draw nothing
            self._fail(seq, _no_token(seq), output)
            return
        if logprobs is not None:
            output.logprobs[len(output.new_tokens)] = logprobs
        token_ids = seq.token_ids
        token_ids.append(token)
        output.advanced.append(seq)
        output.new_tokens.append(token)
        constraint = seq.constraint
        if constraint is not None and (not constraint.accept(token) or constraint.done):
            # The match is complete (or, with a token the mask did not allow, cannot go
            # on): nothing may follow. A matcher that failed fails the request.
            if (error := constraint.error) is not None:
                self._fail(seq, f"structured_outputs: the matcher failed: {error}", output)
            else:
                self._finish(seq, FinishReason.STOP, output)
            return
        # seq.stop_ids and seq.max_num_tokens hold the request's stop rules (EOS unless
        # ignore_eos, stop_token_ids; max_tokens, max_model_len), read from the sequence.
        if (
            token in seq.stop_ids
            and len(token_ids) - seq.num_prompt_tokens > seq.request.params.min_tokens
        ):
            self._finish(seq, FinishReason.STOP, output)
        elif len(token_ids) >= seq.max_num_tokens:
            self._finish(seq, FinishReason.LENGTH, output)
