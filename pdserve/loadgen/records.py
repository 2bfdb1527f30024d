"""Per-request measurements and their JSONL form."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Iterable


@dataclass
class RequestRecord:
    """What the client saw of one request. Times are seconds.

    `sent_s` is relative to the start of the run; `ttft_s`, `e2e_s` and every entry of
    `token_times_s` are relative to `sent_s`. A token time is the arrival of one streamed
    chunk carrying output text (a server may pack several tokens into one chunk).
    """

    index: int
    request_id: str
    scheduled_s: float
    sent_s: float | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    token_count_source: str | None = None  # "usage" or "chunks"
    prompt_tokens_est: int | None = None
    max_tokens: int | None = None
    status: int | None = None
    error: str | None = None
    server_request_id: str | None = None
    kv_bytes: float | None = None
    kv_seconds: float | None = None
    group: int | None = None
    # where the server says the time went (a pdserve router's usage.pdserve_timing of choice 0:
    # place, reserve, queue, prefill, kv, kv_wire, kv_wait, kv_tail, first_decode, ... in seconds,
    # and the pair); None from servers that do not send it
    server_timing: dict | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200 and self.e2e_s is not None

    @property
    def num_output_tokens(self) -> int:
        if self.completion_tokens is not None:
            return self.completion_tokens
        return len(self.token_times_s)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict) -> "RequestRecord":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def write_jsonl(path: str | Path, records: Iterable[RequestRecord]) -> None:
    with open(path, "w") as f:
        for record in records:
            f.write(record.to_json() + "\n")


def read_jsonl(path: str | Path) -> list[RequestRecord]:
    with open(path) as f:
        return [RequestRecord.from_dict(json.loads(line)) for line in f if line.strip()]
