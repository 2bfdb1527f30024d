"""What each request asks for: a prompt and an output length target (`max_tokens`).

Sources:
- synthetic: prompt and output lengths drawn from a `LengthDist` (fixed, uniform, normal,
  lognormal; clipped to [1, max]); prompt text is a seeded sequence of common words.
- sharegpt: a ShareGPT-format JSON file (a list of {"conversations": [{"from", "value"}]});
  the first human turn is the prompt and the length of the first gpt turn after it is the
  output target.
- shared-prefix: `num_groups` groups; every prompt in a group starts with the group's
  common prefix of `prefix_tokens` tokens and ends with a unique suffix.
- traces (`requests_from_trace`): lengths from a trace; Mooncake `hash_ids` become shared
  512-token blocks so that the trace's prefix sharing survives the replay.

Token counts are estimates. Without a tokenizer a word is taken as `TOKENS_PER_WORD` (1.3)
tokens. With `tokenizer=` (a tokenizer.json path, a directory holding one, or a Hugging
Face model name; needs `tokenizers` or `transformers`, and the name must be in the local
cache or reachable), prompts are cut to exact lengths and ShareGPT turns counted exactly
for that tokenizer. The client always records the server-reported `prompt_tokens`, which
is the number to trust.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from pdserve.loadgen.arrivals import Trace
from pdserve.loadgen.errors import DatasetError, LoadgenError

TOKENS_PER_WORD = 1.3
MOONCAKE_BLOCK_TOKENS = 512
DATASET_KINDS = ("synthetic", "sharegpt", "shared-prefix")
LENGTH_KINDS = ("fixed", "uniform", "normal", "lognormal")

# Common English words; prompts are seeded draws from this list.
WORDS = tuple("""
the of and to in is was for on are with as his they be at one have this from by hot word
but what some we can out other were all there when up use your how said an each she which
do their time if will way about many then them write would like so these her long make
thing see him two has look more day could go come did number sound no most people my over
know water than call first who may down side been now find any new work part take get
place made live where after back little only round man year came show every good me give
our under name very through just form sentence great think say help low line differ turn
cause much mean before move right boy old too same tell does set three want air well also
play small end put home read hand port large spell add even land here must big high such
follow act why ask men change went light kind off need house picture try us again animal
point mother world near build self earth father head stand own page should country found
answer school grow study still learn plant cover food sun four between state keep eye never
last let thought city tree cross farm hard start might story saw far sea draw left late run
while press close night real life few north open seem together next white children begin
got walk example ease paper group always music those both mark often letter until mile
river car feet care second book carry took science eat room friend began idea fish mountain
stop once base hear horse cut sure watch color face wood main enough plain girl usual young
ready above ever red list though feel talk bird soon body dog family direct pose leave song
measure door product black short numeral class wind question happen complete ship area half
rock order fire south problem piece told knew pass since top whole king space heard best
hour better true during hundred five remember step early hold west ground interest reach
fast verb sing listen six table travel less morning ten simple several vowel toward war lay
against pattern slow center love person money serve appear road map rain rule govern pull
""".split())


class TokenCounter(Protocol):
    def count(self, text: str) -> int: ...
    def truncate(self, text: str, num_tokens: int) -> str: ...


class WordEstimate:
    """Tokens ~= words * 1.3. Cheap, tokenizer-free, approximate."""

    def count(self, text: str) -> int:
        return max(1, math.ceil(len(text.split()) * TOKENS_PER_WORD)) if text.strip() else 0

    def truncate(self, text: str, num_tokens: int) -> str:
        words = text.split()
        return " ".join(words[: max(1, round(num_tokens / TOKENS_PER_WORD))])

    def words_for(self, num_tokens: int) -> int:
        return max(1, round(num_tokens / TOKENS_PER_WORD))


class HFTokenCounter:
    """Exact counts for one Hugging Face tokenizer (no special tokens)."""

    def __init__(self, name: str):
        self.name = name
        self._encode, self._decode = _load_tokenizer(name)

    def count(self, text: str) -> int:
        return len(self._encode(text))

    def truncate(self, text: str, num_tokens: int) -> str:
        return self._decode(self._encode(text)[:num_tokens])

    def words_for(self, num_tokens: int) -> int:
        return num_tokens + 8  # each word is >= 1 token, so this many words always suffice


def _load_tokenizer(name: str):
    path = Path(name)
    candidate = path / "tokenizer.json" if path.is_dir() else path
    if candidate.suffix == ".json" and candidate.is_file():
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise LoadgenError(f"tokenizer {name}: the `tokenizers` package is not installed") from None
        tok = Tokenizer.from_file(str(candidate))
        return (lambda t: tok.encode(t, add_special_tokens=False).ids), tok.decode
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise LoadgenError(f"tokenizer {name}: needs a tokenizer.json path or the `transformers` package") from None
    try:
        tok = AutoTokenizer.from_pretrained(name)
    except Exception as e:  # noqa: BLE001 - any loader failure is a user-facing input problem
        raise LoadgenError(f"tokenizer {name}: cannot load ({type(e).__name__}: {e})".splitlines()[0]) from None
    return (lambda t: tok.encode(t, add_special_tokens=False)), tok.decode


def token_counter(name: str | None) -> TokenCounter:
    return HFTokenCounter(name) if name else WordEstimate()


# --------------------------------------------------------------------------------------
# Length distributions


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution, clipped to [1, max].

    fixed: `value`; uniform: integers in [low, high]; normal: `mean`, `std`;
    lognormal: `mean` (of the lengths, not of their log) and `sigma` (std of the log).
    """

    kind: str = "fixed"
    value: int = 128
    low: int = 1
    high: int = 128
    mean: float = 128.0
    std: float = 0.0
    sigma: float = 0.5
    max: int = 1 << 20

    def __post_init__(self):
        if self.kind not in LENGTH_KINDS:
            raise ValueError(f"unknown length distribution {self.kind!r}; expected one of {', '.join(LENGTH_KINDS)}")
        checks = {
            "fixed": [("value", self.value >= 1)],
            "uniform": [("low", self.low >= 1), ("high", self.high >= self.low)],
            "normal": [("mean", self.mean > 0), ("std", self.std >= 0)],
            "lognormal": [("mean", self.mean > 0), ("sigma", self.sigma >= 0)],
        }[self.kind] + [("max", self.max >= 1)]
        for name, good in checks:
            if not good:
                raise ValueError(f"{self.kind} length distribution: bad {name}={getattr(self, name)!r}")

    @classmethod
    def parse(cls, text: str) -> "LengthDist":
        """`fixed:N`, `uniform:LO:HI`, `normal:MEAN:STD`, `lognormal:MEAN:SIGMA`, each with an
        optional `:MAX`; a bare integer means fixed."""
        parts = text.strip().split(":")
        try:
            if len(parts) == 1:
                return cls("fixed", value=int(parts[0]))
            kind, nums = parts[0], [float(p) for p in parts[1:]]
            need = 1 if kind == "fixed" else 2
            if kind not in LENGTH_KINDS or len(nums) not in (need, need + 1):
                raise ValueError
            extra = {"max": int(nums[need])} if len(nums) > need else {}
            if kind == "fixed":
                return cls(kind, value=int(nums[0]), **extra)
            if kind == "uniform":
                return cls(kind, low=int(nums[0]), high=int(nums[1]), **extra)
            if kind == "normal":
                return cls(kind, mean=nums[0], std=nums[1], **extra)
            return cls(kind, mean=nums[0], sigma=nums[1], **extra)
        except ValueError as e:
            detail = f" ({e})" if str(e) else ""
            raise ValueError(
                f"bad length distribution {text!r}{detail}; expected fixed:N, uniform:LO:HI, "
                "normal:MEAN:STD or lognormal:MEAN:SIGMA, each with optional :MAX"
            ) from None

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if self.kind == "fixed":
            raw = np.full(n, float(self.value))
        elif self.kind == "uniform":
            raw = rng.integers(self.low, self.high + 1, size=n).astype(float)
        elif self.kind == "normal":
            raw = rng.normal(self.mean, self.std, size=n)
        else:
            mu = math.log(self.mean) - self.sigma**2 / 2
            raw = rng.lognormal(mu, self.sigma, size=n)
        return np.clip(np.rint(raw), 1, self.max).astype(int)


