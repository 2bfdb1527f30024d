"""A loadgen experiment spec, simulated: the real runner's outputs without a server.

Lifecycle of `run_sim_experiment(spec, cluster)` (mirrors `pdserve.loadgen.experiment`):
1. `spec.yaml` (a copy), `cluster.yaml` (a copy of the cluster file) and `environment.json`
   (with `"simulated": true`) under the output dir.
2. For each cluster shape x policy x link bandwidth x dataset x rate: one simulated run; its
   records go to `runs/<run_id>.jsonl` (the real runner's run ids), one row to `summary.csv`.
   A spec's `grid.cluster` replaces the cluster file's workers (`ClusterConfig.with_shape`);
   `grid.bandwidth_gbps` sets every link of the topology to that rate.
3. `plots/` and `report.md` by loadgen's own `make_plots` and `write_report`.

With `replay_dir` (a real run's output dir), each run replays that run's records of the same
run id (send times, server-counted prompt tokens, max_tokens) instead of drawing the workload.
The run is bounded by the spec's `max_run_time_s` and each request by `request_timeout_s`,
as the real client bounds them.
"""

from __future__ import annotations

import itertools
import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Callable

from pdserve.loadgen.experiment import _labels, run_id, server_tag
from pdserve.loadgen.metrics import summarize
from pdserve.loadgen.report import PlottingUnavailable, make_plots, write_environment, write_report
from pdserve.loadgen.runner import write_summary_csv
from pdserve.loadgen.spec import ExperimentSpec
from pdserve.router.placement.topology import Link
from pdserve.sim.config import ClusterConfig
from pdserve.sim.run import simulate, to_record
from pdserve.sim.workload import replay_arrivals, spec_arrivals

log = logging.getLogger(__name__)


def _shown(path: str | Path) -> str:
    """`path` relative to the current directory when it lies under it (no machine paths in reports)."""
    resolved = Path(path).resolve()
    try:
        return resolved.relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return resolved.name


def with_bandwidth(config: ClusterConfig, gbps: float | None) -> ClusterConfig:
    """Every link of the topology, and the defaults for unlisted node pairs, at `gbps`."""
    if gbps is None:
        return config
    topo = config.topology
    links = tuple(Link(link.src, link.dst, gbps, link.latency_ms) for link in topo.links)
    return replace(config, topology=replace(topo, links=links, remote_gbps=gbps))


def run_sim_experiment(spec: ExperimentSpec, cluster: ClusterConfig, *, cluster_path: str | None = None,
                       output_dir: str | Path | None = None, replay_dir: str | Path | None = None,
                       per_run: Callable[[str, ClusterConfig], ClusterConfig] | None = None) -> list[dict]:
    """`per_run(run_id, config)`, when given, adjusts each run's cluster (e.g. a profile measured
    for that run: sim.calibrate)."""
    out = Path(output_dir or spec.output_dir)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(spec.path, out / "spec.yaml")
    if cluster_path:
        shutil.copyfile(cluster_path, out / "cluster.yaml")
    environment = write_environment(out / "environment.json")
    environment["simulated"] = True
    (out / "environment.json").write_text(json.dumps(environment, indent=2) + "\n")
    w = spec.workload
    rows: list[dict] = []
    for shape, policy, bandwidth in itertools.product(spec.clusters, spec.policies, spec.bandwidths):
        config = cluster.with_shape(shape.prefill, shape.decode) if shape else cluster
        config = with_bandwidth(config, bandwidth)
        name = policy or "round-robin"
        k = -1  # the server's k-th run draws with seed + k, as loadgen.experiment does
        for dataset in spec.datasets:
            for rate in spec.rates_for(bandwidth):
                k += 1
                labels = _labels(shape, policy, bandwidth, dataset.name, rate)
                rid = run_id(labels)
                run_config = per_run(rid, config) if per_run is not None else config
                if replay_dir is not None:
                    arrivals = replay_arrivals(Path(replay_dir) / "runs" / f"{rid}.jsonl")
                else:
                    arrivals = spec_arrivals(
                        arrival=w.arrival, rate=rate, num_requests=w.num_requests, duration_s=w.duration_s,
                        seed=spec.seed + k, dataset=dataset, burstiness=w.burstiness, trace_path=w.trace_path,
                        trace_format=w.trace_format, trace_speedup=w.trace_speedup)
                run = simulate(run_config, name, arrivals, seed=spec.seed, max_run_time_s=w.max_run_time_s)
                records = [to_record(r) for r in run.requests]
                for record in records:
                    if record.ok and record.e2e_s > w.request_timeout_s:
                        record.error, record.e2e_s = f"timed out after {w.request_timeout_s:g} s", None
                records_file = Path("runs") / f"{rid}.jsonl"
                with open(out / records_file, "w") as f:
                    for record in records:
                        f.write(record.to_json() + "\n")
                ends = [r.sent_s + r.e2e_s for r in records if r.ok]
                duration = max(ends, default=0.0)
                if w.max_run_time_s is not None and any(r.error == "cancelled" for r in records):
                    duration = w.max_run_time_s
                summary = summarize(records, duration_s=duration, slo=spec.slo)
                if run.kv_seconds > 0:
                    summary["kv_transfer_bytes"] = run.kv_bytes
                    summary["kv_transfer_gbps"] = run.kv_bytes * 8 / run.kv_seconds / 1e9
                row = ({"run_id": rid} | labels | {"records_file": records_file.as_posix(),
                                                   "model": run_config.profile.model}
                       | summary | {"interrupted": False, "error": None, "simulated": True,
                                    "sim_events": run.num_events, "sim_wall_s": round(run.wall_s, 3),
                                    "sim_preemptions": run.num_preemptions,
                                    "sim_placements": json.dumps(run.decisions, sort_keys=True)})
                rows.append(row)
                write_summary_csv(out / "summary.csv", rows)
                log.info("simulated %s (%s): %d requests, %d events", rid, server_tag(shape, policy, bandwidth),
                         len(records), run.num_events)
    notes = [f"**simulated** by pdserve-sim (no server ran); spec: `{Path(spec.path).name}`; {len(rows)} runs",
             f"cluster file: `{Path(cluster_path).name if cluster_path else 'given in code'}`; profile: "
             f"{cluster.profile.model} on {cluster.profile.hardware} ({cluster.profile.created or 'undated'})",
             ("workload: replayed from the records of the real run in "
              f"`{_shown(replay_dir)}` (send times, server-counted prompt tokens)") if replay_dir else
             "workload: drawn from the spec with its seed; prompt lengths are loadgen's estimates"]
    if spec.slo:
        notes.append(f"SLO: TTFT <= {spec.slo.ttft_s * 1000:g} ms, TPOT <= {spec.slo.tpot_s * 1000:g} ms; "
                     "goodput = requests meeting the SLO per second")
    plots = []
    try:
        plots = make_plots(rows, out)
    except PlottingUnavailable as e:
        notes.append(f"plots skipped: {e}")
    write_report(out / "report.md", name=f"{spec.name} (simulated)", rows=rows, environment=environment,
                 plots=plots, notes=notes)
    return rows
