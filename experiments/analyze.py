"""The headline table, placements per pair and one bar plot, from a finished experiment.

    .venv/bin/python -m experiments.analyze results/headline results/headline-servers

Reads <exp>/summary.csv (pdserve-loadgen experiment) and <servers>/<policy>/router.log (the
routers' DEBUG logs, one directory per policy), writes <exp>/headline.csv (goodput, SLO
attainment, TTFT p50/p90, TPOT p50, goodput ratios vs round-robin and least-loaded),
<exp>/placements.csv (requests per prefill->decode pair and policy) and
<exp>/plots/headline.png, and prints both tables as Markdown.
"""

from __future__ import annotations

import csv
import re
import sys
from collections import Counter
from pathlib import Path

DECISION = re.compile(r"Decision\(kind='(\w+)', prefill=(?:'(\w+)'|None), decode='(\w+)'")
POLICIES = ("round-robin", "least-loaded", "network-aware")
COLUMNS = ("policy", "rate", "num_ok", "goodput", "slo_attainment", "ttft_p50", "ttft_p90", "tpot_p50",
           "goodput_vs_round_robin", "goodput_vs_least_loaded")


def placements(log: Path) -> Counter:
    pairs: Counter = Counter()
    for line in log.read_text(errors="replace").splitlines():
        if match := DECISION.search(line):
            kind, prefill, decode = match.groups()
            pairs[f"{prefill}->{decode}" if prefill else f"{kind} on {decode}"] += 1
    return pairs


def headline_rows(summary: Path) -> list[dict]:
    rows = {r["policy"]: r for r in csv.DictReader(open(summary)) if r.get("goodput")}
    out = []
    for policy in [p for p in POLICIES if p in rows]:
        r = rows[policy]
        row = {k: r.get(k) for k in COLUMNS if k in r}
        for base in ("round-robin", "least-loaded"):
            ratio = None
            if base in rows and float(rows[base]["goodput"] or 0) > 0:
                ratio = float(r["goodput"]) / float(rows[base]["goodput"])
            row[f"goodput_vs_{base.replace('-', '_')}"] = ratio
        out.append(row)
    return out


def _fmt(value) -> str:
    try:
        return f"{float(value):.3g}"
    except (TypeError, ValueError):
        return "" if value is None else str(value)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = [r["policy"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    panels = (("goodput", "goodput (req/s meeting both SLOs)"), ("slo_attainment", "SLO attainment"),
              (("ttft_p50", "ttft_p90"), "TTFT (s), p50 / p90"))
    for ax, (key, title) in zip(axes, panels):
        if isinstance(key, tuple):
            xs = range(len(rows))
            ax.bar([x - 0.2 for x in xs], [float(r[key[0]]) for r in rows], 0.4, label="p50", color="C0")
            ax.bar([x + 0.2 for x in xs], [float(r[key[1]]) for r in rows], 0.4, label="p90", color="C1")
            ax.legend(fontsize=8)
        else:
            ax.bar(range(len(rows)), [float(r[key]) for r in rows], color=["C0", "C1", "C2"][:len(rows)])
        ax.set_xticks(range(len(rows)), policies, fontsize=8)
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    exp, servers = Path(argv[0]), Path(argv[1])
    rows = headline_rows(exp / "summary.csv")
    with open(exp / "headline.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    pairs = {log.parent.name: placements(log) for log in sorted(servers.glob("*/router.log"))}
    with open(exp / "placements.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["policy", "pair", "requests"])
        for policy, counts in pairs.items():
            writer.writerows([policy, pair, n] for pair, n in sorted(counts.items()))
    if rows:
        plot(rows, exp / "plots" / "headline.png")
    print("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS))
    for row in rows:
        print("| " + " | ".join(_fmt(row.get(k)) for k in COLUMNS) + " |")
    names = sorted({p for counts in pairs.values() for p in counts})
    print("\n| policy | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for policy, counts in pairs.items():
        print(f"| {policy} | " + " | ".join(str(counts.get(n, 0)) for n in names) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
