"""Experiment specs: YAML in (through yamlconfig, schema `SpecFile`), frozen dataclasses out,
errors as `file:line: field 'x': ...`; unknown keys are rejected. \
Input paths (traces, ShareGPT files) are relative to the spec file; the
output directory is relative to the current directory. Schema (defaults after `=`):

    name: str = file stem
    output_dir: str = results/<name>
    seed: int = 0                 # a server's k-th run uses seed + k (no prompt repeats across its runs)
    server:                       # exactly one of url / launch
      url: http://host:port       # a running server: only rate and dataset axes may vary
      launch:
        command: "... {policy} {bandwidth_gbps} {prefill} {decode} {port} {host} {model} ..."
        vars: {model: ...}        # extra placeholders
        host: 127.0.0.1
        port: int = a free port
        health_path: /health
        startup_timeout_s: 300
        shutdown_timeout_s: 20
        env: {NAME: value}
        cwd: str = spec directory
      model: str = first of /v1/models
      endpoint: chat | completions = chat
      api_key_env: NAME of the environment variable holding the API key
      link_method: str            # how the link rate is held (tc, pacing, ...), for the report
      scrape_metrics: true
    grid:
      rate: [req/s, ...]          # required; or {bandwidth: [req/s, ...], ...}: rates per link
                                  # rate, one key per grid.bandwidth_gbps value
      policy: [name, ...]
      bandwidth_gbps: [number, ...]
      cluster: ["2P2D" | {prefill: 2, decode: 2}, ...]
      dataset: [dataset, ...]     # each with a name; else workload.dataset
    workload:
      arrival: poisson | gamma | constant | trace = poisson
      burstiness: 1.0
      trace: {path, format, speedup}
      num_requests: int
      duration_s: number
      concurrency: int
      request_timeout_s: 600
      max_run_time_s: number
      ignore_eos: false
      temperature: 0.0
      pause_s: 0                  # idle time between runs on one server
      dataset: {name, kind, input, output, path, num_groups, prefix_tokens, tokenizer}
    slo: {ttft_s: number, tpot_s: number}

A length distribution (`input`, `output`) is a string like "lognormal:512:0.5:4096" or a
mapping {kind, value | low, high | mean, std | mean, sigma, max}.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import model_validator

from pdserve.loadgen import yamlconfig
from pdserve.loadgen.arrivals import ARRIVAL_KINDS, TRACE_FORMATS
from pdserve.loadgen.client import ENDPOINTS
from pdserve.loadgen.datasets import DATASET_KINDS, DatasetConfig, LengthDist
from pdserve.loadgen.errors import SpecError
from pdserve.loadgen.metrics import SLO

LAUNCH_PLACEHOLDERS = ("policy", "bandwidth_gbps", "prefill", "decode", "cluster", "port", "host")


@dataclass(frozen=True)
class ClusterShape:
    prefill: int
    decode: int

    @property
    def label(self) -> str:
        return f"{self.prefill}P{self.decode}D"


@dataclass(frozen=True)
class LaunchSpec:
    command: str
    vars: dict = field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int | None = None
    health_path: str = "/health"
    startup_timeout_s: float = 300.0
    shutdown_timeout_s: float = 20.0
    env: dict = field(default_factory=dict)
    cwd: str | None = None


@dataclass(frozen=True)
class ServerSpec:
    url: str | None = None
    launch: LaunchSpec | None = None
    model: str | None = None
    endpoint: str = "chat"
    api_key_env: str | None = None
    link_method: str | None = None
    scrape_metrics: bool = True


@dataclass(frozen=True)
class WorkloadSpec:
    arrival: str = "poisson"
    burstiness: float = 1.0
    trace_path: str | None = None
    trace_format: str | None = None
    trace_speedup: float = 1.0
    num_requests: int | None = None
    duration_s: float | None = None
    concurrency: int | None = None
    request_timeout_s: float = 600.0
    max_run_time_s: float | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    pause_s: float = 0.0


@dataclass(frozen=True)
class ExperimentSpec:
    name: str
    path: str
    output_dir: str
    seed: int
    server: ServerSpec
    workload: WorkloadSpec
    rates: tuple[float, ...]
    policies: tuple[str | None, ...] = (None,)
    bandwidths: tuple[float | None, ...] = (None,)
    clusters: tuple[ClusterShape | None, ...] = (None,)
    datasets: tuple[DatasetConfig, ...] = (DatasetConfig(),)
    slo: SLO | None = None
    rates_by_bandwidth: dict | None = None  # bandwidth -> tuple of rates, when the grid gives them so

    def rates_for(self, bandwidth: float | None) -> tuple[float, ...]:
        """The rates to run at link rate `bandwidth` (all of `rates` unless given per bandwidth)."""
        if self.rates_by_bandwidth is None:
            return self.rates
        return self.rates_by_bandwidth[bandwidth]


# --------------------------------------------------------------------------------------
# The file's schema (read through yamlconfig); `load_spec` adds the checks across fields.

_Positive = yamlconfig.number(gt=0)
_NonNegative = yamlconfig.number(ge=0)
_Text = yamlconfig.text
_LENGTH_FIELDS = {"fixed": ("value",), "uniform": ("low", "high"), "normal": ("mean", "std"),
                  "lognormal": ("mean", "sigma")}


class _Spec(yamlconfig.Schema):
    """A mapping of the spec: a key given as null takes its default."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class _Length(_Spec):
    kind: Literal["fixed", "uniform", "normal", "lognormal"]
    value: yamlconfig.whole(ge=1) | None = None
    low: yamlconfig.whole(ge=1) | None = None
    high: yamlconfig.whole(ge=1) | None = None
    mean: _NonNegative | None = None
    std: _NonNegative | None = None
    sigma: _NonNegative | None = None
    max: yamlconfig.whole(ge=1) | None = None

    @model_validator(mode="after")
    def _fields_of_kind(self) -> "_Length":
        wanted = _LENGTH_FIELDS[self.kind]
        for name in wanted:
            if getattr(self, name) is None:
                raise ValueError(f"{name}: required for kind {self.kind}")
        for name in ("value", "low", "high", "mean", "std", "sigma"):
            if name not in wanted and getattr(self, name) is not None:
                raise ValueError(f"{name}: unknown key for kind {self.kind}; expected one of: "
                                 f"kind, {', '.join(wanted)}, max")
        return self


