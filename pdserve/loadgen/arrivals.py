"""Request arrival processes: when each request is sent, as offsets in seconds from the start.

Every function here is pure and seeded: the same arguments give the same offsets.

- `poisson_offsets`: exponential inter-arrival gaps (coefficient of variation 1).
- `gamma_offsets`: gamma gaps with shape = `burstiness`, mean 1/rate. burstiness == 1 is
  Poisson; < 1 is burstier (CV = 1/sqrt(burstiness)); > 1 is smoother.
- `constant_offsets`: evenly spaced at 1/rate.
- `load_trace`: replays a production trace (Azure LLM inference CSV, Mooncake JSONL,
  BurstGPT CSV) as offsets plus input/output token lengths (and Mooncake's hash ids).

A rate of `math.inf` sends every request at offset 0 (a burst).
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np

from pdserve.loadgen.errors import TraceFormatError

ARRIVAL_KINDS = ("poisson", "gamma", "constant")
TRACE_FORMATS = ("azure", "mooncake", "burstgpt")

_MAX_GENERATION_ROUNDS = 64


def _check_rate(rate: float) -> None:
    if not (rate > 0):
        raise ValueError(f"rate must be > 0 requests/s, got {rate!r}")


def _gaps(kind: str, rate: float, n: int, rng: np.random.Generator, burstiness: float) -> np.ndarray:
    if math.isinf(rate):
        return np.zeros(n)
    if kind == "poisson":
        return rng.exponential(1.0 / rate, size=n)
    if kind == "gamma":
        return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    if kind == "constant":
        return np.full(n, 1.0 / rate)
    raise ValueError(f"unknown arrival kind {kind!r}; expected one of {', '.join(ARRIVAL_KINDS)}")


def arrival_offsets(
    kind: str,
    rate: float,
    *,
    num_requests: int | None = None,
    duration_s: float | None = None,
    seed: int = 0,
    burstiness: float = 1.0,
) -> np.ndarray:
    """Send offsets (seconds, ascending, first gap included) for `kind` at `rate` req/s.

    Give `num_requests` (exactly that many offsets), `duration_s` (every offset < duration),
    or both (whichever bound is hit first).
    """
    _check_rate(rate)
    if kind not in ARRIVAL_KINDS:
        raise ValueError(f"unknown arrival kind {kind!r}; expected one of {', '.join(ARRIVAL_KINDS)}")
    if not (burstiness > 0):
        raise ValueError(f"burstiness must be > 0, got {burstiness!r}")
    if num_requests is None and duration_s is None:
        raise ValueError("give num_requests or duration_s")
    if num_requests is not None and num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if duration_s is not None and not (duration_s > 0):
        raise ValueError(f"duration_s must be > 0, got {duration_s!r}")
    if duration_s is not None and math.isinf(rate) and num_requests is None:
        raise ValueError("an infinite rate needs num_requests")
    rng = np.random.default_rng(seed)
    if duration_s is None:
        assert num_requests is not None
        return np.cumsum(_gaps(kind, rate, num_requests, rng, burstiness))

    # Duration-bounded: draw gaps in chunks until the clock passes the duration.
    limit = num_requests if num_requests is not None else math.inf
    chunk = max(16, int(rate * duration_s * 1.2) + 16) if not math.isinf(rate) else int(limit)
    offsets: list[np.ndarray] = []
    now = 0.0
    count = 0
    for _ in range(_MAX_GENERATION_ROUNDS):
        part = now + np.cumsum(_gaps(kind, rate, chunk, rng, burstiness))
        part = part[part < duration_s]
        part = part[: max(0, int(min(limit - count, len(part))))]
        offsets.append(part)
        count += len(part)
        if count >= limit or len(part) < chunk:
            break
        now = float(part[-1])
    return np.concatenate(offsets) if offsets else np.zeros(0)


def poisson_offsets(rate: float, num_requests: int, seed: int = 0) -> np.ndarray:
    return arrival_offsets("poisson", rate, num_requests=num_requests, seed=seed)


def gamma_offsets(rate: float, num_requests: int, burstiness: float, seed: int = 0) -> np.ndarray:
    return arrival_offsets("gamma", rate, num_requests=num_requests, seed=seed, burstiness=burstiness)


def constant_offsets(rate: float, num_requests: int) -> np.ndarray:
    return arrival_offsets("constant", rate, num_requests=num_requests)


# --------------------------------------------------------------------------------------
# Traces


@dataclass(frozen=True)
class Trace:
    """A replayable trace: parallel lists, sorted by offset, offsets start at 0."""

    path: str
    format: str
    offsets_s: list[float]
    input_tokens: list[int]
    output_tokens: list[int]
    hash_ids: list[list[int]] | None = None
    skipped_rows: int = 0
    models: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.offsets_s)

    @property
    def native_rate(self) -> float:
        """Mean request rate of the trace (req/s); inf for a trace without spread."""
        if len(self.offsets_s) < 2 or self.offsets_s[-1] <= 0:
            return math.inf
        return (len(self.offsets_s) - 1) / self.offsets_s[-1]

    def scaled(self, *, speedup: float = 1.0, rate: float | None = None) -> "Trace":
        """The same trace played `speedup` times faster, or rescaled to mean `rate` req/s."""
        if rate is not None:
            _check_rate(rate)
            native = self.native_rate
            speedup = 1.0 if math.isinf(native) else rate / native
        if not (speedup > 0):
            raise ValueError(f"speedup must be > 0, got {speedup!r}")
        offsets = [o / speedup for o in self.offsets_s]
        return Trace(self.path, self.format, offsets, self.input_tokens, self.output_tokens,
                     self.hash_ids, self.skipped_rows, self.models)

    def head(self, n: int) -> "Trace":
        hashes = self.hash_ids[:n] if self.hash_ids is not None else None
        models = self.models[:n] if self.models else []
        return Trace(self.path, self.format, self.offsets_s[:n], self.input_tokens[:n],
                     self.output_tokens[:n], hashes, self.skipped_rows, models)


def detect_trace_format(path: str | Path) -> str:
    """Guess the format from the extension and, for CSV, the header row."""
    path = Path(path)
    if path.suffix in (".jsonl", ".json"):
        return "mooncake"
    try:
        with path.open(newline="") as f:
            header = next(csv.reader(f), [])
    except OSError as e:
        raise TraceFormatError(str(path), None, None, f"cannot read: {e.strerror or e}") from None
    names = {h.strip() for h in header}
    if "TIMESTAMP" in names:
        return "azure"
    if "Timestamp" in names and "Request tokens" in names:
        return "burstgpt"
    raise TraceFormatError(
        str(path), 1, None,
        "cannot tell the trace format from the header; expected Azure (TIMESTAMP, ContextTokens, "
        "GeneratedTokens) or BurstGPT (Timestamp, Request tokens, Response tokens); "
        "pass the format explicitly",
    )


def _parse_int(value, path: str, line: int, field_name: str) -> int:
    try:
        if isinstance(value, bool):
            raise ValueError
        number = float(str(value).strip())
        if not number.is_integer():
            raise ValueError
        result = int(number)
    except (TypeError, ValueError, OverflowError):
        raise TraceFormatError(path, line, field_name, f"expected a whole number, got {value!r}") from None
    if result < 0:
        raise TraceFormatError(path, line, field_name, f"expected a count >= 0, got {value!r}")
    return result


def _parse_seconds(value, path: str, line: int, field_name: str) -> float:
    """A timestamp as seconds: a number, or an ISO date-time (Azure's format)."""
    text = str(value).strip()
    try:
        number = float(text)
        if math.isfinite(number):
            return number
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise TraceFormatError(path, line, field_name,
                               f"expected seconds or an ISO date-time, got {value!r}") from None


def _read_csv(path: str, required: tuple[str, ...]):
    """Yield (line_number, row dict) of a CSV file whose header has `required` columns."""
    try:
        f = open(path, newline="")
    except OSError as e:
        raise TraceFormatError(path, None, None, f"cannot read: {e.strerror or e}") from None
    with f:
        reader = csv.reader(f)
        header = [h.strip() for h in next(reader, [])]
        for name in required:
            if name not in header:
                raise TraceFormatError(path, 1, name, f"missing column (header: {', '.join(header) or 'empty'})")
        for row in reader:
            line = reader.line_num
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) != len(header):
                raise TraceFormatError(path, line, None, f"expected {len(header)} columns, got {len(row)}")
            yield line, dict(zip(header, row))


