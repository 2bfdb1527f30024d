"""Experiment outputs: environment.json, plots (matplotlib, Agg) and report.md.

Plots are grouped by (cluster shape, dataset); inside a group:
- `ttft_cdf`: TTFT CDF per policy, one panel per link bandwidth, at the highest rate run.
- `slo_attainment_vs_rate`: attainment per policy vs request rate, one panel per bandwidth.
- `goodput_vs_bandwidth`: best goodput over the rates, per policy, vs link bandwidth.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from importlib import metadata
from pathlib import Path

from pdserve.loadgen.errors import LoadgenError
from pdserve.loadgen.records import read_jsonl

log = logging.getLogger(__name__)

KEY_PACKAGES = ("pdserve", "httpx", "numpy", "pyyaml", "tqdm", "matplotlib", "openai", "torch", "vllm", "sglang")


class PlottingUnavailable(LoadgenError):
    pass


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlottingUnavailable("plots need matplotlib, which is not installed (pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _run(argv: list[str], cwd: str | None = None) -> str | None:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10, cwd=cwd)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def collect_environment(cwd: str | None = None) -> dict:
    """Where the numbers came from. The hostname is deliberately left out.

    The git commit is that of `cwd` (default: the checkout this package runs from).
    """
    cwd = cwd or str(Path(__file__).resolve().parent)
    commit = _run(["git", "rev-parse", "HEAD"], cwd)
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd) if commit else None
    gpus = None
    if shutil.which("nvidia-smi"):
        out = _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
        gpus = [line.strip() for line in out.splitlines()] if out else None
    packages = {}
    for name in KEY_PACKAGES:
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return {
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git_commit": commit,
        "git_dirty": bool(dirty) if commit else None,
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpus": gpus,
        "os": f"{platform.system()} {platform.release()}",
        "python": sys.version.split()[0],
        "packages": packages,
    }


def write_environment(path: str | Path, cwd: str | None = None) -> dict:
    env = collect_environment(cwd)
    Path(path).write_text(json.dumps(env, indent=2) + "\n")
    return env


# --------------------------------------------------------------------------------------
# Plots


def _label(value, unit: str = "") -> str:
    if value in (None, ""):
        return "-"
    return f"{value:g}{unit}" if isinstance(value, float) else f"{value}{unit}"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "all"


def _float(value) -> float | None:
    try:
        return None if value in (None, "") else float(value)
    except (TypeError, ValueError):
        return None


def make_plots(rows: list[dict], out_dir: str | Path) -> list[Path]:
    """Draw the plots for completed rows; returns the files written (relative to out_dir)."""
    plt = _pyplot()
    out_dir = Path(out_dir)
    (out_dir / "plots").mkdir(parents=True, exist_ok=True)
    done = [r for r in rows if not r.get("error") and r.get("num_requests")]
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in done:
        groups[(row.get("cluster"), row.get("dataset"))].append(row)
    written: list[Path] = []
    for (cluster, dataset), group in groups.items():
        prefix = _slug(f"{cluster or 'server'}_{dataset}") if len(groups) > 1 else ""
        prefix = prefix + "_" if prefix else ""
        bandwidths = sorted({r.get("bandwidth_gbps") for r in group}, key=lambda b: (b is None, _float(b) or 0))
        policies = sorted({_label(r.get("policy")) for r in group})
        colors = {policy: f"C{i}" for i, policy in enumerate(policies)}
        title = f"{cluster} · {dataset}" if cluster else str(dataset)

        # TTFT CDF at the highest rate
        top_rate = max(_float(r["rate"]) for r in group)
        fig, axes = plt.subplots(1, len(bandwidths), figsize=(4.5 * len(bandwidths), 3.6), squeeze=False)
        for ax, bw in zip(axes[0], bandwidths):
            for row in sorted(group, key=lambda r: _label(r.get("policy"))):
                if row.get("bandwidth_gbps") != bw or _float(row["rate"]) != top_rate or not row.get("records_file"):
                    continue
                ttfts = sorted(r.ttft_s for r in read_jsonl(out_dir / row["records_file"])
                               if r.ok and r.ttft_s is not None)
                if ttfts:
                    ys = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
                    policy = _label(row.get("policy"))
                    ax.step([t * 1000 for t in ttfts], ys, where="post", label=policy, color=colors[policy])
            ax.set(title=f"{_label(bw, ' Gbps')}, {top_rate:g} req/s", xlabel="TTFT (ms)", ylabel="CDF", ylim=(0, 1.02))
            ax.grid(alpha=0.3)
            _legend(ax)
        fig.suptitle(f"TTFT CDF — {title}")
        written.append(_save(plt, fig, out_dir, f"{prefix}ttft_cdf.png"))

        if any(r.get("slo_attainment") not in (None, "") for r in group):
            fig, axes = plt.subplots(1, len(bandwidths), figsize=(4.5 * len(bandwidths), 3.6), squeeze=False)
            for ax, bw in zip(axes[0], bandwidths):
                for policy in policies:
                    pts = sorted((_float(r["rate"]), _float(r.get("slo_attainment"))) for r in group
                                 if r.get("bandwidth_gbps") == bw and _label(r.get("policy")) == policy)
                    if pts:
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy,
                                color=colors[policy])
                ax.axhline(0.9, color="grey", linestyle="--", linewidth=0.8)
                ax.set(title=_label(bw, " Gbps"), xlabel="request rate (req/s)", ylabel="SLO attainment",
                       ylim=(0, 1.05))
                ax.grid(alpha=0.3)
                _legend(ax)
            fig.suptitle(f"SLO attainment vs rate — {title}")
            written.append(_save(plt, fig, out_dir, f"{prefix}slo_attainment_vs_rate.png"))

            numeric_bw = [b for b in bandwidths if _float(b) is not None]
            if numeric_bw:
                fig, ax = plt.subplots(figsize=(5.5, 3.8))
                for policy in policies:
                    pts = []
                    for bw in numeric_bw:
                        goodputs = [_float(r.get("goodput")) or 0.0 for r in group
                                    if r.get("bandwidth_gbps") == bw and _label(r.get("policy")) == policy]
                        if goodputs:
                            pts.append((_float(bw), max(goodputs)))
                    if pts:
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy,
                                color=colors[policy])
                ax.set_xscale("log")
                ax.set_xticks([_float(b) for b in numeric_bw], [_label(_float(b)) for b in numeric_bw])
                ax.minorticks_off()
                ax.set(xlabel="link bandwidth (Gbit/s)", ylabel="goodput (req/s, best rate)",
                       title=f"Goodput — {title}")
                ax.grid(alpha=0.3)
                _legend(ax)
                written.append(_save(plt, fig, out_dir, f"{prefix}goodput_vs_bandwidth.png"))
    return written


def _legend(ax) -> None:
    """A legend where the axes have labelled lines (a panel with no data has none)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def _save(plt, fig, out_dir: Path, name: str) -> Path:
    fig.tight_layout()
    fig.savefig(out_dir / "plots" / name, dpi=110)
    plt.close(fig)
    return Path("plots") / name