_LengthEntry = yamlconfig.either(yamlconfig.text, _Length)


class _Dataset(_Spec):
    name: _Text | None = None
    kind: Literal[DATASET_KINDS] = "synthetic"  # type: ignore[valid-type]
    input: _LengthEntry | None = None
    output: _LengthEntry | None = None
    path: _Text | None = None
    num_groups: yamlconfig.whole(ge=1) | None = None
    prefix_tokens: yamlconfig.whole(ge=1) | None = None
    tokenizer: _Text | None = None

    @model_validator(mode="after")
    def _fields_of_kind(self) -> "_Dataset":
        if self.kind == "sharegpt" and self.path is None:
            raise ValueError("path: required for kind sharegpt")
        for name, kind in (("path", "sharegpt"), ("num_groups", "shared-prefix"), ("prefix_tokens", "shared-prefix")):
            if getattr(self, name) is not None and self.kind != kind:
                raise ValueError(f"{name}: only for kind {kind}")
        return self


class _Trace(_Spec):
    path: _Text
    format: Literal[TRACE_FORMATS] | None = None  # type: ignore[valid-type]
    speedup: _Positive = 1.0


class _Workload(_Spec):
    arrival: Literal[ARRIVAL_KINDS + ("trace",)] = "poisson"  # type: ignore[valid-type]
    burstiness: _Positive = 1.0
    trace: _Trace | None = None
    num_requests: yamlconfig.whole(ge=1) | None = None
    duration_s: _Positive | None = None
    concurrency: yamlconfig.whole(ge=1) | None = None
    request_timeout_s: _Positive = 600.0
    max_run_time_s: _Positive | None = None
    ignore_eos: yamlconfig.Bool = False
    temperature: _NonNegative = 0.0
    pause_s: _NonNegative = 0.0
    dataset: _Dataset | None = None


class _Shape(_Spec):
    prefill: yamlconfig.whole(ge=1)
    decode: yamlconfig.whole(ge=1)


_Rates = yamlconfig.listed(_Positive)


class _Grid(_Spec):
    rate: yamlconfig.either(_Rates, dict[Any, _Rates])
    policy: yamlconfig.listed(_Text) | None = None
    bandwidth_gbps: yamlconfig.listed(_Positive) | None = None
    cluster: yamlconfig.listed(yamlconfig.either(_Text, _Shape)) | None = None
    dataset: yamlconfig.listed(_Dataset) | None = None