# --------------------------------------------------------------------------------------
# Requests


@dataclass(frozen=True)
class RequestSpec:
    prompt: str
    prompt_tokens_est: int
    max_tokens: int
    group: int | None = None


@dataclass(frozen=True)
class DatasetConfig:
    kind: str = "synthetic"
    input: LengthDist = field(default_factory=lambda: LengthDist("fixed", value=128))
    output: LengthDist = field(default_factory=lambda: LengthDist("fixed", value=128))
    path: str | None = None
    num_groups: int = 8
    prefix_tokens: int = 512
    tokenizer: str | None = None
    name: str = "default"

    def __post_init__(self):
        if self.kind not in DATASET_KINDS:
            raise ValueError(f"unknown dataset kind {self.kind!r}; expected one of {', '.join(DATASET_KINDS)}")
        if self.kind == "sharegpt" and not self.path:
            raise ValueError("a sharegpt dataset needs a path")
        if self.num_groups < 1 or self.prefix_tokens < 1:
            raise ValueError("shared-prefix needs num_groups >= 1 and prefix_tokens >= 1")


def random_text(num_tokens: int, rng: np.random.Generator, counter: TokenCounter | None = None) -> str:
    """Seeded words worth about `num_tokens` tokens (exactly, with an HF tokenizer)."""
    counter = counter or WordEstimate()
    words = rng.choice(len(WORDS), size=counter.words_for(num_tokens))
    text = " ".join(WORDS[i] for i in words)
    return counter.truncate(text, num_tokens) if isinstance(counter, HFTokenCounter) else text


