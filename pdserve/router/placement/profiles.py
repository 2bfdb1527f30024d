"""Performance profiles: prefill and decode step times measured on the hardware (`pdserve profile`).

The JSON file (version 1)::

    {
      "version": 1,
      "hardware": {"device": "cuda", "name": "NVIDIA H100 80GB HBM3"},
      "model": "random:llama-3.1-8b", "dtype": "bfloat16",
      "num_layers": 32, "kv_bytes_per_token": 131072,
      "block_size": 16, "max_num_batched_tokens": 512,
      "prefill": {"tokens": [16, 64, 256, 1024, 4096],          # strictly increasing
                  "seconds": [0.011, 0.012, 0.02, 0.07, 0.31]},  # time to first token, idle engine
      "decode": {"batch_sizes": [1, 4, 16], "contexts": [128, 1024],  # strictly increasing
                 "seconds": [[0.010, 0.011], [0.011, 0.013], [0.013, 0.02]]},  # [batch][context]
      "mixed": {"context": 1024, "batch_sizes": [1, 16], "chunk_tokens": [64, 512],  # optional
                "seconds": [[0.021, 0.03], [0.024, 0.034]]},  # [batch][chunk tokens]
      "created": "2025-01-01T00:00:00Z",
      "engine": {"step_version": 2, "release": "0.1.0"}              # optional
    }

`engine` (optional; files without it load as before): the engine that measured the table, its
step version (pdserve/step_version.py: bumped when a change moves step times) and its package
release. The simulator and the planner warn when it is older than the running engine's, or when
`hardware` is not the hardware they plan for (pdserve/sim/profile_check.py).

`mixed` (optional; files without it load as before): the time of one engine step that carries
a decode batch of B requests at context `context` plus a prefill chunk of T tokens, measured
as the engine runs such steps (`pdserve profile --mixed`; on a GPU they run eagerly where
decode-only steps replay CUDA graphs, so they cost more than the sum of the two tables).
`mixed_step_seconds(b, t, c)` interpolates the table along T in each batch row, then along B,
and moves it to the actual context `c` by the decode table's difference at that batch,
D(b, c) - D(b, context), never below D(b, c) itself (the mixed step is measured at one
context; the decode table says how a decode batch's time grows with it).

Queries interpolate linearly between measured points; beyond the last point they extend the
last segment's slope (never decreasing); below the first point they take the first point's
value (a fixed per-step overhead dominates small work). Unknown keys and bad values raise
ValueError naming the file and the field.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

PROFILE_VERSION = 1
_KEYS = ("version", "hardware", "model", "dtype", "num_layers", "kv_bytes_per_token", "block_size",
         "max_num_batched_tokens", "prefill", "decode", "mixed", "created", "engine")
_OPTIONAL = ("mixed", "created", "engine")
_MIXED_KEYS = ("context", "batch_sizes", "chunk_tokens", "seconds")


@dataclass(frozen=True)
class Profile:
    hardware: str
    device: str
    model: str
    dtype: str
    num_layers: int
    kv_bytes_per_token: int
    block_size: int
    max_num_batched_tokens: int
    prefill_tokens: tuple[int, ...]
    prefill_times: tuple[float, ...]
    decode_batch_sizes: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    decode_times: tuple[tuple[float, ...], ...]  # [batch index][context index]
    created: str = ""
    # the optional mixed table (module docstring): all four set, or none (context None)
    mixed_context: int | None = None
    mixed_batch_sizes: tuple[int, ...] = ()
    mixed_chunk_tokens: tuple[int, ...] = ()
    mixed_times: tuple[tuple[float, ...], ...] = ()  # [batch index][chunk index]
    # the engine that measured it (module docstring); None: an unstamped file
    engine_step_version: int | None = None
    engine_release: str = ""

    def __post_init__(self) -> None:
        for name in ("num_layers", "kv_bytes_per_token", "block_size", "max_num_batched_tokens"):
            _positive_int(name, getattr(self, name))
        _axis("prefill.tokens", self.prefill_tokens)
        _times("prefill.seconds", self.prefill_times, len(self.prefill_tokens))
        _axis("decode.batch_sizes", self.decode_batch_sizes)
        _axis("decode.contexts", self.decode_contexts)
        if len(self.decode_times) != len(self.decode_batch_sizes):
            raise ValueError(f"decode.seconds must have one row per batch size ({len(self.decode_batch_sizes)}), "
                             f"got {len(self.decode_times)}")
        for i, row in enumerate(self.decode_times):
            _times(f"decode.seconds[{i}]", row, len(self.decode_contexts))
        if self.mixed_context is None:
            if self.mixed_batch_sizes or self.mixed_chunk_tokens or self.mixed_times:
                raise ValueError("mixed.context: missing (the mixed table needs its decode context)")
        else:
            _positive_int("mixed.context", self.mixed_context)
            _axis("mixed.batch_sizes", self.mixed_batch_sizes)
            _axis("mixed.chunk_tokens", self.mixed_chunk_tokens)
            if len(self.mixed_times) != len(self.mixed_batch_sizes):
                raise ValueError(f"mixed.seconds must have one row per batch size ({len(self.mixed_batch_sizes)}), "
                                 f"got {len(self.mixed_times)}")
            for i, row in enumerate(self.mixed_times):
                _times(f"mixed.seconds[{i}]", row, len(self.mixed_chunk_tokens))
        if self.engine_step_version is not None:
            _positive_int("engine.step_version", self.engine_step_version)

    @property
    def has_mixed(self) -> bool:
        """Whether the profile has a mixed table (`mixed_step_seconds` answers)."""
        return self.mixed_context is not None

    # ---------------------------------------------------------------- queries

    def prefill_seconds(self, num_tokens: int) -> float:
        """Time to prefill `num_tokens` tokens on an idle worker (0 for none)."""
        if num_tokens <= 0:
            return 0.0
        return _interpolate(self.prefill_tokens, self.prefill_times, num_tokens)

    def decode_step_seconds(self, batch: int, context: int) -> float:
        """Time of one decode step of `batch` requests of about `context` tokens each (0 for an empty batch).

        Interpolates along the context in each batch row, then along the batch; only the rows the
        second interpolation reads are computed (placement asks this for every decode worker)."""
        if batch <= 0:
            return 0.0
        memo = self._step_memo
        found = memo.get((batch, context))
        if found is None:
            rows = _LazyRows(self.decode_contexts, self.decode_times, max(context, 1))
            found = _interpolate(self.decode_batch_sizes, rows, batch)
            if len(memo) >= _STEP_MEMO_SIZE:
                memo.clear()
            memo[(batch, context)] = found
        return found

    def mixed_step_seconds(self, batch: int, chunk_tokens: int, context: int) -> float:
        """Time of one step of `batch` decodes at about `context` tokens each plus `chunk_tokens`
        prefill tokens, from the mixed table (module docstring); ValueError without one.
        No decodes: the chunk's prefill time; no chunk: the decode step."""
        if chunk_tokens <= 0:
            return self.decode_step_seconds(batch, context)
        if batch <= 0:
            return self.prefill_seconds(chunk_tokens)
        if self.mixed_context is None:
            raise ValueError("this profile has no mixed table (`pdserve profile --mixed` measures one)")
        rows = _LazyRows(self.mixed_chunk_tokens, self.mixed_times, chunk_tokens)
        at_table = _interpolate(self.mixed_batch_sizes, rows, batch)
        decode = self.decode_step_seconds(batch, context)
        return max(at_table + decode - self.decode_step_seconds(batch, self.mixed_context), decode)

    @property
    def _step_memo(self) -> dict[tuple[int, int], float]:
        memo = self.__dict__.get("_step_memo_dict")
        if memo is None:
            memo = {}
            object.__setattr__(self, "_step_memo_dict", memo)
        return memo

    # ---------------------------------------------------------------- JSON

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": PROFILE_VERSION,
            "hardware": {"device": self.device, "name": self.hardware},
            "model": self.model, "dtype": self.dtype,
            "num_layers": self.num_layers, "kv_bytes_per_token": self.kv_bytes_per_token,
            "block_size": self.block_size, "max_num_batched_tokens": self.max_num_batched_tokens,
            "prefill": {"tokens": list(self.prefill_tokens), "seconds": list(self.prefill_times)},
            "decode": {"batch_sizes": list(self.decode_batch_sizes), "contexts": list(self.decode_contexts),
                       "seconds": [list(row) for row in self.decode_times]},
            **({} if self.mixed_context is None else {"mixed": {
                "context": self.mixed_context, "batch_sizes": list(self.mixed_batch_sizes),
                "chunk_tokens": list(self.mixed_chunk_tokens),
                "seconds": [list(row) for row in self.mixed_times]}}),
            "created": self.created,
            **({} if self.engine_step_version is None else {"engine": {
                "step_version": self.engine_step_version, "release": self.engine_release}}),
        }

    @classmethod
    def from_dict(cls, data: Any) -> Profile:
        """ValueError naming the field on unknown keys, missing keys and bad values."""
        _keys("", data, _KEYS, _OPTIONAL)
        if data["version"] != PROFILE_VERSION:
            raise ValueError(f"version: this pdserve reads version {PROFILE_VERSION}, got {data['version']!r}")
        hw = _keys("hardware", data["hardware"], ("device", "name"), ())
        prefill = _keys("prefill", data["prefill"], ("tokens", "seconds"), ())
        decode = _keys("decode", data["decode"], ("batch_sizes", "contexts", "seconds"), ())
        for name, value in (("hardware.device", hw["device"]), ("hardware.name", hw["name"]),
                            ("model", data["model"]), ("dtype", data["dtype"])):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        rows = decode["seconds"]
        if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
            raise ValueError("decode.seconds must be a list of lists (one per batch size)")
        mixed: dict[str, Any] = {}
        if "mixed" in data:
            table = _keys("mixed", data["mixed"], _MIXED_KEYS, ())
            _positive_int("mixed.context", table["context"])
            mixed_rows = table["seconds"]
            if not isinstance(mixed_rows, list) or not all(isinstance(r, list) for r in mixed_rows):
                raise ValueError("mixed.seconds must be a list of lists (one per batch size)")
            mixed = dict(mixed_context=table["context"],
                         mixed_batch_sizes=_tuple("mixed.batch_sizes", table["batch_sizes"]),
                         mixed_chunk_tokens=_tuple("mixed.chunk_tokens", table["chunk_tokens"]),
                         mixed_times=tuple(tuple(r) for r in mixed_rows))
        engine: dict[str, Any] = {}
        if "engine" in data:
            table = _keys("engine", data["engine"], ("step_version", "release"), ("release",))
            _positive_int("engine.step_version", table["step_version"])
            if not isinstance(table.get("release", ""), str):
                raise ValueError(f"engine.release must be a string, got {table['release']!r}")
            engine = dict(engine_step_version=table["step_version"], engine_release=table.get("release", ""))
        return cls(
            hardware=hw["name"], device=hw["device"], model=data["model"], dtype=data["dtype"],
            num_layers=data["num_layers"], kv_bytes_per_token=data["kv_bytes_per_token"],
            block_size=data["block_size"], max_num_batched_tokens=data["max_num_batched_tokens"],
            prefill_tokens=_tuple("prefill.tokens", prefill["tokens"]),
            prefill_times=_tuple("prefill.seconds", prefill["seconds"]),
            decode_batch_sizes=_tuple("decode.batch_sizes", decode["batch_sizes"]),
            decode_contexts=_tuple("decode.contexts", decode["contexts"]),
            decode_times=tuple(tuple(r) for r in rows),
            created=str(data.get("created", "")),
            **mixed, **engine,
        )


