"""Continuous batching with chunked prefill under a per-step token budget.

Each step: running requests first (a decode costs one token, an unfinished prefill a chunk),
then waiting requests in arrival order while the token budget, the running cap and free blocks
allow. When a running request needs a block and none is free, the most recently admitted
running request is preempted by recompute: its blocks are freed, its generated tokens kept,
and it goes back to the front of the waiting queue.

Roles: `mixed` runs requests to completion; `prefill` stops a request after its first token
and holds its KV (status HELD) until `release`; `decode` also admits requests whose KV is
already in reserved blocks (`reserve` then `commit`).

A reservation that finds too few free blocks waits (`queue_reservation`) instead of failing:
`grant_reservations` hands blocks to the waiting ones in arrival order once they are free,
leaving one block per running request for its growth, so that a granted reservation does not
preempt a running decode at its next block boundary.
"""

from __future__ import annotations

import time

from collections import deque
from dataclasses import dataclass, field

from pdserve.block_manager import BlockManager
from pdserve.config import SchedulerConfig
from pdserve.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """What the model runner computes this step: for seqs[i], tokens
    [seqs[i].num_computed_tokens, + num_new_tokens[i])."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)

    def samples(self, index: int) -> bool:
        """Whether seqs[index] reaches its last token this step, so a token is sampled."""
        seq = self.seqs[index]
        return seq.num_computed_tokens + self.num_new_tokens[index] == seq.num_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        if not config.resolved:  # the engine fills them in for its device (config.resolve_scheduler)
            raise ValueError("scheduler config: max_num_batched_tokens and max_num_seqs must be set "
                             "(resolve_scheduler fills in the device's defaults)")
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.held: dict[str, Sequence] = {}  # prefill role: KV kept for hand-off
        self.awaiting_kv: dict[str, Sequence] = {}  # decode role: KV in flight
        self.pending_reservations: deque[Sequence] = deque()  # decode role: waiting for blocks (FIFO)
        self.num_preemptions = 0

    # ---- queue management ----------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.pending_reservations)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def reserve(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Decode role: blocks for `num_tokens` tokens of KV that another worker computes."""
        self.block_manager.allocate_blocks(seq.table, num_tokens)
        seq.status = SequenceStatus.AWAITING_KV
        self.awaiting_kv[seq.request_id] = seq
        return list(seq.block_ids)

    def can_reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Blocks for `num_tokens` now, without cutting into the running requests' next blocks,
        and no earlier reservation waiting (first come, first served)."""
        if self.pending_reservations and self.pending_reservations[0] is not seq:
            return False
        bm = self.block_manager
        needed = bm.blocks_needed(num_tokens) - len(seq.block_ids)
        return needed + len(self.running) <= bm.num_free_blocks or (not self.running and needed <= bm.num_free_blocks)

    def queue_reservation(self, seq: Sequence) -> None:
        """Decode role: `seq` waits for its blocks (granted by `grant_reservations`)."""
        seq.status = SequenceStatus.AWAITING_KV
        self.pending_reservations.append(seq)

    def grant_reservations(self) -> list[Sequence]:
        """Reserves blocks for the waiting reservations at the head of the queue that fit now."""
        granted = []
        while self.pending_reservations:
            seq = self.pending_reservations[0]
            if not self.can_reserve(seq, seq.num_prompt_tokens):
                break
            self.pending_reservations.popleft()
            self.reserve(seq, seq.num_prompt_tokens)
            granted.append(seq)
        return granted

    def commit(self, request_id: str) -> Sequence:
        """Decode role: the reserved KV landed; the request joins the decode batch."""
        seq = self.awaiting_kv.pop(request_id)
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.block_manager.mark_computed(seq.table, seq.all_token_ids, seq.num_computed_tokens)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return seq

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends `seq` wherever it is and frees its blocks."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.AWAITING_KV and seq in self.pending_reservations:
            self.pending_reservations.remove(seq)
        self.held.pop(seq.request_id, None)
        self.awaiting_kv.pop(seq.request_id, None)
        self.block_manager.free(seq.table)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason

    def hold(self, seq: Sequence) -> None:
        """Prefill role: keep the request's KV for hand-off; it leaves the running batch."""
        self.running.remove(seq)
        seq.status = SequenceStatus.HELD
        self.held[seq.request_id] = seq

    # ---- scheduling ----------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager

        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_uncomputed_tokens, budget)
            # Grow the block table for the new tokens, preempting from the back if needed.
            while not bm.can_append(seq.table, seq.num_computed_tokens + num_new):
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # seq preempted itself: nothing behind it remains either
            bm.append_slots(seq.table, seq.num_computed_tokens + num_new)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
            index += 1

        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if batch.preempted:
                break  # memory is short: don't admit while evicting
            seq = self.waiting[0]
            tokens = seq.all_token_ids
            if not bm.can_allocate(tokens):
                break
            self.waiting.popleft()
            cached = bm.allocate(seq.table, tokens)
            seq.num_computed_tokens = cached
            if seq.num_preemptions == 0 and not seq.output_token_ids:
                seq.num_cached_tokens = cached
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            num_new = min(seq.num_uncomputed_tokens, budget)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
        return batch

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq.table)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        batch.preempted.append(seq)
        if seq in batch.seqs:  # already scheduled this step: undo
            i = batch.seqs.index(seq)
            del batch.seqs[i]
            del batch.num_new_tokens[i]

    def postprocess(self, batch: ScheduledBatch, hash_blocks: bool = True) -> None:
        """Advances the computed counters after the model ran `batch`. `hash_blocks=False`
        when a token of the batch is not on the host yet (a step launched ahead of the
        previous step's tokens): `hash_full_blocks` then runs once it is."""
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += num_new
            if hash_blocks:
                self.hash_full_blocks(seq)

    def hash_full_blocks(self, seq: Sequence) -> None:
        """Registers the prefix-cache hashes of `seq`'s computed full blocks."""
        bm = self.block_manager
        # only when a block became full: building all_token_ids costs ~1k list items a step
        if bm.enable_prefix_caching and len(seq.table.block_hashes) < min(
                seq.num_computed_tokens // bm.block_size, len(seq.block_ids)):
            bm.mark_computed(seq.table, seq.all_token_ids, seq.num_computed_tokens)
