"""Tables and plots of the two-GPU study (experiments/two-gpu/spec.yaml), from its records.

Each configuration's sweep lives in `<results>/<config>/` (loadgen's summary.csv and
runs/*.jsonl). Both SLO sets are scored from the same records:

- loose: TTFT <= 1 s, TPOT <= 50 ms;  tight: TTFT <= 1 s, TPOT <= 10 ms;
- goodput = requests meeting the set / run duration (loadgen.metrics.summarize);
- the hybrid cluster is scored at the SLO set its router was given (hybrid-loose at the
  loose set, hybrid-tight at the tight one), and compared with the better of PD and
  colocated at the same rate and at each configuration's peak goodput over the sweep;
- the light-load check: PD TTFT p50 <= colocated TTFT p50 + KV bytes / link + 5 ms at the
  lowest rate, the link being raw ucxx in one message from `kvtransfer.txt` (2k row).

    python -m experiments.two-gpu.analyze [--results two-gpu]

--results is a folder, or an experiment's name looked up by experiments/records.py: a new run
in results/<name>, else the committed archive docs/records/<name>.tar.xz (extracted once into
results/.records/<name>, where the tables are then written).
"""

from __future__ import annotations

import argparse
import csv
import math
import re
import sys
from pathlib import Path

from experiments.records import resolve
from pdserve.loadgen.metrics import SLO, meets_slo, summarize
from pdserve.loadgen.records import read_jsonl

CONFIGS = ("pd", "colocated", "hybrid-loose", "hybrid-tight")
SLOS = {"loose": SLO(ttft_s=1.0, tpot_s=0.05), "tight": SLO(ttft_s=1.0, tpot_s=0.01)}
HYBRID = {"loose": "hybrid-loose", "tight": "hybrid-tight"}


def load_rows(results: Path) -> list[dict]:
    rows = []
    for config in CONFIGS:
        summary = results / config / "summary.csv"
        if not summary.exists():
            continue
        with open(summary) as f:
            for run in csv.DictReader(f):
                if not run.get("records_file"):
                    continue
                records = read_jsonl(results / config / run["records_file"])
                row = {"config": config, "dataset": run["dataset"], "rate": float(run["rate"]),
                       "kv_transfers": _float(run.get("kv_transfer_count")),
                       "kv_gbps": _float(run.get("kv_transfer_gbps"))}
                s = summarize(records)
                for name, slo in SLOS.items():
                    met = sum(meets_slo(r, slo) for r in records)
                    row[f"goodput_{name}"] = met / s["duration_s"] if s["duration_s"] else 0.0
                    row[f"attain_{name}"] = met / len(records) if records else 0.0
                for key in ("num_requests", "num_errors", "ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90",
                            "request_throughput", "duration_s"):
                    row[key] = s[key]
                ok = [r for r in records if r.ok]
                row["prompt_tokens"] = sum(r.prompt_tokens or 0 for r in ok) / max(1, len(ok))
                kv = [r.kv_bytes for r in ok if r.kv_bytes]
                row["kv_bytes"] = sum(kv) / len(kv) if kv else None
                rows.append(row)
    return rows


def _float(value) -> float | None:
    try:
        return float(value) if value not in (None, "") else None
    except ValueError:
        return None


def link_gbytes(results: Path) -> float | None:
    """GB/s of raw ucxx in one message at 2048 tokens, from the KV bench's table."""
    path = results / "kvtransfer.txt"
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        cols = line.split()
        if len(cols) >= 6 and cols[0] == "2048" and re.fullmatch(r"[\d.]+", cols[4]):
            return float(cols[4])  # tokens, KV MB, copy, fake, raw one, ...
    return None


def fmt(v, scale=1.0, digits=1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v * scale:.{digits}f}"


def tables(rows: list[dict], link: float | None) -> str:
    out = []
    datasets = sorted({r["dataset"] for r in rows})
    by = {(r["config"], r["dataset"], r["rate"]): r for r in rows}
    for ds in datasets:
        rates = sorted({r["rate"] for r in rows if r["dataset"] == ds})
        configs = [c for c in CONFIGS if any(r["config"] == c and r["dataset"] == ds for r in rows)]
        tokens = [r["prompt_tokens"] for r in rows if r["dataset"] == ds and r["prompt_tokens"]]
        out.append(f"### {ds} (server-counted prompt tokens: mean {sum(tokens) / len(tokens):.0f})\n" if tokens
                   else f"### {ds}\n")
        out.append("| rate | config | TTFT p50 / p90 (ms) | TPOT p50 / p90 (ms) | goodput loose | goodput tight "
                   "| errors | KV transfers |")
        out.append("|---|---|---|---|---|---|---|---|")
        for rate in rates:
            for c in configs:
                r = by.get((c, ds, rate))
                if r is None:
                    continue
                out.append(f"| {rate:g} | {c} | {fmt(r['ttft_p50'], 1e3, 0)} / {fmt(r['ttft_p90'], 1e3, 0)} | "
                           f"{fmt(r['tpot_p50'], 1e3)} / {fmt(r['tpot_p90'], 1e3)} | {r['goodput_loose']:.2f} | "
                           f"{r['goodput_tight']:.2f} | {r['num_errors']} | {fmt(r['kv_transfers'], 1, 0)} |")
        out.append("")
        out.append(ratios(rows, ds, rates, by))
        out.append(light_load(ds, rates, by, link))
    return "\n".join(out)


