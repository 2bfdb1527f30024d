"""GPU utilisation of a local cluster's workers, sampled with `nvidia-smi` into a CSV file.

Every `interval_s` one row per GPU (`source=gpu`: utilization.gpu %, memory used MiB) and one
row per worker process that `nvidia-smi pmon` lists (`source=process`: SM %, memory-controller
%), with the worker id of that pid. Columns: time_unix, source, gpu, pid, worker, sm_pct,
mem_pct, mem_used_mib (empty where a source has no value).

Without `nvidia-smi` (a CPU machine) nothing is sampled and `available` is False: the
utilisation is then missing, never zero.
"""

from __future__ import annotations

import csv
import logging
import shutil
import subprocess
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)

COLUMNS = ("time_unix", "source", "gpu", "pid", "worker", "sm_pct", "mem_pct", "mem_used_mib")


def _number(text: str) -> float | None:
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        return None  # "-", "[N/A]", ""


def parse_query_gpu(text: str) -> list[dict]:
    """`nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader,nounits`."""
    rows = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3 or not parts[0].isdigit():
            continue
        rows.append({"source": "gpu", "gpu": int(parts[0]), "sm_pct": _number(parts[1]),
                     "mem_used_mib": _number(parts[2])})
    return rows


def parse_pmon(text: str) -> list[dict]:
    """`nvidia-smi pmon -c 1 -s u`: gpu, pid, type, sm %, mem %, ... per process."""
    rows = []
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        parts = line.split()
        if len(parts) < 5 or not parts[0].isdigit() or not parts[1].isdigit():
            continue
        rows.append({"source": "process", "gpu": int(parts[0]), "pid": int(parts[1]),
                     "sm_pct": _number(parts[3]), "mem_pct": _number(parts[4])})
    return rows


class GpuSampler:
    """Samples in a daemon thread from `start()` to `stop()`; `workers` maps pid -> worker id."""

    def __init__(self, path: str | Path, workers: dict[int, str], interval_s: float = 1.0,
                 smi: str | None = None) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.path = Path(path)
        self.workers = dict(workers)
        self.interval_s = interval_s
        self.smi = smi or shutil.which("nvidia-smi")
        self.num_samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return self.smi is not None

    def sample_once(self) -> list[dict]:
        now = time.time()
        rows = []
        for argv, parse in (
            ([self.smi, "--query-gpu=index,utilization.gpu,memory.used", "--format=csv,noheader,nounits"],
             parse_query_gpu),
            ([self.smi, "pmon", "-c", "1", "-s", "u"], parse_pmon),
        ):
            try:
                out = subprocess.run(argv, capture_output=True, text=True, timeout=5).stdout
            except (OSError, subprocess.SubprocessError) as e:
                logger.warning("gpu sampler: %s failed: %s", argv[1], e)
                continue
            rows += parse(out)
        for row in rows:
            row["time_unix"] = round(now, 3)
            if "pid" in row:
                row["worker"] = self.workers.get(row["pid"], "")
        return rows

    def start(self) -> "GpuSampler":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w", newline="") as f:
            csv.DictWriter(f, COLUMNS).writeheader()
        if not self.available:
            logger.warning("gpu sampler: no nvidia-smi; GPU utilisation is not measured")
            return self
        self._thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            rows = self.sample_once()
            with open(self.path, "a", newline="") as f:
                csv.DictWriter(f, COLUMNS).writerows(rows)
            self.num_samples += 1
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
