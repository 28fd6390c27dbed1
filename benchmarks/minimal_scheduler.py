"""A deliberately minimal continuous-batching scheduler, the benchmark's baseline.

Written for this benchmark after the shape of the smallest engines (FCFS; a step is
either a prefill batch or a decode batch; refcounted blocks with a hash prefix cache;
preemption by recompute from the back of the running queue). No priorities, no swap,
no chunked prefill, no n>1, no invariants: what scheduling costs when it does the
least. Measured side by side with expeditor's scheduler in ``scheduler_step.py``.
"""

from __future__ import annotations

from collections import deque


class MinimalSeq:
    __slots__ = ("blocks", "hashes", "max_tokens", "num_cached", "num_prompt", "seq_id", "tokens")

    def __init__(self, seq_id: str, prompt: list[int], max_tokens: int) -> None:
        self.seq_id = seq_id
        self.tokens = list(prompt)
        self.num_prompt = len(prompt)
        self.max_tokens = max_tokens
        self.blocks: list[int] = []
        self.hashes: list[int] = []
        self.num_cached = 0


class MinimalBlocks:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.ref = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.by_hash: dict[int, int] = {}
        self.free: deque[int] = deque(range(num_blocks))

    def _take(self) -> int:
        block = self.free.popleft()
        old = self.block_hash[block]
        if old is not None and self.by_hash.get(old) == block:
            del self.by_hash[old]
        self.block_hash[block] = None
        self.ref[block] = 1
        return block

    def can_allocate(self, seq: MinimalSeq) -> bool:
        return len(self.free) >= -(-len(seq.tokens) // self.block_size)

    def allocate(self, seq: MinimalSeq) -> None:
        bs = self.block_size
        parent = 0
        for index in range(-(-len(seq.tokens) // bs)):
            chunk = seq.tokens[index * bs : (index + 1) * bs]
            full = len(chunk) == bs
            h = hash((parent, tuple(chunk))) if full else None
            block = self.by_hash.get(h) if h is not None else None
            if block is not None:
                if self.ref[block] == 0:
                    self.free.remove(block)
                self.ref[block] += 1
                seq.num_cached += bs
            else:
                block = self._take()
                if h is not None:
                    self.by_hash[h] = block
                    self.block_hash[block] = h
            seq.blocks.append(block)
            if h is not None:
                seq.hashes.append(h)
                parent = h

    def release(self, seq: MinimalSeq) -> None:
        for block in reversed(seq.blocks):
            self.ref[block] -= 1
            if self.ref[block] == 0:
                self.free.append(block)
        seq.blocks = []
        seq.num_cached = 0

    def can_append(self, seq: MinimalSeq) -> bool:
        return len(self.free) >= (len(seq.tokens) % self.block_size == 1)

    def may_append(self, seq: MinimalSeq) -> None:
        bs = self.block_size
        if len(seq.tokens) % bs == 1:
            seq.blocks.append(self._take())
        elif len(seq.tokens) % bs == 0:
            parent = seq.hashes[-1] if seq.hashes else 0
            h = hash((parent, tuple(seq.tokens[-bs:])))
            self.by_hash.setdefault(h, seq.blocks[-1])
            self.block_hash[seq.blocks[-1]] = h
            seq.hashes.append(h)


class MinimalScheduler:
    def __init__(self, num_blocks: int, block_size: int, max_seqs: int, max_tokens: int) -> None:
        self.blocks = MinimalBlocks(num_blocks, block_size)
        self.max_seqs = max_seqs
        self.max_batched_tokens = max_tokens
        self.waiting: deque[MinimalSeq] = deque()
        self.running: deque[MinimalSeq] = deque()
        self.eos = 2

    def add(self, seq: MinimalSeq) -> None:
        self.waiting.append(seq)

    def schedule(self) -> list[MinimalSeq]:
        batch: list[MinimalSeq] = []
        tokens = 0
        while self.waiting and len(self.running) < self.max_seqs:
            seq = self.waiting[0]
            if tokens + len(seq.tokens) > self.max_batched_tokens or not self.blocks.can_allocate(
                seq
            ):
                break
            self.blocks.allocate(seq)
            tokens += len(seq.tokens) - seq.num_cached
            self.waiting.popleft()
            self.running.append(seq)
            batch.append(seq)
        if batch:
            return batch
        while self.running:
            seq = self.running.popleft()
            while not self.blocks.can_append(seq):
                if self.running:
                    victim = self.running.pop()
                    self.blocks.release(victim)
                    self.waiting.appendleft(victim)
                else:
                    self.blocks.release(seq)
                    self.waiting.appendleft(seq)
                    break
            else:
                self.blocks.may_append(seq)
                batch.append(seq)
        self.running.extendleft(reversed(batch))
        return batch

    def postprocess(self, batch: list[MinimalSeq], tokens: list[int]) -> int:
        finished = 0
        for seq, token in zip(batch, tokens, strict=True):
            seq.tokens.append(token)
            if token == self.eos or len(seq.tokens) - seq.num_prompt >= seq.max_tokens:
                self.blocks.release(seq)
                self.running.remove(seq)
                finished += 1
        return finished