def ratios(rows, ds, rates, by) -> str:
    lines = ["| SLO | rate | PD / colocated | hybrid / best of (PD, colocated) |", "|---|---|---|---|"]
    for name in SLOS:
        key = f"goodput_{name}"
        for rate in rates:
            pd, co, hy = (by.get((c, ds, rate)) for c in ("pd", "colocated", HYBRID[name]))
            best = max((x[key] for x in (pd, co) if x), default=None)
            lines.append(f"| {name} | {rate:g} | {_ratio(pd and pd[key], co and co[key])} | "
                         f"{_ratio(hy and hy[key], best)} |")
        peaks = {c: max((r[key] for r in rows if r["config"] == c and r["dataset"] == ds), default=None)
                 for c in ("pd", "colocated", HYBRID[name])}
        best = max((v for c, v in peaks.items() if c in ("pd", "colocated") and v is not None), default=None)
        lines.append(f"| {name} | peak over rates | {_ratio(peaks['pd'], peaks['colocated'])} "
                     f"({fmt(peaks['pd'], 1, 2)} vs {fmt(peaks['colocated'], 1, 2)} req/s) | "
                     f"{_ratio(peaks[HYBRID[name]], best)} ({fmt(peaks[HYBRID[name]], 1, 2)} req/s) |")
    return "\n".join(lines) + "\n"


def _ratio(a, b) -> str:
    if a is None or b is None:
        return "-"
    if b == 0:
        return "inf" if a > 0 else "- (both 0)"
    return f"{a / b:.2f}x"


def light_load(ds, rates, by, link) -> str:
    if not rates:
        return ""
    rate = rates[0]
    pd, co = by.get(("pd", ds, rate)), by.get(("colocated", ds, rate))
    if not pd or not co or pd["ttft_p50"] is None or co["ttft_p50"] is None:
        return ""
    kv = pd["kv_bytes"]
    if kv is None and pd.get("prompt_tokens"):
        kv = pd["prompt_tokens"] * 128 * 1024  # Llama-3.1-8B bf16: 128 KiB a token
    if link is None or kv is None:
        return f"Lowest rate ({rate:g} req/s): PD TTFT p50 {pd['ttft_p50'] * 1e3:.1f} ms, colocated " \
               f"{co['ttft_p50'] * 1e3:.1f} ms (no link figure for the bound).\n"
    bound = co["ttft_p50"] + kv / (link * 1e9) + 0.005
    verdict = "met" if pd["ttft_p50"] <= bound else "missed"
    return (f"Lowest rate ({rate:g} req/s), the light-load check: PD TTFT p50 {pd['ttft_p50'] * 1e3:.1f} ms vs bound "
            f"{bound * 1e3:.1f} ms = colocated {co['ttft_p50'] * 1e3:.1f} + {kv / 1e6:.0f} MB / {link:.0f} GB/s "
            f"+ 5 ms: **{verdict}**.\n")


def plots(rows: list[dict], out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("analyze: matplotlib is not installed; plots skipped", file=sys.stderr)
        return []
    made = []
    out.mkdir(parents=True, exist_ok=True)
    styles = {"pd": "C0-o", "colocated": "C1-s", "hybrid-loose": "C2--^", "hybrid-tight": "C3-.v"}
    for ds in sorted({r["dataset"] for r in rows}):
        fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
        for c in CONFIGS:
            sel = sorted((r for r in rows if r["config"] == c and r["dataset"] == ds), key=lambda r: r["rate"])
            if not sel:
                continue
            x = [r["rate"] for r in sel]
            for ax, key, scale in ((axes[0], "ttft", 1e3), (axes[1], "tpot", 1e3)):
                ax.plot(x, [(r[f"{key}_p50"] or math.nan) * scale for r in sel], styles[c], label=f"{c} p50")
                ax.plot(x, [(r[f"{key}_p90"] or math.nan) * scale for r in sel], styles[c], alpha=0.4,
                        label=f"{c} p90")
            axes[2].plot(x, [r["goodput_loose"] for r in sel], styles[c], label=c)
            axes[3].plot(x, [r["goodput_tight"] for r in sel], styles[c], label=c)
        axes[0].set(title=f"TTFT ({ds})", xlabel="rate (req/s)", ylabel="ms", yscale="log")
        axes[1].set(title=f"TPOT ({ds})", xlabel="rate (req/s)", ylabel="ms", yscale="log")
        axes[2].set(title="goodput, loose SLO (TPOT <= 50 ms)", xlabel="rate (req/s)", ylabel="req/s")
        axes[3].set(title="goodput, tight SLO (TPOT <= 10 ms)", xlabel="rate (req/s)", ylabel="req/s")
        for ax in axes:
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=6)
        axes[3].legend(fontsize=7)
        fig.tight_layout()
        path = out / f"two-gpu-{ds}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)
    return made


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default="two-gpu")
    args = parser.parse_args()
    try:
        results = resolve(args.results)
    except FileNotFoundError as e:
        parser.error(f"--results: {e}")
    rows = load_rows(results)
    if not rows:
        parser.error(f"--results: no runs under {results}/<config>/summary.csv ({', '.join(CONFIGS)})")
    link = link_gbytes(results)
    with open(results / "two-gpu.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    text = tables(rows, link)
    made = plots(rows, results / "plots")
    report = results / "table.md"
    report.write_text(text + "\n" + "\n".join(f"![{p.stem}](plots/{p.name})" for p in made) + "\n")
    print(text)
    print(f"wrote {results / 'two-gpu.csv'}, {report}" + (f", {len(made)} plots" if made else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
