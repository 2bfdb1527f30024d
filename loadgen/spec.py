"""Experiment specs: YAML in, frozen dataclasses out, errors as `file:line: field 'x': ...`.

The YAML is composed into nodes first so that every value and key keeps its line; unknown
keys are rejected. Input paths (traces, ShareGPT files) are relative to the spec file; the
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
from typing import Any, Callable

import yaml

from loadgen.arrivals import ARRIVAL_KINDS, TRACE_FORMATS
from loadgen.client import ENDPOINTS
from loadgen.datasets import DATASET_KINDS, DatasetConfig, LengthDist
from loadgen.errors import SpecError
from loadgen.metrics import SLO

LAUNCH_PLACEHOLDERS = ("policy", "bandwidth_gbps", "prefill", "decode", "cluster", "port", "host")
_MISSING = object()


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
# YAML with positions


class _Doc:
    """Parsed YAML plus the line of every key and value, addressed by path tuples."""

    def __init__(self, path: str, text: str):
        self.path = path
        self.value_lines: dict[tuple, int] = {}
        self.key_lines: dict[tuple, int] = {}
        loader = yaml.SafeLoader(text)
        try:
            node = loader.get_single_node()
            self.data = loader.construct_document(node) if node is not None else None
        except yaml.MarkedYAMLError as e:
            mark = e.problem_mark or e.context_mark
            line = mark.line + 1 if mark else None
            raise SpecError(path, line, None, f"invalid YAML: {e.problem or e.context}") from None
        except yaml.YAMLError as e:
            raise SpecError(path, None, None, f"invalid YAML: {e}") from None
        finally:
            loader.dispose()
        if node is not None:
            self._walk(node, ())

    def _walk(self, node: yaml.Node, path: tuple) -> None:
        self.value_lines[path] = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                sub = path + (key_node.value,)
                self.key_lines[sub] = key_node.start_mark.line + 1
                self._walk(value_node, sub)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._walk(item, path + (i,))

    def error(self, path: tuple, message: str, at_key: bool = False) -> SpecError:
        lines = self.key_lines if at_key else self.value_lines
        line = lines.get(path) or self.key_lines.get(path)
        probe = path
        while line is None and probe:
            probe = probe[:-1]
            line = self.value_lines.get(probe)
        return SpecError(self.path, line, _dotted(path) or None, message)


def _dotted(path: tuple) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


class _Map:
    """Typed access to one mapping of the spec; `done()` rejects keys never asked for."""

    def __init__(self, doc: _Doc, path: tuple, value: Any):
        if not isinstance(value, dict):
            raise doc.error(path, f"expected a mapping, got {_kind(value)}")
        self.doc, self.path, self.value, self.seen = doc, path, value, set()

    def get(self, key: str, convert: Callable[[Any], Any], default: Any = _MISSING) -> Any:
        self.seen.add(key)
        if key not in self.value or self.value[key] is None:
            if default is _MISSING:
                raise self.doc.error(self.path + (key,), "required", at_key=True)
            return default
        try:
            return convert(self.value[key])
        except ValueError as e:
            raise self.doc.error(self.path + (key,), str(e)) from None

    def sub(self, key: str) -> "_Map | None":
        self.seen.add(key)
        if self.value.get(key) is None:
            return None
        return _Map(self.doc, self.path + (key,), self.value[key])

    def has(self, key: str) -> bool:
        return self.value.get(key) is not None

    def done(self) -> None:
        for key in self.value:
            if key not in self.seen:
                expected = ", ".join(sorted(self.seen))
                raise self.doc.error(self.path + (key,), f"unknown key; expected one of: {expected}", at_key=True)


def _kind(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean"}.get(type(value), type(value).__name__)


def _str(value):
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise ValueError(f"expected a string, got {_kind(value)}")
    return str(value)


def _bool(value):
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


def _int(minimum: int):
    def convert(value):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected a whole number, got {value!r}")
        if value < minimum:
            raise ValueError(f"must be >= {minimum}, got {value}")
        return value
    return convert


def _number(minimum: float = 0.0, strict: bool = True):
    def convert(value):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"expected a number, got {value!r}")
        if value < minimum or (strict and value == minimum):
            raise ValueError(f"must be {'>' if strict else '>='} {minimum:g}, got {value!r}")
        return float(value)
    return convert


def _choice(options):
    def convert(value):
        if value not in options:
            raise ValueError(f"expected one of {', '.join(options)}, got {value!r}")
        return value
    return convert


def _str_map(value):
    if not isinstance(value, dict):
        raise ValueError(f"expected a mapping, got {_kind(value)}")
    return {str(k): _str(v) for k, v in value.items()}


def _list(doc: _Doc, path: tuple, value: Any, convert: Callable[[tuple, Any], Any]) -> tuple:
    if not isinstance(value, list):
        value = [value]
    if not value:
        raise doc.error(path, "expected a non-empty list")
    out = []
    for i, item in enumerate(value):
        try:
            out.append(convert(path + (i,), item))
        except ValueError as e:
            raise doc.error(path + (i,), str(e)) from None
    if len(set(map(repr, out))) != len(out):
        raise doc.error(path, "values must be distinct")
    return tuple(out)


_SHAPE = re.compile(r"^\s*(\d+)\s*P\s*(\d+)\s*D\s*$", re.IGNORECASE)


def _cluster(doc: _Doc, path: tuple, value: Any) -> ClusterShape:
    if isinstance(value, str):
        match = _SHAPE.match(value)
        if not match or int(match[1]) < 1 or int(match[2]) < 1:
            raise ValueError(f"expected a shape like 2P2D, got {value!r}")
        return ClusterShape(int(match[1]), int(match[2]))
    m = _Map(doc, path, value)
    shape = ClusterShape(m.get("prefill", _int(1)), m.get("decode", _int(1)))
    m.done()
    return shape


def _length_dist(doc: _Doc, path: tuple, value: Any) -> LengthDist:
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        try:
            return LengthDist.parse(str(value))
        except ValueError as e:
            raise doc.error(path, str(e)) from None
    m = _Map(doc, path, value)
    kind = m.get("kind", _choice(("fixed", "uniform", "normal", "lognormal")))
    args: dict = {"kind": kind}
    fields_of = {"fixed": ("value",), "uniform": ("low", "high"), "normal": ("mean", "std"), "lognormal": ("mean", "sigma")}
    for name in fields_of[kind]:
        args[name] = m.get(name, _int(1) if name in ("value", "low", "high") else _number(0.0, strict=False))
    if m.has("max"):
        args["max"] = m.get("max", _int(1))
    m.done()
    try:
        return LengthDist(**args)
    except ValueError as e:
        raise doc.error(path, str(e)) from None


def _dataset(doc: _Doc, path: tuple, value: Any, base: Path, default_name: str) -> DatasetConfig:
    m = _Map(doc, path, value)
    args: dict = {"name": m.get("name", _str, default_name), "kind": m.get("kind", _choice(DATASET_KINDS), "synthetic")}
    for key in ("input", "output"):
        if m.has(key):
            m.seen.add(key)
            args[key] = _length_dist(doc, path + (key,), m.value[key])
    if args["kind"] == "sharegpt":
        args["path"] = str(base / m.get("path", _str))
    if args["kind"] == "shared-prefix":
        args["num_groups"] = m.get("num_groups", _int(1), 8)
        args["prefix_tokens"] = m.get("prefix_tokens", _int(1), 512)
    args["tokenizer"] = m.get("tokenizer", _str, None)
    m.done()
    return DatasetConfig(**args)


def _check_template(doc: _Doc, path: tuple, command: str, allowed: set[str]) -> None:
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(command) if name is not None}
    except ValueError as e:
        raise doc.error(path, f"bad template: {e}") from None
    for name in names:
        if name not in allowed:
            raise doc.error(path, f"unknown placeholder {{{name}}}; known: {', '.join(sorted(allowed))}")


def load_spec(path: str | Path) -> ExperimentSpec:
    """Parse and validate an experiment spec; SpecError names file, line and field."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise SpecError(str(path), None, None, f"cannot read: {e.strerror or e}") from None
    doc = _Doc(str(path), text)
    if doc.data is None:
        raise SpecError(str(path), None, None, "the spec is empty")
    base = path.resolve().parent
    top = _Map(doc, (), doc.data)
    name = top.get("name", _str, path.stem)
    output_dir = top.get("output_dir", _str, str(Path("results") / name))
    seed = top.get("seed", _int(0), 0)

    # workload
    w = top.sub("workload") or _Map(doc, ("workload",), {})
    arrival = w.get("arrival", _choice(ARRIVAL_KINDS + ("trace",)), "poisson")
    trace_args: dict = {}
    t = w.sub("trace")
    if t is not None:
        trace_args = {
            "trace_path": str(base / t.get("path", _str)),
            "trace_format": t.get("format", _choice(TRACE_FORMATS), None),
            "trace_speedup": t.get("speedup", _number(), 1.0),
        }
        t.done()
    if arrival == "trace" and t is None:
        raise doc.error(("workload", "arrival"), "arrival: trace needs workload.trace.path")
    workload = WorkloadSpec(
        arrival=arrival,
        burstiness=w.get("burstiness", _number(), 1.0),
        num_requests=w.get("num_requests", _int(1), None),
        duration_s=w.get("duration_s", _number(), None),
        concurrency=w.get("concurrency", _int(1), None),
        request_timeout_s=w.get("request_timeout_s", _number(), 600.0),
        max_run_time_s=w.get("max_run_time_s", _number(), None),
        ignore_eos=w.get("ignore_eos", _bool, False),
        temperature=w.get("temperature", _number(0.0, strict=False), 0.0),
        pause_s=w.get("pause_s", _number(0.0, strict=False), 0.0),
        **trace_args,
    )
    if arrival != "trace" and workload.num_requests is None and workload.duration_s is None:
        raise doc.error(("workload",), "give num_requests or duration_s", at_key=True)
    w.seen.add("dataset")
    default_dataset = (
        _dataset(doc, ("workload", "dataset"), w.value["dataset"], base, "default")
        if w.has("dataset") else DatasetConfig()
    )
    w.done()

    # grid
    g = top.sub("grid")
    if g is None:
        raise doc.error(("grid",), "required", at_key=True)
    g.seen.update({"rate", "policy", "bandwidth_gbps", "cluster", "dataset"})
    if not g.has("rate"):
        raise doc.error(("grid", "rate"), "required", at_key=True)
    rates_by_bandwidth = None
    if isinstance(g.value["rate"], dict):
        rates_by_bandwidth = {}
        for key, value in g.value["rate"].items():
            try:
                bandwidth = _number()(key)
            except ValueError as e:
                raise doc.error(("grid", "rate", key), f"keys are link rates (Gbit/s): {e}", at_key=True) from None
            rates_by_bandwidth[bandwidth] = _list(doc, ("grid", "rate", key), value, lambda p, v: _number()(v))
        if not rates_by_bandwidth:
            raise doc.error(("grid", "rate"), "expected a non-empty list, or a mapping of link rate to rates")
        rates = tuple(sorted({r for rs in rates_by_bandwidth.values() for r in rs}))
    else:
        rates = _list(doc, ("grid", "rate"), g.value["rate"], lambda p, v: _number()(v))
    policies = _list(doc, ("grid", "policy"), g.value["policy"], lambda p, v: _str(v)) if g.has("policy") else (None,)
    bandwidths = (_list(doc, ("grid", "bandwidth_gbps"), g.value["bandwidth_gbps"], lambda p, v: _number()(v))
                  if g.has("bandwidth_gbps") else (None,))
    clusters = (_list(doc, ("grid", "cluster"), g.value["cluster"], lambda p, v: _cluster(doc, p, v))
                if g.has("cluster") else (None,))
    if g.has("dataset"):
        datasets = _list(doc, ("grid", "dataset"), g.value["dataset"],
                         lambda p, v: _dataset(doc, p, v, base, f"dataset{p[-1]}"))
        if len({d.name for d in datasets}) != len(datasets):
            raise doc.error(("grid", "dataset"), "dataset names must be distinct")
    else:
        datasets = (default_dataset,)
    if rates_by_bandwidth is not None:
        if bandwidths == (None,):
            raise doc.error(("grid", "rate"), "rates per link rate need grid.bandwidth_gbps")
        if set(rates_by_bandwidth) != set(bandwidths):
            missing = sorted(set(bandwidths) - set(rates_by_bandwidth))
            extra = sorted(set(rates_by_bandwidth) - set(bandwidths))
            raise doc.error(("grid", "rate"), "keys must be the grid.bandwidth_gbps values"
                            + (f"; missing {', '.join(f'{b:g}' for b in missing)}" if missing else "")
                            + (f"; not in grid.bandwidth_gbps: {', '.join(f'{b:g}' for b in extra)}" if extra else ""))
    g.done()

    # server
    s = top.sub("server")
    if s is None:
        raise doc.error(("server",), "required", at_key=True)
    if s.has("url") == s.has("launch"):
        raise doc.error(("server",), "give exactly one of server.url and server.launch")
    url = s.get("url", _str, None)
    launch = None
    ln = s.sub("launch")
    if ln is not None:
        extra_vars = ln.get("vars", _str_map, {})
        clash = set(extra_vars) & set(LAUNCH_PLACEHOLDERS)
        if clash:
            raise doc.error(("server", "launch", "vars"), f"{', '.join(sorted(clash))} is set by the harness")
        command = ln.get("command", _str)
        _check_template(doc, ("server", "launch", "command"), command, set(LAUNCH_PLACEHOLDERS) | set(extra_vars))
        axes = {"policy": policies, "bandwidth_gbps": bandwidths, "prefill": clusters, "decode": clusters, "cluster": clusters}
        used = {name for _, name, _, _ in string.Formatter().parse(command) if name}
        for placeholder, values in axes.items():
            if placeholder in used and values == (None,):
                grid_key = "cluster" if placeholder in ("prefill", "decode") else placeholder
                raise doc.error(("server", "launch", "command"), f"placeholder {{{placeholder}}} needs grid.{grid_key}")
        launch = LaunchSpec(
            command=command,
            vars=extra_vars,
            host=ln.get("host", _str, "127.0.0.1"),
            port=ln.get("port", _int(1), None),
            health_path=ln.get("health_path", _str, "/health"),
            startup_timeout_s=ln.get("startup_timeout_s", _number(), 300.0),
            shutdown_timeout_s=ln.get("shutdown_timeout_s", _number(), 20.0),
            env=ln.get("env", _str_map, {}),
            cwd=str(base / ln.get("cwd", _str, ".")),
        )
        ln.done()
    else:
        for key, values in (("policy", policies), ("bandwidth_gbps", bandwidths), ("cluster", clusters)):
            if len(values) > 1:
                raise doc.error(("grid", key), "a fixed server.url cannot vary this axis; use server.launch")
    server = ServerSpec(
        url=url,
        launch=launch,
        model=s.get("model", _str, None),
        endpoint=s.get("endpoint", _choice(tuple(ENDPOINTS)), "chat"),
        api_key_env=s.get("api_key_env", _str, None),
        link_method=s.get("link_method", _str, None),
        scrape_metrics=s.get("scrape_metrics", _bool, True),
    )
    s.done()

    slo = None
    sl = top.sub("slo")
    if sl is not None:
        slo = SLO(sl.get("ttft_s", _number()), sl.get("tpot_s", _number()))
        sl.done()
    top.done()
    return ExperimentSpec(
        name=name, path=str(path), output_dir=output_dir, seed=seed, server=server, workload=workload,
        rates=rates, policies=policies, bandwidths=bandwidths, clusters=clusters, datasets=datasets, slo=slo,
        rates_by_bandwidth=rates_by_bandwidth,
    )
