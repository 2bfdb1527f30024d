"""The experiment harness: a grid of server configurations x workloads, one output dir.

Lifecycle of `run_experiment(spec)`:
1. Write `spec.yaml` (a copy) and `environment.json` under the output dir.
2. For each server configuration (cluster shape x policy x link bandwidth): with
   `server.launch`, start the command in its own process group, wait for its health check;
   with `server.url`, use the running server.
3. On that server, for each dataset x rate: one load run; its records stream to
   `runs/<run_id>.jsonl`, and `summary.csv` is rewritten after every run.
4. Stop the server (SIGTERM, then SIGKILL), always: on success, failure and Ctrl-C.
5. Draw the plots and write `report.md` from whatever runs completed (with a table of where
   TTFT went when the server timed its requests: `usage.pdserve_timing`).

A server that fails to start marks its runs failed and the sweep goes on. Ctrl-C stops the
sweep; results so far are kept and `interrupted` is returned.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdserve import environment
from pdserve.loadgen.client import ClientConfig
from pdserve.loadgen.errors import LoadgenError
from pdserve.loadgen.launcher import LaunchError, ServerProcess, free_port
from pdserve.loadgen.report import PlottingUnavailable, make_plots, write_environment, write_report
from pdserve.loadgen.runner import LoadConfig, RunInterrupted, run_load, write_summary_csv
from pdserve.loadgen.spec import ClusterShape, ExperimentSpec

log = logging.getLogger(__name__)


@dataclass
class ExperimentResult:
    output_dir: Path
    rows: list[dict] = field(default_factory=list)
    plots: list[Path] = field(default_factory=list)
    interrupted: bool = False


def _labels(cluster: ClusterShape | None, policy, bandwidth, dataset: str, rate: float) -> dict:
    return {
        "cluster": cluster.label if cluster else None,
        "prefill": cluster.prefill if cluster else None,
        "decode": cluster.decode if cluster else None,
        "policy": policy,
        "bandwidth_gbps": bandwidth,
        "dataset": dataset,
        "rate": rate,
    }


def server_tag(cluster: ClusterShape | None, policy, bandwidth) -> str:
    parts = [cluster.label if cluster else None, policy, f"{bandwidth:g}gbps" if bandwidth is not None else None]
    return "_".join(str(p).replace("/", "-").replace(" ", "-") for p in parts if p is not None) or "server"


def run_id(labels: dict) -> str:
    cluster = ClusterShape(labels["prefill"], labels["decode"]) if labels["cluster"] else None
    tag = server_tag(cluster, labels["policy"], labels["bandwidth_gbps"])
    return f"{tag}_{labels['dataset']}_rate{labels['rate']:g}".replace("/", "-").replace(" ", "-")


def only_policies(spec: ExperimentSpec, names: list[str] | None) -> ExperimentSpec:
    """`spec` with grid.policy cut to `names` (in the spec's order); ValueError naming the first name
    the spec does not have. None or [] keeps every policy."""
    if not names:
        return spec
    unknown = [p for p in names if p not in spec.policies]
    if unknown:
        known = ", ".join(str(p) for p in spec.policies)
        raise ValueError(f"{unknown[0]!r} is not in the spec's grid.policy ({known})")
    return dataclasses.replace(spec, policies=tuple(p for p in spec.policies if p in names))


def run_ids(spec: ExperimentSpec) -> list[str]:
    """The ids of the runs `spec` makes, in the order they run (what --dry-run lists)."""
    return [run_id(_labels(cluster, policy, bandwidth, dataset.name, rate))
            for cluster in spec.clusters for policy in spec.policies for bandwidth in spec.bandwidths
            for dataset in spec.datasets for rate in spec.rates_for(bandwidth)]


def _load_config(spec: ExperimentSpec, url: str, dataset, rate: float, seed: int | None = None) -> LoadConfig:
    w = spec.workload
    api_key = environment.lookup(spec.server.api_key_env) if spec.server.api_key_env else None
    client = ClientConfig(
        base_url=url, endpoint=spec.server.endpoint, model=spec.server.model, api_key=api_key,
        request_timeout_s=w.request_timeout_s, ignore_eos=w.ignore_eos, temperature=w.temperature,
    )
    return LoadConfig(
        client=client, rate=rate, arrival=w.arrival, burstiness=w.burstiness,
        num_requests=w.num_requests, duration_s=w.duration_s, seed=spec.seed if seed is None else seed,
        dataset=dataset,
        trace_path=w.trace_path, trace_format=w.trace_format, trace_speedup=w.trace_speedup,
        concurrency=w.concurrency, max_run_time_s=w.max_run_time_s, slo=spec.slo,
        scrape_metrics=spec.server.scrape_metrics,
    )


@contextlib.contextmanager
def _server(spec: ExperimentSpec, cluster, policy, bandwidth, log_dir: Path, tag: str):
    """Yield the base URL of the server for one configuration."""
    if spec.server.url:
        yield spec.server.url
        return
    launch = spec.server.launch
    port = launch.port or free_port(launch.host)
    values = dict(launch.vars) | {
        "policy": policy or "",
        "bandwidth_gbps": f"{bandwidth:g}" if bandwidth is not None else "",
        "prefill": cluster.prefill if cluster else "",
        "decode": cluster.decode if cluster else "",
        "cluster": cluster.label if cluster else "",
        "port": port,
        "host": launch.host,
    }
    url = f"http://{launch.host}:{port}"
    process = ServerProcess(
        launch.command.format(**values), health_url=url + launch.health_path,
        log_path=log_dir / f"{tag}.log", env=launch.env, cwd=launch.cwd,
        startup_timeout_s=launch.startup_timeout_s, shutdown_timeout_s=launch.shutdown_timeout_s,
    )
    with process:
        yield url


def _finish(spec: ExperimentSpec, result: ExperimentResult, environment: dict) -> None:
    out = result.output_dir
    write_summary_csv(out / "summary.csv", result.rows)
    notes = [f"spec: `{Path(spec.path).name}`; {len(result.rows)} runs"
             + (" (interrupted: the sweep was stopped early)" if result.interrupted else "")]
    if spec.slo:
        notes.append(f"SLO: TTFT <= {spec.slo.ttft_s * 1000:g} ms, TPOT <= {spec.slo.tpot_s * 1000:g} ms; "
                     "attainment counts failed requests as misses; goodput = requests meeting the SLO per second")
    notes.append(f"link held by: {spec.server.link_method or 'not stated in the spec'}; "
                 "KV Gbit/s is what the server's metrics report, when it exports them")
    w = spec.workload
    notes.append(f"workload: {w.arrival} arrivals"
                 + (f" (burstiness {w.burstiness:g})" if w.arrival == "gamma" else "")
                 + (f", {w.num_requests} requests" if w.num_requests else "")
                 + (f", {w.duration_s:g} s" if w.duration_s else ""))
    try:
        result.plots = make_plots(result.rows, out)
    except PlottingUnavailable as e:
        log.warning("%s", e)
        notes.append(f"plots skipped: {e}")
    except Exception as e:  # noqa: BLE001 - a plotting bug must not lose the results
        log.exception("plotting failed")
        notes.append(f"plots failed: {type(e).__name__}: {e}")
    write_report(out / "report.md", name=spec.name, rows=result.rows, environment=environment,
                 plots=result.plots, notes=notes)


def run_experiment(spec: ExperimentSpec, *, output_dir: str | Path | None = None,
                   progress: bool | None = None) -> ExperimentResult:
    out = Path(output_dir or spec.output_dir)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    result = ExperimentResult(output_dir=out)
    shutil.copyfile(spec.path, out / "spec.yaml")
    environment = write_environment(out / "environment.json")
    # bandwidth before policy: a sweep stopped early (Ctrl-C, a deadline) has every policy at the
    # bandwidths it reached, so what it kept still compares the policies
    configs = list(itertools.product(spec.clusters, spec.bandwidths, spec.policies))
    try:
        for cluster, bandwidth, policy in configs:
            tag = server_tag(cluster, policy, bandwidth)
            loads = [(d, r) for d in spec.datasets for r in spec.rates_for(bandwidth)]
            try:
                with _server(spec, cluster, policy, bandwidth, out / "server-logs", tag) as url:
                    for k, (dataset, rate) in enumerate(loads):
                        labels = _labels(cluster, policy, bandwidth, dataset.name, rate)
                        # each run on one server draws its own prompts and arrivals (seed + its place
                        # among the server's runs): a later run must not find an earlier run's
                        # prompts in the prefix cache; the same point on every server draws the same
                        result.rows.append(_one_run(spec, url, dataset, rate, labels, out, progress,
                                                    seed=spec.seed + k))
                        write_summary_csv(out / "summary.csv", result.rows)
                        if spec.workload.pause_s and k + 1 < len(loads):
                            time.sleep(spec.workload.pause_s)
            except LaunchError as e:
                log.error("%s: %s", tag, e)
                for dataset, rate in loads:
                    labels = _labels(cluster, policy, bandwidth, dataset.name, rate)
                    if not any(r["run_id"] == run_id(labels) for r in result.rows):
                        result.rows.append({"run_id": run_id(labels)} | labels
                                           | {"num_requests": 0, "interrupted": False, "error": str(e)})
    except KeyboardInterrupt as e:
        if isinstance(e, _Stop):
            result.rows.append(e.row)
        log.warning("interrupted: keeping %d runs", len(result.rows))
        result.interrupted = True
    finally:
        _finish(spec, result, environment)
    return result


def _one_run(spec, url, dataset, rate, labels, out: Path, progress, seed: int | None = None) -> dict:
    rid = run_id(labels)
    records_file = Path("runs") / f"{rid}.jsonl"
    row = {"run_id": rid} | labels | {"records_file": records_file.as_posix()}
    log.info("run %s against %s", rid, url)
    with open(out / records_file, "w") as sink:
        def write(record):
            sink.write(record.to_json() + "\n")
            sink.flush()

        try:
            run = run_load(_load_config(spec, url, dataset, rate, seed), on_record=write, progress=progress)
        except RunInterrupted as e:
            row |= e.result.summary | {"interrupted": True, "error": None}
            # Keep the partial run in the summary, then stop the sweep.
            raise _Stop(row) from None
        except LoadgenError as e:
            log.error("run %s failed: %s", rid, e)
            return row | {"num_requests": 0, "interrupted": False, "error": str(e)}
    return row | {"model": run.model} | run.summary | {"interrupted": False, "error": None}


class _Stop(KeyboardInterrupt):
    def __init__(self, row: dict):
        super().__init__("interrupted")
        self.row = row