# --------------------------------------------------------------------------------------
# report.md


def _fmt(value, scale: float = 1.0, digits: int = 1) -> str:
    number = _float(value)
    return "-" if number is None else f"{number * scale:.{digits}f}"


# (summary column, header) of the server-timing table: p50 over the requests the server timed, ms
BREAKDOWN_COLUMNS = (("srv_place_p50", "place"), ("srv_reserve_p50", "reserve"), ("srv_queue_p50", "queue"),
                     ("srv_prefill_p50", "prefill"), ("srv_kv_p50", "KV"), ("srv_kv_tail_p50", "KV tail"),
                     ("srv_first_decode_p50", "first decode"), ("srv_first_token_p50", "first token"),
                     ("srv_first_text_p50", "first text"), ("ttft_p50", "client TTFT"))


def _breakdown(rows: list[dict]) -> list[str]:
    """Where TTFT went, from the server's per-request timing (`usage.pdserve_timing`; loadgen.metrics
    server_breakdown): none when no run has it. Columns no run has are left out."""
    timed = [r for r in rows if _float(r.get("srv_timed"))]
    if not timed:
        return []
    columns = [(key, head) for key, head in BREAKDOWN_COLUMNS if any(_float(r.get(key)) is not None for r in timed)]
    lines = ["", "## Where TTFT went (server timing, p50 ms)", "",
             "queue / prefill: the prefill worker's (local: the worker's) wait for a step and its prefill; first "
             "token / first text: the router's arrival to the first token and to the first text (later when the "
             "first tokens decode to no text yet); client TTFT: as measured here. p50s of different requests do "
             "not add up exactly.", "",
             "| policy | dataset | rate | timed (local) | " + " | ".join(head for _, head in columns) + " |",
             "|---|---|---|---|" + "---|" * len(columns)]
    for r in timed:
        lines.append(f"| {_label(r.get('policy'))} | {r.get('dataset')} | {_label(r.get('rate'))} "
                     f"| {r.get('srv_timed')} ({r.get('srv_local')}) | "
                     + " | ".join(_fmt(r.get(key), 1000) for key, _ in columns) + " |")
    return lines


