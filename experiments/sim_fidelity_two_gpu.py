"""Simulated vs real on two H200s: every run of the two-GPU study (experiments/two-gpu/).

    PYTHONPATH=. python -m experiments.sim_fidelity_two_gpu        # seconds, CPU only

Real: the committed runs of `experiments/two-gpu/spec.yaml` (24 Poisson requests a point,
rates 2-20 req/s, 2005/256 and 501/1024 server-counted tokens) and of `steady.yaml` (120
requests at 14 req/s, 2048/256) under experiments/results/two-gpu*/<config>/runs/*.jsonl.
Simulated: the same requests (each record's `sent_s`, its server-counted prompt tokens and
`max_tokens`) on the same cluster shape, with the H200 profile of the same engine
(experiments/results/two-gpu/profile.json) and the measured GPU0->GPU1 KV link
(experiments/results/two-gpu/kvtransfer.txt), in three models (MODEL_TEXT): `as-run` (each
configuration's runs chained on one simulated cluster as they ran on one server, the prompts
that repeat across rates served by the prefix cache), `as-run-cluster-link` (the same with the
link the PD runs' transfers achieved) and `fresh` (each run alone, nothing cached). Clusters:

- `pd`: a prefill worker on gpu0 and a decode worker on gpu1, round-robin;
- `colocated`: two mixed workers in colocated mode, least-loaded;
- `hybrid-loose` / `hybrid-tight`: two mixed workers that also move KV (router mode
  disaggregated, every worker mixed), network-aware with the profile, TTFT SLO 1 s and TPOT
  SLO 50 / 10 ms, max batch 64, as experiments/two-gpu/serve.sh starts them.

Link: pdserve's own transfer, first send to ACK, took 6.62 ms for 268.4 MB and 17.94 ms for
1073.7 MB; the line through both points is 71.1 GB/s plus 2.85 ms, which is the link given
to the simulator (the router's congestion monitor learns its rate from the simulated
transfers, as the real one does).

Engine: max_num_batched_tokens 512, max_num_seqs 64, block 16 (the runs' engine); the KV
block count was not logged, so it is set to 40,000 blocks (640k tokens, less than an H200
holds for an 8B model after its weights); no run comes near it (no preemption is simulated).

Both the real and the simulated figures come from the records by loadgen.metrics.summarize
(goodput = requests meeting the SLO set / first send to last finish), as
experiments/two-gpu/analyze.py scores the real runs. Error = (sim - real) / real.

Writes experiments/results/sim-fidelity/two_gpu.md and two_gpu.csv.
"""

from __future__ import annotations

import csv
import itertools
import sys
from pathlib import Path

from loadgen.metrics import SLO, summarize
from loadgen.records import read_jsonl
from router.profiles import load_profile
from router.topology import Link, Topology
from sim.config import ClusterConfig, EngineLimits, RouterConfig, WorkerConfig
from sim.run import Arrival, simulate, to_record

ROOT = Path(__file__).resolve().parent
SWEEP = ROOT / "results" / "two-gpu"
STEADY = ROOT / "results" / "two-gpu-steady"
OUT = ROOT / "results" / "sim-fidelity"
PROFILE = SWEEP / "profile.json"
SLOS = {"loose": SLO(ttft_s=1.0, tpot_s=0.05), "tight": SLO(ttft_s=1.0, tpot_s=0.01)}
METRICS = ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "goodput_loose", "goodput_tight")
CONFIGS = ("pd", "colocated", "hybrid-loose", "hybrid-tight")
MODELS = {"as-run": (True, "benchmark"), "as-run-cluster-link": (True, "cluster"), "fresh": (False, "benchmark")}
RATES = (2.0, 5.0, 9.0, 14.0, 20.0)
MODEL_TEXT = {
    "as-run": "Each configuration's runs one after the other on one simulated cluster, at the offsets "
              "they started at on the real server, and a prompt identified by its dataset and request "
              "index (the spec's one seed sends the same 24 prompts at every rate; the engine's prefix "
              "cache serves them again): the router's state and each worker's prefix cache carry over "
              "from run to run, as on the real server.",
    "as-run-cluster-link": "`as-run` with the KV link the PD runs' own transfers achieved (the line "
                           "through the mean transfer the workers reported for 264 MB and 67 MB in the "
                           "runs with cached prompts: {cluster}) instead of the benchmark's.",
    "fresh": "Each run alone on a fresh simulated cluster, no prompt cached (what a replay of one "
             "run's records gives by itself).",
}
ENGINE = EngineLimits(num_blocks=40_000, block_size=16, max_num_batched_tokens=512, max_num_seqs=64)
# pdserve's transfer GPU0 -> GPU1, first send to ACK (kvtransfer.txt): (bytes, seconds)
KV_POINTS = ((268.4e6, 6.62e-3), (1073.7e6, 17.94e-3))