def _synthetic(cfg: DatasetConfig, n: int, rng, counter) -> list[RequestSpec]:
    inputs = cfg.input.sample(n, rng)
    outputs = cfg.output.sample(n, rng)
    return [RequestSpec(random_text(int(i), rng, counter), int(i), int(o)) for i, o in zip(inputs, outputs)]


def _shared_prefix(cfg: DatasetConfig, n: int, rng, counter) -> list[RequestSpec]:
    prefixes = [random_text(cfg.prefix_tokens, rng, counter) for _ in range(cfg.num_groups)]
    suffixes = cfg.input.sample(n, rng)
    outputs = cfg.output.sample(n, rng)
    groups = rng.integers(0, cfg.num_groups, size=n)
    out = []
    for g, s, o in zip(groups, suffixes, outputs):
        prompt = prefixes[g] + " " + random_text(int(s), rng, counter)
        out.append(RequestSpec(prompt, cfg.prefix_tokens + int(s), int(o), int(g)))
    return out


def load_sharegpt(path: str, counter: TokenCounter) -> list[tuple[str, int, int]]:
    """(prompt, prompt tokens, output tokens) for each usable conversation."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise DatasetError(path, None, None, f"cannot read: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise DatasetError(path, e.lineno, None, f"invalid JSON: {e.msg}") from None
    if not isinstance(data, list):
        raise DatasetError(path, None, None, "expected a JSON list of conversations")
    items = []
    for i, entry in enumerate(data):
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list):
            raise DatasetError(path, None, f"[{i}].conversations", "expected a list of turns")
        prompt = answer = None
        for j, turn in enumerate(turns):
            if not isinstance(turn, dict) or not isinstance(turn.get("value"), str) or "from" not in turn:
                raise DatasetError(path, None, f"[{i}].conversations[{j}]",
                                   "expected {from, value} with a string value")
            if prompt is None and turn["from"] == "human":
                prompt = turn["value"]
            elif prompt is not None and turn["from"] == "gpt":
                answer = turn["value"]
                break
        if prompt and answer:
            items.append((prompt, max(1, counter.count(prompt)), max(1, counter.count(answer))))
    if not items:
        raise DatasetError(path, None, None, "no conversation has a human turn followed by a gpt turn")
    return items


def _sharegpt(cfg: DatasetConfig, n: int, rng, counter) -> list[RequestSpec]:
    items = load_sharegpt(cfg.path, counter)
    items = [it for it in items if it[1] <= cfg.input.max] or items
    order = rng.permutation(len(items))
    picks = [items[order[k % len(items)]] for k in range(n)]  # cycles when n > len(items)
    return [RequestSpec(p, n_in, int(min(n_out, cfg.output.max))) for p, n_in, n_out in picks]


def build_requests(cfg: DatasetConfig, n: int, seed: int = 0) -> list[RequestSpec]:
    """`n` requests from `cfg`, reproducible for a given seed."""
    rng = np.random.default_rng([seed, 1])
    counter = token_counter(cfg.tokenizer)
    if cfg.kind == "synthetic":
        return _synthetic(cfg, n, rng, counter)
    if cfg.kind == "shared-prefix":
        return _shared_prefix(cfg, n, rng, counter)
    return _sharegpt(cfg, n, rng, counter)


def requests_from_trace(trace: Trace, seed: int = 0, tokenizer: str | None = None,
                        block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[RequestSpec]:
    """Prompts of the trace's input lengths; equal Mooncake hash ids give equal text blocks."""
    counter = token_counter(tokenizer)
    rng = np.random.default_rng([seed, 2])
    blocks: dict[int, str] = {}
    out = []
    for k, (n_in, n_out) in enumerate(zip(trace.input_tokens, trace.output_tokens)):
        hashes = trace.hash_ids[k] if trace.hash_ids else []
        parts, covered = [], 0
        for h in hashes:
            if covered >= n_in:
                break
            take = min(block_tokens, n_in - covered)
            if h not in blocks:
                blocks[h] = random_text(block_tokens, np.random.default_rng([seed, 3, h]), counter)
            parts.append(blocks[h] if take == block_tokens else counter.truncate(blocks[h], take))
            covered += take
        if covered < n_in:
            parts.append(random_text(n_in - covered, rng, counter))
        out.append(RequestSpec(" ".join(parts), n_in, n_out))
    return out