class _Launch(_Spec):
    command: _Text
    vars: dict[str, _Text] = {}
    host: _Text = "127.0.0.1"
    port: yamlconfig.whole(ge=1) | None = None
    health_path: _Text = "/health"
    startup_timeout_s: _Positive = 300.0
    shutdown_timeout_s: _Positive = 20.0
    env: dict[str, _Text] = {}
    cwd: _Text = "."


class _Server(_Spec):
    url: _Text | None = None
    launch: _Launch | None = None
    model: _Text | None = None
    endpoint: Literal[tuple(ENDPOINTS)] = "chat"  # type: ignore[valid-type]
    api_key_env: _Text | None = None
    link_method: _Text | None = None
    scrape_metrics: yamlconfig.Bool = True


class _SLO(_Spec):
    ttft_s: _Positive
    tpot_s: _Positive


class SpecFile(_Spec):
    """An experiment spec (module docstring), as written."""

    name: _Text | None = None
    output_dir: _Text | None = None
    seed: yamlconfig.whole(ge=0) = 0
    server: _Server
    grid: _Grid
    workload: _Workload = _Workload()
    slo: _SLO | None = None


_SHAPE = re.compile(r"^\s*(\d+)\s*P\s*(\d+)\s*D\s*$", re.IGNORECASE)


def _length(doc: yamlconfig.Document, loc: tuple, value: str | _Length | None) -> dict:
    if value is None:
        return {}
    try:
        if isinstance(value, str):
            return {loc[-1]: LengthDist.parse(value)}
        return {loc[-1]: LengthDist(**value.model_dump(exclude_none=True))}
    except ValueError as e:
        raise doc.error(loc, str(e)) from None


def _dataset(doc: yamlconfig.Document, loc: tuple, d: _Dataset, base: Path, default_name: str) -> DatasetConfig:
    args = {"name": d.name or default_name, "kind": d.kind, "tokenizer": d.tokenizer,
            **_length(doc, loc + ("input",), d.input), **_length(doc, loc + ("output",), d.output)}
    if d.path is not None:
        args["path"] = str(base / d.path)
    args.update({k: getattr(d, k) for k in ("num_groups", "prefix_tokens") if getattr(d, k) is not None})
    return DatasetConfig(**args)


def _cluster(doc: yamlconfig.Document, loc: tuple, value: str | _Shape) -> ClusterShape:
    if isinstance(value, _Shape):
        return ClusterShape(value.prefill, value.decode)
    match = _SHAPE.match(value)
    if not match or int(match[1]) < 1 or int(match[2]) < 1:
        raise doc.error(loc, f"expected a shape like 2P2D, got {value!r}")
    return ClusterShape(int(match[1]), int(match[2]))


def _rates_by_bandwidth(doc: yamlconfig.Document, rate: dict, bandwidths: tuple) -> dict:
    loc = ("grid", "rate")
    if not rate:
        raise doc.error(loc, "expected a non-empty list, or a mapping of link rate to rates")
    out = {}
    for key, rates in rate.items():
        if isinstance(key, bool) or not isinstance(key, (int, float)) or not key > 0:
            raise doc.error(loc + (key,), f"keys are link rates (Gbit/s): expected a number > 0, got {key!r}",
                            at_key=True)
        out[float(key)] = rates
    if bandwidths == (None,):
        raise doc.error(loc, "rates per link rate need grid.bandwidth_gbps")
    if set(out) != set(bandwidths):
        missing = sorted(set(bandwidths) - set(out))
        extra = sorted(set(out) - set(bandwidths))
        raise doc.error(loc, "keys must be the grid.bandwidth_gbps values"
                        + (f"; missing {', '.join(f'{b:g}' for b in missing)}" if missing else "")
                        + (f"; not in grid.bandwidth_gbps: {', '.join(f'{b:g}' for b in extra)}" if extra else ""))
    return out