def load_profile(path: str) -> Profile:
    """Reads a profile file; ValueError naming `path` when it is missing or malformed."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the profile: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
    try:
        return Profile.from_dict(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def save_profile(profile: Profile, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(profile.to_dict(), f, indent=2)
        f.write("\n")


# ---------------------------------------------------------------- helpers


_STEP_MEMO_SIZE = 1 << 16  # decode step times remembered per profile (cleared when full)


class _LazyRows:
    """The per-batch-size step times at one context, each computed when first read."""

    def __init__(self, contexts: Sequence[int], rows: Sequence[Sequence[float]], context: int) -> None:
        self.contexts, self.rows, self.context = contexts, rows, context
        self.values: dict[int, float] = {}

    def __getitem__(self, i: int) -> float:
        value = self.values.get(i)
        if value is None:
            value = self.values[i] = _interpolate(self.contexts, self.rows[i], self.context)
        return value


def _interpolate(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    if len(xs) == 1 or x <= xs[0]:
        return ys[0] if x <= xs[0] else ys[0] * x / xs[0]
    i = bisect.bisect_right(xs, x)
    lo = min(i, len(xs) - 1) - 1  # the segment [lo, lo+1]; the last one beyond the end
    slope = (ys[lo + 1] - ys[lo]) / (xs[lo + 1] - xs[lo])
    if i >= len(xs):
        slope = max(slope, 0.0)
    return max(ys[lo] + slope * (x - xs[lo]), 0.0)


def _keys(where: str, data: Any, allowed: tuple[str, ...], optional: tuple[str, ...]) -> Mapping[str, Any]:
    prefix = f"{where}." if where else ""
    if not isinstance(data, dict):
        raise ValueError(f"{where or 'the profile'} must be a JSON object")
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise ValueError(f"{prefix}{unknown[0]}: unknown key; allowed: {', '.join(allowed)}")
    missing = [k for k in allowed if k not in data and k not in optional]
    if missing:
        raise ValueError(f"{prefix}{missing[0]}: missing")
    return data


def _tuple(name: str, value: Any) -> tuple:
    if not isinstance(value, list):
        raise ValueError(f"{name} must be a list, got {value!r}")
    return tuple(value)


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _axis(name: str, values: Sequence[Any]) -> None:
    if not values:
        raise ValueError(f"{name} must not be empty")
    for v in values:
        _positive_int(name, v)
    if any(b <= a for a, b in zip(values, values[1:])):
        raise ValueError(f"{name} must be strictly increasing, got {list(values)}")


def _times(name: str, values: Sequence[Any], n: int) -> None:
    if len(values) != n:
        raise ValueError(f"{name} must have {n} values (one per point), got {len(values)}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{name} must hold numbers > 0, got {v!r}")
