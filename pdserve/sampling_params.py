"""Sampling parameters with OpenAI semantics, validated on construction.

Besides OpenAI's fields a request may carry `logit_bias` (token id -> a bias added to its logit),
`bad_words_ids` (token sequences the output never contains: the last token of each is banned
whenever the output ends with the ones before it) and `structured` (a grammar the output obeys,
`pdserve.structured`). All three travel with the request to every worker that samples for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve.structured.spec import StructuredOutput
from pdserve.timing import RequestTiming, WorkerTiming

LOGIT_BIAS_LIMIT = 100.0  # OpenAI's bounds of a logit bias: [-100, 100]


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
    # (token id, bias) pairs sorted by id; a dict {id: bias} is accepted and normalised
    logit_bias: tuple[tuple[int, float], ...] = ()
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    structured: StructuredOutput | None = None

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
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        object.__setattr__(self, "bad_words_ids", _bad_words(self.bad_words_ids))
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured must be a StructuredOutput, got {type(self.structured).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def has_sequence_bans(self) -> bool:
        """A bad word of several tokens: whether its last token is banned depends on the output."""
        return any(len(word) > 1 for word in self.bad_words_ids)

    def banned_token_ids(self, output_token_ids: list[int]) -> list[int]:
        """The ids `bad_words_ids` ban for the next token after `output_token_ids`."""
        banned = []
        for word in self.bad_words_ids:
            head = len(word) - 1
            if head == 0 or (len(output_token_ids) >= head and tuple(output_token_ids[-head:]) == word[:-1]):
                banned.append(word[-1])
        return banned


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _token_id(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must hold token ids (integers >= 0), got {value!r}")
    return value


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    items = value.items() if isinstance(value, dict) else value
    out: dict[int, float] = {}
    for pair in items:  # type: ignore[union-attr]
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"logit_bias must map token ids to biases, got {pair!r}")
        token, bias = _token_id(pair[0], "logit_bias"), pair[1]
        if not _finite(bias) or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token}")
        if token in out:
            raise ValueError(f"logit_bias names token {token} twice")
        out[token] = float(bias)
    return tuple(sorted(out.items()))


def _bad_words(value: object) -> tuple[tuple[int, ...], ...]:
    words = []
    for word in value:  # type: ignore[union-attr]
        if not isinstance(word, (tuple, list)) or not word:
            raise ValueError(f"bad_words_ids must be non-empty token sequences, got {word!r}")
        words.append(tuple(_token_id(t, "bad_words_ids") for t in word))
    return tuple(words)


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
