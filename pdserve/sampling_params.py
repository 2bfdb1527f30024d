"""Sampling parameters with OpenAI semantics, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve.timing import RequestTiming, WorkerTiming


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (0: only the sampled one)
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _finite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not _finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 0, got {self.top_k!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _finite(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be non-empty strings")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass
class RequestOutput:
    """What one engine step produced for one request (a delta, not the whole text)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    # where the request's time went, set by the router's cluster backend on the finished delta
    timing: RequestTiming | None = None
    # from a worker's client: the worker's own part of the first token, on the delta that carries it
    worker_timing: WorkerTiming | None = None
    # engine side, on the delta with the request's first output token: (time.monotonic() when a
    # step first took the prompt, when the token was ready); None on every other delta
    first_token_times: tuple[float, float] | None = None

    @staticmethod
    def merge(outputs: "list[RequestOutput]") -> "RequestOutput":
        """Consecutive deltas of one request as one: tokens, text and logprobs in order, the
        counters and the finish of the last, the first token's times of the first that has them."""
        if len(outputs) == 1:
            return outputs[0]
        last = outputs[-1]
        logprobs = [lp for o in outputs for lp in o.logprobs or ()]
        return RequestOutput(
            request_id=last.request_id, new_token_ids=[t for o in outputs for t in o.new_token_ids],
            new_text="".join(o.new_text for o in outputs), finished=last.finished, finish_reason=last.finish_reason,
            num_prompt_tokens=last.num_prompt_tokens, num_output_tokens=last.num_output_tokens,
            num_cached_tokens=last.num_cached_tokens,
            logprobs=logprobs if any(o.logprobs is not None for o in outputs) else None,
            first_token_times=next((o.first_token_times for o in outputs if o.first_token_times), None),
        )