def _launch(doc: yamlconfig.Document, ln: _Launch, base: Path, axes: dict) -> LaunchSpec:
    loc = ("server", "launch", "command")
    clash = set(ln.vars) & set(LAUNCH_PLACEHOLDERS)
    if clash:
        raise doc.error(("server", "launch", "vars"), f"{', '.join(sorted(clash))} is set by the harness")
    try:
        used = {name for _, name, _, _ in string.Formatter().parse(ln.command) if name is not None}
    except ValueError as e:
        raise doc.error(loc, f"bad template: {e}") from None
    known = set(LAUNCH_PLACEHOLDERS) | set(ln.vars)
    for name in sorted(used - known):
        raise doc.error(loc, f"unknown placeholder {{{name}}}; known: {', '.join(sorted(known))}")
    for placeholder, values in axes.items():
        if placeholder in used and values == (None,):
            grid_key = "cluster" if placeholder in ("prefill", "decode") else placeholder
            raise doc.error(loc, f"placeholder {{{placeholder}}} needs grid.{grid_key}")
    return LaunchSpec(command=ln.command, vars=dict(ln.vars), host=ln.host, port=ln.port, health_path=ln.health_path,
                      startup_timeout_s=ln.startup_timeout_s, shutdown_timeout_s=ln.shutdown_timeout_s,
                      env=dict(ln.env), cwd=str(base / ln.cwd))


def load_spec(path: str | Path) -> ExperimentSpec:
    """Parse and validate an experiment spec; SpecError names file, line and field."""
    path = Path(path)
    doc = yamlconfig.read(path, SpecError)
    if doc.data is None:
        raise SpecError(str(path), None, None, "the spec is empty")
    spec = yamlconfig.validate(doc, SpecFile)
    base = path.resolve().parent
    name = spec.name or path.stem

    w = spec.workload
    if w.arrival == "trace" and w.trace is None:
        raise doc.error(("workload", "arrival"), "arrival: trace needs workload.trace.path")
    if w.arrival != "trace" and w.num_requests is None and w.duration_s is None:
        raise doc.error(("workload",), "give num_requests or duration_s", at_key=True)
    trace = ({"trace_path": str(base / w.trace.path), "trace_format": w.trace.format, "trace_speedup": w.trace.speedup}
             if w.trace is not None else {})
    workload = WorkloadSpec(arrival=w.arrival, burstiness=w.burstiness, num_requests=w.num_requests,
                            duration_s=w.duration_s, concurrency=w.concurrency, request_timeout_s=w.request_timeout_s,
                            max_run_time_s=w.max_run_time_s, ignore_eos=w.ignore_eos, temperature=w.temperature,
                            pause_s=w.pause_s, **trace)

    g = spec.grid
    policies = g.policy or (None,)
    bandwidths = g.bandwidth_gbps or (None,)
    clusters = (tuple(_cluster(doc, ("grid", "cluster", i), c) for i, c in enumerate(g.cluster))
                if g.cluster else (None,))
    if g.dataset:
        datasets = tuple(_dataset(doc, ("grid", "dataset", i), d, base, f"dataset{i}") for i, d in enumerate(g.dataset))
        if len({d.name for d in datasets}) != len(datasets):
            raise doc.error(("grid", "dataset"), "dataset names must be distinct")
    else:
        datasets = (_dataset(doc, ("workload", "dataset"), w.dataset, base, "default") if w.dataset
                    else DatasetConfig(),)
    rates_by_bandwidth = None
    if isinstance(g.rate, dict):
        rates_by_bandwidth = _rates_by_bandwidth(doc, g.rate, bandwidths)
        rates = tuple(sorted({r for rs in rates_by_bandwidth.values() for r in rs}))
    else:
        rates = g.rate

    s = spec.server
    if (s.url is None) == (s.launch is None):
        raise doc.error(("server",), "give exactly one of server.url and server.launch")
    launch = None
    if s.launch is not None:
        axes = {"policy": policies, "bandwidth_gbps": bandwidths, "prefill": clusters, "decode": clusters,
                "cluster": clusters}
        launch = _launch(doc, s.launch, base, axes)
    else:
        for key, values in (("policy", policies), ("bandwidth_gbps", bandwidths), ("cluster", clusters)):
            if len(values) > 1:
                raise doc.error(("grid", key), "a fixed server.url cannot vary this axis; use server.launch")
    server = ServerSpec(url=s.url, launch=launch, model=s.model, endpoint=s.endpoint, api_key_env=s.api_key_env,
                        link_method=s.link_method, scrape_metrics=s.scrape_metrics)
    slo = SLO(spec.slo.ttft_s, spec.slo.tpot_s) if spec.slo is not None else None
    return ExperimentSpec(
        name=name, path=str(path), output_dir=spec.output_dir or str(Path("results") / name), seed=spec.seed,
        server=server, workload=workload, rates=rates, policies=policies, bandwidths=bandwidths, clusters=clusters,
        datasets=datasets, slo=slo, rates_by_bandwidth=rates_by_bandwidth,
    )
