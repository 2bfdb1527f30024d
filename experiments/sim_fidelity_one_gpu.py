"""Simulated vs real on one H200: the one-GPU runs (experiments/two-gpu/one-gpu.yaml).

    python -m experiments.sim_fidelity_one_gpu        # seconds, CPU only

Real: the committed runs of `experiments/two-gpu/one-gpu.yaml` (one mixed worker, `pdserve up
--mode colocated --replicas 1`, 64 Poisson requests a point at 1.5, 3, 4.5 and 6.5 req/s, 2048/256
and 512/1024 tokens: one GPU's share of the two-GPU colocated sweep), made with
`experiments/two-gpu/run.sh profile single` (RESULTS=results/one-gpu; committed:
docs/records/one-gpu.tar.xz), so the profile (`profile.json` there) was measured by the same
engine on the same machine in the same call.
Simulated: each record's send time, server-counted prompt tokens and `max_tokens` on one mixed
worker with that profile and the server's engine limits (512-token budget, 64 sequences).

Models:

- `chained`: the server's 8 runs one after the other on one simulated worker, at the offsets
  they started at (a run that outlasts its successor's start carries over, as on the server);
- `fresh`: each run alone;
- `chained-old-profile`: `chained` with the two-GPU study's profile
  (experiments/two-gpu/profile.json, an older engine: no overlapped decode steps), to
  show what the current profile changes.

Saturation: a point is "below saturation" when the real server kept up with the offered rate
(real TTFT p90 under the 1 s TTFT SLO: no queue that grows for the length of the run). The
issue's target (TTFT, TPOT p50/p90 and goodput within 10%) is counted over those points.

Writes results/sim-fidelity/one_gpu.md and one_gpu.csv.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

from experiments.records import label, records_dir
from experiments.sim_fidelity_two_gpu import ENGINE, METRICS, SLOS, _prompt, _summary, metrics
from pdserve.loadgen.records import read_jsonl
from pdserve.loadgen.runner import write_summary_csv
from pdserve.router.placement.profiles import load_profile
from pdserve.sim.config import ClusterConfig, RouterConfig, WorkerConfig, scale_profile
from pdserve.sim.run import Arrival, simulate, to_record

ROOT = Path(__file__).resolve().parent
RESULTS = "one-gpu"  # records_dir: results/one-gpu, else docs/records/one-gpu.tar.xz
BARE = "one-gpu-bare"  # benchmarks/bench_engine_replay.py --records <dir>/single; the same lookup
OLD_PROFILE = ROOT / "two-gpu" / "profile.json"
OUT = ROOT.parent / "results" / "sim-fidelity"
CONFIG = "single"
# model -> (chained, profile, overlapped decode steps, calibrated serving costs)
MODELS = {"chained": (True, "current", True, False), "fresh": (False, "current", True, False),
          "chained-no-overlap": (True, "current", False, False), "chained-old-profile": (True, "old", True, False),
          "chained-served": (True, "current", True, True)}
CALIBRATED = "chained-served"
WITHIN = 0.10


def cluster(profile_path: Path, overlap: bool = True, served: dict[str, float] | None = None) -> ClusterConfig:
    """One mixed worker, as `serve.sh single` starts it (colocated mode, least-loaded); `overlap`:
    the engine's overlapped decode steps (on, as on the GPU that ran it); `served`: a
    `served_calibration` (steps scaled by its factors, its front path before placement)."""
    profile = load_profile(str(profile_path))
    router = RouterConfig()
    if served is not None:
        profile = scale_profile(profile, prefill_factor=served["prefill_factor"],
                                decode_factor=served["decode_factor"], label="served, calibrated")
        router = RouterConfig(front_s=served["front_s"])
    return ClusterConfig(profile=profile, workers=(WorkerConfig("w0", "mixed", "gpu0"),), mode="colocated",
                         engine=dataclasses.replace(ENGINE, overlap_steps=overlap), router=router)


def served_calibration(items: list[tuple], profile_path: Path, sims: list[list]) -> dict[str, float] | None:
    """The serving costs the profile does not hold, from each dataset's lowest-rate run (the
    calibration points: fitted, not predicted), medians over their requests' server timing:

    - front_s: the client's TTFT less the worker's queue + prefill (HTTP, tokenising, router,
      gRPC legs, text held back), put before placement on every request;
    - prefill_factor: the worker's served prefill (first step with the prompt to its first token,
      decodes of the steps included) / the profile's P(prompt);
    - decode_factor: each request's time per output token, real / simulated (`chained`, the same
      request), at those runs (`sims`: each run's records under `chained`).
    None when the runs carry no server timing."""
    profile = load_profile(str(profile_path))
    lowest: dict[str, tuple] = {}
    for item in items:
        if item[0] not in lowest or item[1] < lowest[item[0]][1]:
            lowest[item[0]] = item
    calib = [it for it in items if it in lowest.values()]
    front, prefill, decode = [], [], []
    for item, sim_records in zip(items, sims):
        if item not in calib:
            continue
        by_index = {r.index: r for r in sim_records}
        for r in read_jsonl(item[3]):
            t = r.server_timing or {}
            if not r.ok or "prefill" not in t or "queue" not in t:
                continue
            front.append(r.ttft_s - t["queue"] - t["prefill"])
            prefill.append(t["prefill"] / profile.prefill_seconds(_prompt(r)))
            sim = by_index.get(r.index)
            if sim is not None and sim.ok and (r.completion_tokens or 0) > 1:
                real_tpot = (r.e2e_s - r.ttft_s) / (r.completion_tokens - 1)
                sim_tpot = (sim.e2e_s - sim.ttft_s) / (sim.completion_tokens - 1)
                decode.append(real_tpot / sim_tpot)
    if not front:
        return None
    return {"front_s": statistics.median(front), "prefill_factor": statistics.median(prefill),
            "decode_factor": statistics.median(decode) if decode else 1.0,
            "calibration_runs": ", ".join(f"{d} at {r:g} req/s" for d, r, *_ in calib)}


def runs(results: Path) -> list[tuple[str, float, float, Path]]:
    """(dataset, rate, start s after the server's first run, records file), in the order they ran."""
    rows = [r for r in _summary(results / CONFIG) if r.get("start_time_unix") and r.get("records_file")]
    rows.sort(key=lambda r: float(r["start_time_unix"]))
    if not rows:
        return []
    first = float(rows[0]["start_time_unix"])
    return [(r["dataset"], float(r["rate"]), float(r["start_time_unix"]) - first, results / CONFIG / r["records_file"])
            for r in rows]


def simulate_runs(cfg: ClusterConfig, items: list[tuple], chained: bool) -> list[list]:
    """Simulated records of each run, paired with the real ones by index."""
    if not chained:
        out = []
        for *_, path in items:
            real = sorted(read_jsonl(path), key=lambda r: r.sent_s)
            run = simulate(cfg, "least-loaded", [Arrival(r.sent_s, _prompt(r), int(r.max_tokens)) for r in real])
            records = [to_record(q) for q in run.requests]
            for record, r in zip(records, real):
                record.index = r.index
            out.append(records)
        return out
    tagged = []
    for j, (_, _, offset, path) in enumerate(items):
        for r in read_jsonl(path):
            tagged.append((offset + r.sent_s, j, r.index, Arrival(offset + r.sent_s, _prompt(r), int(r.max_tokens))))
    tagged.sort(key=lambda t: t[0])
    run = simulate(cfg, "least-loaded", [t[3] for t in tagged])
    out = [[] for _ in items]
    for (_, j, index, _), request in zip(tagged, run.requests):
        record = to_record(request)
        record.index = index
        out[j].append(record)
    return out


def points(results: Path, profile: Path, old_profile: Path) -> tuple[list[dict], dict[str, float] | None]:
    """Every run under every model, and the serving calibration (None: the runs have no server timing)."""
    items = runs(results)
    profiles = {"current": profile, "old": old_profile}
    chained_sims = simulate_runs(cluster(profile), items, chained=True)  # the `chained` model's, once
    served = served_calibration(items, profile, chained_sims)
    found = []
    for model, (chained, which, overlap, calibrated) in MODELS.items():
        if not profiles[which].exists() or (calibrated and served is None):
            continue
        cfg = cluster(profiles[which], overlap, served if calibrated else None)
        sims = chained_sims if model == "chained" else simulate_runs(cfg, items, chained)
        for (dataset, rate, _, path), sim_records in zip(items, sims):
            real_records = read_jsonl(path)
            real, sim = metrics(real_records), metrics(sim_records)
            point = {"model": model, "dataset": dataset, "rate": rate, "requests": len(real_records),
                     "real_ok": real["num_ok"], "sim_ok": sim["num_ok"],
                     "below_saturation": float(real["ttft_p90"] or 0.0) < SLOS["tight"].ttft_s}
            point["calibration_point"] = bool(calibrated and served and f"{dataset} at {rate:g} req/s"
                                              in served["calibration_runs"].split(", "))
            point.update(served_path(real_records))
            point["sim_engine_p50"] = _p50([r.ttft_s for r in sim_records if r.ok])
            point["err_engine_p50"] = _err(point["sim_engine_p50"], point["real_engine_p50"])
            for m in METRICS:
                rv, sv = float(real[m] or 0.0), float(sim[m] or 0.0)
                point[f"real_{m}"], point[f"sim_{m}"] = rv, sv
                point[f"err_{m}"] = (sv - rv) / rv if rv else float("nan")
            found.append(point)
    return found, served


def _p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _err(sim: float, real: float) -> float:
    return (sim - real) / real if real else float("nan")


def served_path(records) -> dict[str, float]:
    """Where the real TTFT went, p50 over the records, from each one's server timing (seconds):
    `engine` = the worker's queue + prefill (its Generate call in to the first token ready: what
    the simulated TTFT is, with no front path), `legs` = the router's time to the first token
    less that and the placement (gRPC both ways, the worker's hand-off to its asyncio thread),
    `text` = the first token to the first delta with text (tokens that decode to no text yet:
    frequent with random weights), `http` = the client's TTFT less the router's time to the first
    text (HTTP both ways, tokenising, the client)."""
    timed = [(r, r.server_timing) for r in records if r.ok and r.server_timing and "prefill" in r.server_timing
             and "first_token" in r.server_timing and "first_text" in r.server_timing]
    return {
        "real_engine_p50": _p50([t["queue"] + t["prefill"] for _, t in timed]),
        "real_queue_p50": _p50([t["queue"] for _, t in timed]),
        "real_legs_p50": _p50([t["first_token"] - t["queue"] - t["prefill"] - t.get("place", 0.0) for _, t in timed]),
        "real_text_p50": _p50([t["first_text"] - t["first_token"] for _, t in timed]),
        "real_http_p50": _p50([r.ttft_s - t["first_text"] for r, t in timed]),
    }


def _rel(path: Path) -> str:
    return label(path)


def _fmt(m: str, v: float) -> str:
    return f"{v:.2f}" if m.startswith("goodput") else f"{v * 1000:.1f}"


def report(found: list[dict], profile: Path, results: Path,
           title: str = "# Simulated vs real on one H200 (experiments/sim_fidelity_one_gpu.py)",
           served: dict[str, float] | None = None) -> list[str]:
    timed = any(p["real_engine_p50"] == p["real_engine_p50"] for p in found)  # not NaN: the server timed them
    lines = [title, "",
             f"Real: `{_rel(results)}/{CONFIG}/` (one mixed worker). Profile: "
             f"`{_rel(profile)}`. Error = (sim - real) / real; TTFT and TPOT in ms, "
             "goodput in req/s (loose: TTFT <= 1 s, TPOT <= 50 ms; tight: TPOT <= 10 ms).", ""]
    if served is not None:
        lines += [f"`{CALIBRATED}` is CALIBRATED on {served['calibration_runs']} (those points are fitted, not "
                  f"predicted; the table's counts leave them out): front path {served['front_s'] * 1000:.1f} ms "
                  f"before placement (client TTFT less the worker's queue + prefill), prefill steps x "
                  f"{served['prefill_factor']:.2f} (the worker's served prefill / P(prompt)), decode steps x "
                  f"{served['decode_factor']:.2f} (real / simulated time per token).", ""]
    lines += ["| model | figures within 10% (all points) | below saturation | worst figure below saturation |",
              "|---|---|---|---|"]
    for model in MODELS:
        mine = [p for p in found if p["model"] == model and not p["calibration_point"]]
        if not mine:
            continue
        figs = [(abs(p[f"err_{m}"]), p, m) for p in mine for m in METRICS if p[f"err_{m}"] == p[f"err_{m}"]]
        below = [f for f in figs if f[1]["below_saturation"]]
        worst = max(below, key=lambda f: f[0]) if below else None
        worst_text = (f"{worst[2]}, {worst[1]['dataset']} at {worst[1]['rate']:g} req/s: "
                      f"{worst[1][f'err_{worst[2]}']:+.0%}") if worst else "-"
        lines.append(f"| `{model}` | {sum(f[0] <= WITHIN for f in figs)} of {len(figs)} | "
                     f"{sum(f[0] <= WITHIN for f in below)} of {len(below)} | {worst_text} |")
    lines += [] if not timed else ["", "## Where the real TTFT went, and the simulated engine part", "",
              "p50 over each run's records, ms, from the server's timing (`usage.pdserve_timing`): `engine` = the "
              "worker's queue + prefill (its Generate call in to the first token ready), which is what the "
              "simulated TTFT is (no front path is simulated); `legs` = the router's time to the first token less "
              "that and the placement (gRPC both ways, the worker's hand-off); `text` = first token to first text "
              "(tokens that decode to no text yet, frequent with random weights); `http` = the client's TTFT less "
              "the router's time to the first text.", "",
              "| dataset | rate | client TTFT | engine (queue) | legs | text | http | sim `chained` | sim vs engine |",
              "|---|---|---|---|---|---|---|---|---|"]
    for p in [p for p in found if p["model"] == "chained"] if timed else []:
        lines.append(f"| {p['dataset']} | {p['rate']:g} | {p['real_ttft_p50'] * 1000:.1f} | "
                     f"{p['real_engine_p50'] * 1000:.1f} ({p['real_queue_p50'] * 1000:.1f}) | "
                     f"{p['real_legs_p50'] * 1000:.1f} | {p['real_text_p50'] * 1000:.1f} | "
                     f"{p['real_http_p50'] * 1000:.1f} | {p['sim_engine_p50'] * 1000:.1f} | "
                     f"{p['err_engine_p50']:+.0%} |")
    for model in MODELS:
        mine = [p for p in found if p["model"] == model]
        if not mine:
            continue
        lines += ["", f"## `{model}`", "",
                  "| dataset | rate | below sat. | " + " | ".join(f"{m} real / sim (err)" for m in METRICS) + " |",
                  "|---|---|---|" + "---|" * len(METRICS)]
        for p in mine:
            cells = [f"{_fmt(m, p[f'real_{m}'])} / {_fmt(m, p[f'sim_{m}'])} ({p[f'err_{m}']:+.0%})" for m in METRICS]
            lines.append(f"| {p['dataset']} | {p['rate']:g} | {'yes' if p['below_saturation'] else 'no'} | "
                         + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Simulated vs real on one H200 (module docstring).")
    parser.add_argument("--results", type=Path, default=None,
                        help=f"the runs' results folder (default: results/{RESULTS}, else its archive in docs/records)")
    parser.add_argument("--out", type=Path, default=OUT, help=f"where one_gpu.md / .csv go (default {OUT})")
    parser.add_argument("--bare", type=Path, default=None,
                        help="also set the simulator against the bare engine's records of the same workloads "
                             "(benchmarks/bench_engine_replay.py --records DIR/single; profile DIR/profile.json) "
                             f"(default: results/{BARE}, else its archive in docs/records, when it has them)")
    args = parser.parse_args(argv)
    if args.results is None:
        args.results = records_dir(RESULTS)
    if args.bare is None:
        try:
            bare = records_dir(BARE)
        except FileNotFoundError:
            bare = None
        args.bare = bare if bare is not None and (bare / CONFIG / "summary.csv").exists() else None
    profile = args.results / "profile.json"
    if not runs(args.results) or not profile.exists():
        print(f"sim_fidelity_one_gpu: no runs or no profile.json under {args.results} "
              "(experiments/two-gpu/run.sh profile single, with RESULTS set to it)", file=sys.stderr)
        return 2
    found, served = points(args.results, profile, OLD_PROFILE)
    args.out.mkdir(parents=True, exist_ok=True)
    write_summary_csv(args.out / "one_gpu.csv", found)
    lines = report(found, profile, args.results, served=served)
    if args.bare is not None:
        bare_profile = args.bare / "profile.json"
        if not runs(args.bare) or not bare_profile.exists():
            print(f"sim_fidelity_one_gpu: --bare {args.bare}: needs single/summary.csv and profile.json",
                  file=sys.stderr)
            return 2
        bare, _ = points(args.bare, bare_profile, OLD_PROFILE)
        write_summary_csv(args.out / "one_gpu_bare.csv", bare)
        lines += [""] + report(bare, bare_profile, args.bare, title="# Simulated vs the bare engine (the same "
                               "workloads in-process: no HTTP, router, gRPC or streaming)")
    (args.out / "one_gpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