def _finish(path, fmt, rows, skipped, max_requests) -> Trace:
    rows.sort(key=lambda r: r[0])
    if max_requests is not None:
        rows = rows[:max_requests]
    if not rows:
        raise TraceFormatError(path, None, None, "the trace has no requests")
    start = rows[0][0]
    hashes = [r[3] for r in rows] if fmt == "mooncake" else None
    models = [r[4] for r in rows] if fmt == "burstgpt" else []
    return Trace(
        path=path,
        format=fmt,
        offsets_s=[r[0] - start for r in rows],
        input_tokens=[max(1, r[1]) for r in rows],
        output_tokens=[max(1, r[2]) for r in rows],
        hash_ids=hashes,
        skipped_rows=skipped,
        models=models,
    )


def load_trace(
    path: str | Path,
    fmt: str | None = None,
    *,
    max_requests: int | None = None,
    skip_failed: bool = True,
) -> Trace:
    """Parse a trace file; raise TraceFormatError naming the file, line and field on bad input.

    Formats:
      azure     CSV: TIMESTAMP (ISO date-time or seconds), ContextTokens, GeneratedTokens
      mooncake  JSONL: {"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [...]}
      burstgpt  CSV: Timestamp (s), Model, Request tokens, Response tokens, Total tokens, Log Type

    Offsets are relative to the earliest request. Token lengths are clipped to >= 1. BurstGPT
    rows with 0 response tokens are failed requests in the log; `skip_failed` drops them.
    """
    path = str(path)
    fmt = fmt or detect_trace_format(path)
    rows: list[tuple] = []
    skipped = 0
    if fmt == "azure":
        for line, row in _read_csv(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens")):
            rows.append((
                _parse_seconds(row["TIMESTAMP"], path, line, "TIMESTAMP"),
                _parse_int(row["ContextTokens"], path, line, "ContextTokens"),
                _parse_int(row["GeneratedTokens"], path, line, "GeneratedTokens"),
            ))
    elif fmt == "burstgpt":
        cols = ("Timestamp", "Model", "Request tokens", "Response tokens")
        for line, row in _read_csv(path, cols):
            ts = _parse_seconds(row["Timestamp"], path, line, "Timestamp")
            n_in = _parse_int(row["Request tokens"], path, line, "Request tokens")
            n_out = _parse_int(row["Response tokens"], path, line, "Response tokens")
            if skip_failed and n_out == 0:
                skipped += 1
                continue
            rows.append((ts, n_in, n_out, None, row["Model"].strip()))
    elif fmt == "mooncake":
        try:
            f = open(path)
        except OSError as e:
            raise TraceFormatError(path, None, None, f"cannot read: {e.strerror or e}") from None
        with f:
            for line, text in enumerate(f, start=1):
                if not text.strip():
                    continue
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as e:
                    raise TraceFormatError(path, line, None, f"invalid JSON: {e.msg}") from None
                if not isinstance(obj, dict):
                    raise TraceFormatError(path, line, None, "expected a JSON object")
                for key in ("timestamp", "input_length", "output_length"):
                    if key not in obj:
                        raise TraceFormatError(path, line, key, "missing")
                ts_ms = _parse_seconds(obj["timestamp"], path, line, "timestamp")
                hashes = obj.get("hash_ids", [])
                if not isinstance(hashes, list) or not all(isinstance(h, int) for h in hashes):
                    raise TraceFormatError(path, line, "hash_ids", "expected a list of integers")
                rows.append((
                    ts_ms / 1000.0,
                    _parse_int(obj["input_length"], path, line, "input_length"),
                    _parse_int(obj["output_length"], path, line, "output_length"),
                    hashes,
                ))
    else:
        raise ValueError(f"unknown trace format {fmt!r}; expected one of {', '.join(TRACE_FORMATS)}")
    return _finish(path, fmt, rows, skipped, max_requests)