def kv_link() -> tuple[float, float]:
    """(GB/s, latency ms) of the line through the two measured transfers (kvtransfer.txt)."""
    return _line(*KV_POINTS)


def cluster_link() -> tuple[float, float]:
    """(GB/s, latency ms) of the line through the mean transfer the PD sweep's workers reported
    (summary.csv: kv_transfer_seconds / kv_transfer_count) at each prompt length, over the runs
    after the first of each dataset: their prompts were cached on the prefill worker, so a
    transfer (first send to ACK) follows a step of a few tokens instead of overlapping a whole
    prefill. Derived from the same runs the table compares against."""
    by_dataset: dict[str, list[tuple[float, float]]] = {}
    rows = sorted(csv.DictReader(open(SWEEP / "pd" / "summary.csv")), key=lambda r: float(r["start_time_unix"]))
    seen = set()
    for row in rows:
        if row["dataset"] not in seen:  # the first run of a dataset: uncached prompts
            seen.add(row["dataset"])
            continue
        n = float(row["kv_transfer_count"])
        by_dataset.setdefault(row["dataset"], []).append((float(row["kv_transfer_bytes"]) / n,
                                                          float(row["kv_transfer_seconds"]) / n))
    points = [(sum(b for b, _ in v) / len(v), sum(t for _, t in v) / len(v)) for v in by_dataset.values()]
    return _line(*sorted(points))


