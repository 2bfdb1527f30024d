"""Request state: counters and properties, no phase flag.

A request has `num_tokens` (prompt + generated) and `num_computed_tokens` (tokens whose KV is
in the cache). Prefill and decode are just `num_tokens - num_computed_tokens` being large or 1.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pdserve.block_manager import BlockTable
from pdserve.sampling_params import SamplingParams, TokenLogprob


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued for admission (new or preempted)
    AWAITING_KV = "awaiting_kv"  # decode role: blocks reserved, KV arriving from a prefill worker
    RUNNING = "running"
    HELD = "held"  # prefill role: first token sampled, KV kept for hand-off until released
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    finish_reason: str | None = None
    table: BlockTable = field(default_factory=BlockTable)
    # sampling state
    generator: object | None = None  # torch.Generator for seeded requests (model runner's)
    grammar: object | None = None  # structured outputs: the matcher, advanced over output_token_ids
    output_text: str = ""
    num_emitted_chars: int = 0  # chars of output_text already returned to the caller
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    detokenizer: object | None = None
    num_emitted_tokens: int = 0
    hand_off: bool = False  # prefill role: stop after the first token, hold the KV for another worker
    on_granted: object | None = None  # decode role: called with the block ids once a waiting reservation gets them
    first_scheduled_time: float | None = None  # time.monotonic() when a step first took its prompt

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def block_ids(self) -> list[int]:
        return self.table.block_ids

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def tokens_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]