def write_report(
    path: str | Path,
    *,
    name: str,
    rows: list[dict],
    environment: dict,
    plots: list[Path],
    notes: list[str],
) -> None:
    lines = [f"# {name}", ""]
    lines += [f"- {note}" for note in notes]
    gpus = ", ".join(environment.get("gpus") or []) or "none"
    lines += [
        f"- hardware: {environment.get('cpu_model')} ({environment.get('cpu_count')} CPUs), GPUs: {gpus}",
        f"- software: Python {environment.get('python')}, commit {environment.get('git_commit') or 'unknown'}"
        + (" (dirty)" if environment.get("git_dirty") else ""),
        "",
        "## Results",
        "",
        "| cluster | policy | link Gbps | dataset | rate | ok/sent | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms "
        "| TPOT p50 ms | TPOT p99 ms | SLO att. | goodput | KV Gbit/s | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        interrupted = r.get("interrupted")
        if isinstance(interrupted, str):  # a row read back from summary.csv
            interrupted = interrupted.strip().lower() in ("true", "1")
        note = r.get("error") or ("interrupted" if interrupted else "")
        lines.append(
            f"| {_label(r.get('cluster'))} | {_label(r.get('policy'))} | {_label(r.get('bandwidth_gbps'))} "
            f"| {r.get('dataset')} | {_label(r.get('rate'))} | {r.get('num_ok', 0)}/{r.get('num_requests', 0)} "
            f"| {_fmt(r.get('request_throughput'), digits=2)} | {_fmt(r.get('output_token_throughput'))} "
            f"| {_fmt(r.get('ttft_p50'), 1000)} | {_fmt(r.get('ttft_p99'), 1000)} "
            f"| {_fmt(r.get('tpot_p50'), 1000, 2)} | {_fmt(r.get('tpot_p99'), 1000, 2)} "
            f"| {_fmt(r.get('slo_attainment'), 100)}% | {_fmt(r.get('goodput'), digits=2)} "
            f"| {_fmt(r.get('kv_transfer_gbps'), digits=2)} | {str(note).replace('|', '/')[:120]} |"
        )
    lines += _breakdown(rows)
    if plots:
        lines += ["", "## Plots", ""]
        lines += [f"![{p.stem}]({p.as_posix()})" for p in plots]
    Path(path).write_text("\n".join(lines) + "\n")