def _line(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    (b1, t1), (b2, t2) = a, b
    gbytes_s = (b2 - b1) / (t2 - t1) / 1e9
    return gbytes_s, (t1 - b1 / (gbytes_s * 1e9)) * 1e3


def cluster(config: str, link: tuple[float, float]) -> tuple[ClusterConfig, str]:
    """(the cluster of `config`, the policy name), as experiments/two-gpu/serve.sh starts it;
    `link`: the KV link GPU0 <-> GPU1, (GB/s, latency ms)."""
    profile = load_profile(str(PROFILE))
    gbytes_s, latency_ms = link
    # measured GPU0 -> GPU1; NVLink is symmetric, so the hybrid cluster's GPU1 -> GPU0 is taken the same
    topology = Topology(links=(Link("gpu0", "gpu1", gbytes_s * 8, latency_ms),
                               Link("gpu1", "gpu0", gbytes_s * 8, latency_ms)))
    if config == "pd":
        workers = (WorkerConfig("p0", "prefill", "gpu0"), WorkerConfig("d0", "decode", "gpu1"))
        return ClusterConfig(profile=profile, workers=workers, topology=topology, engine=ENGINE), "round-robin"
    workers = (WorkerConfig("w0", "mixed", "gpu0"), WorkerConfig("w1", "mixed", "gpu1"))
    if config == "colocated":
        return ClusterConfig(profile=profile, workers=workers, topology=topology, mode="colocated",
                             engine=ENGINE), "least-loaded"
    tpot = {"hybrid-loose": 0.05, "hybrid-tight": 0.01}[config]
    router = RouterConfig(policy_options={"network-aware": {"slo_ttft": 1.0, "slo_tpot": tpot, "max_batch": 64}})
    return ClusterConfig(profile=profile, workers=workers, topology=topology, mode="disaggregated",
                         engine=ENGINE, router=router), "network-aware"


def metrics(records) -> dict[str, float]:
    out = {}
    for name, slo in SLOS.items():
        s = summarize(records, slo=slo)
        out[f"goodput_{name}"] = s["goodput"] or 0.0
    s = summarize(records)
    out.update({k: s[k] for k in ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90")})
    out["num_ok"] = s["num_ok"]
    return out


def runs() -> list[tuple[str, str, str, float, float, Path]]:
    """(experiment, config, dataset, rate, start s after the config's first run, records file)
    of every committed real run, each configuration's in the order they ran on its server."""
    found = []
    for experiment, base in (("sweep", SWEEP), ("steady", STEADY)):
        for config in CONFIGS:
            summary = base / config / "summary.csv"
            if not summary.exists():
                continue
            rows = sorted(csv.DictReader(open(summary)), key=lambda r: float(r["start_time_unix"]))
            first = float(rows[0]["start_time_unix"])
            for row in rows:
                found.append((experiment, config, row["dataset"], float(row["rate"]),
                              float(row["start_time_unix"]) - first, base / config / row["records_file"]))
    return found


def simulate_server(config: str, runs_of_server: list[tuple], *, as_run: bool,
                    link: tuple[float, float]) -> list[tuple[list, dict]]:
    """Simulated records of each run of one configuration's server, and what the simulator did.

    `as_run`: the runs follow each other on one simulated cluster at the offsets they started
    at (the router's state, e.g. network-aware's arrival window, and each worker's prefix cache
    carry over), and a request's prompt is identified by (dataset, request index): the spec's
    one seed sends the same prompts at every rate. Otherwise each run is simulated alone on a
    fresh cluster and no prompt is cached."""
    cfg, policy = cluster(config, link)
    if not as_run:
        out = []
        for *_, path in runs_of_server:
            real = sorted(read_jsonl(path), key=lambda r: r.sent_s)
            run = simulate(cfg, policy, [Arrival(r.sent_s, _prompt(r), int(r.max_tokens)) for r in real])
            records = [to_record(q) for q in run.requests]
            for record, r in zip(records, real):
                record.index = r.index  # the real record's index, to pair them
            out.append((records, {"placements": run.decisions, "preemptions": run.num_preemptions}))
        return out
    tagged = []
    for j, (_, _, dataset, _, offset, path) in enumerate(runs_of_server):
        for r in read_jsonl(path):
            arrival = Arrival(offset + r.sent_s, _prompt(r), int(r.max_tokens), prefix_key=(dataset, r.index))
            tagged.append((arrival.offset_s, (j, r.index), arrival))
    tagged.sort(key=lambda t: t[0])
    run = simulate(cfg, policy, [a for _, _, a in tagged])
    # preemptions: the server's whole simulated timeline
    per_run: list[tuple[list, dict]] = [([], {"placements": {}, "preemptions": run.num_preemptions})
                                        for _ in runs_of_server]
    for (_, (j, index), _), request in zip(tagged, run.requests):
        records, extra = per_run[j]
        record = to_record(request)
        record.index = index  # the real record's index, to pair them
        records.append(record)
        d = request.decision
        key = "-" if d is None else d.kind if d.prefill is None else f"{d.prefill}->{d.decode}"
        extra["placements"][key] = extra["placements"].get(key, 0) + 1
    for j, (records, extra) in enumerate(per_run):  # does a simulated run run into the next one?
        if j + 1 < len(runs_of_server):
            end = max(r.sent_s + (r.e2e_s or 0.0) for r in records)
            extra["overlaps_next"] = end > runs_of_server[j + 1][4]
    return per_run


def _prompt(record) -> int:
    return int(record.prompt_tokens or record.prompt_tokens_est)


def main() -> int:
    points = []
    servers: dict[tuple[str, str], list[tuple]] = {}
    for item in runs():
        servers.setdefault((item[0], item[1]), []).append(item)
    links = {"benchmark": kv_link(), "cluster": cluster_link()}
    for model, (as_run, link) in MODELS.items():
        for (experiment, config), items in servers.items():
            for item, (sim_records, extra) in zip(items, simulate_server(config, items, as_run=as_run,
                                                                          link=links[link])):
                _, _, dataset, rate, _, path = item
                real_records = read_jsonl(path)
                real, sim = metrics(real_records), metrics(sim_records)
                by_index = {r.index: r for r in sim_records}
                gaps = sorted(r.ttft_s - by_index[r.index].ttft_s for r in real_records
                              if r.ok and r.index in by_index and by_index[r.index].ok)
                point = {"model": model, "experiment": experiment, "config": config, "dataset": dataset,
                         "rate": rate, "real_ok": real["num_ok"], "sim_ok": sim["num_ok"],
                         "sim_placements": " ".join(f"{k}:{v}" for k, v in sorted(extra["placements"].items())),
                         "sim_preemptions": extra["preemptions"],
                         "sim_overlaps_next_run": extra.get("overlaps_next", False),
                         "ttft_gap_p50": gaps[len(gaps) // 2] if gaps else float("nan")}
                for m in METRICS:
                    rv, sv = float(real[m] or 0.0), float(sim[m] or 0.0)
                    point[f"real_{m}"], point[f"sim_{m}"] = rv, sv
                    point[f"err_{m}"] = (sv - rv) / rv if rv else float("nan")
                points.append(point)
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "two_gpu.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(points[0]))
        writer.writeheader()
        writer.writerows(points)
    lines = report(points)
    (OUT / "two_gpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def _cell(p: dict, m: str) -> str:
    scale, digits = (1e3, 1) if m.startswith(("ttft", "tpot")) else (1.0, 2)
    return f"{p['real_' + m] * scale:.{digits}f} / {p['sim_' + m] * scale:.{digits}f} ({p['err_' + m]:+.0%})"


def report(points: list[dict]) -> list[str]:
    gbytes_s, latency_ms = kv_link()
    lines = ["# Simulator fidelity: the two-H200 runs", "",
             "Real: `experiments/results/two-gpu/` (24 requests a point, one server per configuration "
             "running its 10 runs one after the other) and `two-gpu-steady/` (120 requests at 14 req/s, a "
             "fresh server each). Simulated: the runs' own requests (send times, server-counted prompt "
             "tokens, max_tokens) on the same cluster shape and policy, with the H200 profile of the same "
             "engine (`two-gpu/profile.json`) and, unless said otherwise, the benchmarked KV link "
             f"({gbytes_s:.1f} GB/s + {latency_ms:.2f} ms, the line through pdserve's 2k- and 8k-token "
             "transfers in `kvtransfer.txt`). `PYTHONPATH=. python -m experiments.sim_fidelity_two_gpu` "
             "(seconds). Error = (sim - real) / real.", "",
             "TTFT and TPOT in ms; goodput in req/s at the loose (TTFT <= 1 s, TPOT <= 50 ms) and tight "
             "(TPOT <= 10 ms) sets; each cell real / sim (error). Three models: `as-run` (the runs of a "
             "server chained on one simulated cluster, prompts repeated across rates hit the prefix cache), "
             "`as-run-cluster-link` (the same with the link the runs' own transfers achieved) and `fresh` "
             "(each run alone, nothing cached). experiments/README.md discusses where the errors come from.",
             ""]
    for model in MODELS:
        at = [p for p in points if p["model"] == model]
        text = MODEL_TEXT[model].format(cluster="{:.2f} GB/s + {:.2f} ms".format(*cluster_link()))
        lines += [f"## model `{model}`", "", text, ""]
        for experiment in ("sweep", "steady"):
            for dataset in sorted({p["dataset"] for p in at if p["experiment"] == experiment}):
                mine = [p for p in at if p["experiment"] == experiment and p["dataset"] == dataset]
                lines += [f"### `{model}`, {experiment}: {dataset}", "",
                          "| rate | config | TTFT p50 | TTFT p90 | TPOT p50 | TPOT p90 | goodput loose | goodput tight "
                          "| sim placements |", "|---|---|---|---|---|---|---|---|---|"]
                for p in sorted(mine, key=lambda p: (p["rate"], CONFIGS.index(p["config"]))):
                    flag = " (runs into the next run)" if p["sim_overlaps_next_run"] else ""
                    lines.append(f"| {p['rate']:g} | {p['config']} | " + " | ".join(_cell(p, m) for m in METRICS)
                                 + f" | {p['sim_placements']}{flag} |")
                lines.append("")
        lines += summary_lines(at, model)
    return lines


def _ranking(points: list[dict], key: str, lower_better: bool = False, configs=("pd", "colocated")) -> str | None:
    """'pd > colocated' (pd better), '<' or '=', by `key`; None when a config is missing."""
    by = {p["config"]: p[key] for p in points}
    if not all(c in by for c in configs):
        return None
    a, b = (by[c] for c in configs)
    if lower_better:
        a, b = b, a
    return f"{configs[0]} {'>' if a > b else '<' if a < b else '='} {configs[1]}"


def summary_lines(points: list[dict], model: str) -> list[str]:
    lines = [f"### `{model}`: errors", ""]
    for experiment, configs in itertools.product(("sweep", "steady"), (("pd",), ("colocated",),
                                                                     ("hybrid-loose", "hybrid-tight"), CONFIGS)):
        mine = [p for p in points if p["config"] in configs and p["experiment"] == experiment]
        if not mine:
            continue
        figures = [(abs(p[f"err_{m}"]), m, p) for p in mine for m in METRICS]
        within = sum(e <= 0.10 for e, _, _ in figures)
        worst = max(figures, key=lambda t: t[0])
        per_metric = "; ".join(
            f"{m} {max(abs(p[f'err_{m}']) for p in mine):.0%}" for m in METRICS)
        which = " + ".join(configs) if configs != CONFIGS else "all"
        lines.append(f"- {experiment}, {which}: {within} of {len(figures)} figures within 10%; worst "
                     f"{worst[0]:.0%} ({worst[1]} of {worst[2]['config']}, {worst[2]['dataset']} at "
                     f"{worst[2]['rate']:g} req/s, {worst[2]['experiment']}); worst per metric: {per_metric}")
    lines += ["", f"### `{model}`: what the simulator leaves out of TTFT", "",
              "Median over a run's requests of (real TTFT - simulated TTFT), request by request, in ms:", "",
              "| experiment | dataset | config | " + " | ".join(f"{r:g} req/s" for r in RATES) + " |",
              "|---|---|---|" + "---|" * len(RATES)]
    for experiment, dataset, config in sorted({(p["experiment"], p["dataset"], p["config"]) for p in points},
                                              key=lambda k: (k[0] != "sweep", k[1], CONFIGS.index(k[2]))):
        by_rate = {p["rate"]: p["ttft_gap_p50"] for p in points
                   if (p["experiment"], p["dataset"], p["config"]) == (experiment, dataset, config)}
        lines.append(f"| {experiment} | {dataset} | {config} | "
                     + " | ".join(f"{by_rate[r] * 1e3:.0f}" if r in by_rate else "-" for r in RATES) + " |")
    lines += ["", f"### `{model}`: ranking PD vs colocated (goodput at each SLO set; TTFT p50)", "",
              "| experiment | dataset | rate | loose real / sim | tight real / sim | TTFT p50 real / sim |",
              "|---|---|---|---|---|---|"]
    agree = total = 0
    keys = {(p["experiment"], p["dataset"], p["rate"]) for p in points}
    for key in sorted(keys):
        at = [p for p in points if (p["experiment"], p["dataset"], p["rate"]) == key]
        cells = []
        for m in ("goodput_loose", "goodput_tight", "ttft_p50"):
            lower = m == "ttft_p50"
            real, sim = _ranking(at, f"real_{m}", lower), _ranking(at, f"sim_{m}", lower)
            if real is None:
                cells.append("-")
                continue
            same = real == sim
            agree += same
            total += 1
            cells.append(f"{real} / {sim}{'' if same else ' **differs**'}")
        lines.append(f"| {key[0]} | {key[1]} | {key[2]:g} | " + " | ".join(cells) + " |")
    lines += ["", f"- the ranking agrees in {agree} of {total} comparisons ('>' = better: more goodput, "
                  "lower TTFT)", ""]
    return lines


if __name__ == "__main__":
    sys.exit(main())
