import csv
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from pdserve.loadgen import experiment
from pdserve.loadgen.errors import SpecError
from pdserve.loadgen.runner import RunInterrupted
from pdserve.loadgen.spec import load_spec

FAKE = Path(__file__).with_name("fake_openai_server.py")


def write_spec(tmp_path, body: str) -> Path:
    p = tmp_path / "spec.yaml"
    p.write_text(textwrap.dedent(body).lstrip())
    return p


def launch_spec(tmp_path, rates="[20, 40]", extra=""):
    return write_spec(tmp_path, f"""
        name: tiny
        output_dir: {tmp_path / 'out'}
        server:
          launch:
            command: "{sys.executable} {FAKE} --port {{port}} --policy {{policy}} \
--bandwidth-gbps {{bandwidth_gbps}} --pidfile {tmp_path / 'pids'}"
            startup_timeout_s: 30
            shutdown_timeout_s: 5
          endpoint: completions
          link_method: none (fake server)
        grid:
          policy: [round-robin, network-aware]
          bandwidth_gbps: [1, 10]
          rate: {rates}
        workload:
          arrival: poisson
          num_requests: 6
          request_timeout_s: 10
          max_run_time_s: 10
          dataset:
            name: small
            input: fixed:13
            output: uniform:2:6
        slo:
          ttft_s: 0.5
          tpot_s: 0.05
        {extra}
    """)


def pids_gone(tmp_path) -> list[int]:
    pids = [int(x) for x in (tmp_path / "pids").read_text().split()]
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return pids, alive


def test_launch_grid_writes_everything(tmp_path):
    spec = load_spec(launch_spec(tmp_path))
    result = experiment.run_experiment(spec, progress=False)
    out = tmp_path / "out"
    assert not result.interrupted
    pids, alive = pids_gone(tmp_path)
    assert len(pids) == 4 and alive == []

    with open(out / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 8
    assert {(r["policy"], r["bandwidth_gbps"], r["rate"]) for r in rows} == {
        (p, b, r) for p in ("round-robin", "network-aware") for b in ("1.0", "10.0") for r in ("20.0", "40.0")}
    assert all(r["num_ok"] == "6" and r["error"] == "" for r in rows)
    assert all(float(r["kv_transfer_bytes"]) == 6 * 10 * 1000 for r in rows)
    assert len(list((out / "runs").glob("*.jsonl"))) == 8
    first = (out / "runs" / "round-robin_1gbps_small_rate20.jsonl").read_text().splitlines()
    assert len(first) == 6 and json.loads(first[0])["status"] == 200

    env = json.loads((out / "environment.json").read_text())
    assert {"git_commit", "cpu_model", "python", "packages"} <= set(env)
    assert "hostname" not in json.dumps(env).lower() and os.uname().nodename not in json.dumps(env)
    report = (out / "report.md").read_text()
    assert (report.startswith("# tiny\n") and "| round-robin | 10 | small | 40 | 6/6 |" in report
            and "link held by: none (fake server)" in report)
    for plot in ("ttft_cdf.png", "slo_attainment_vs_rate.png", "goodput_vs_bandwidth.png"):
        assert (out / "plots" / plot).stat().st_size > 1000
        assert f"(plots/{plot})" in report
    assert (out / "spec.yaml").exists() and len(list((out / "server-logs").glob("*.log"))) == 4


def test_failed_launch_is_recorded_and_sweep_goes_on(tmp_path):
    spec_path = write_spec(tmp_path, f"""
        output_dir: {tmp_path / 'out'}
        server:
          launch:
            command: "{sys.executable} -c 'import sys; print(\\"boom {{policy}}\\"); sys.exit(3)'"
            startup_timeout_s: 10
        grid:
          policy: [a, b]
          rate: [1]
        workload:
          num_requests: 1
    """)
    result = experiment.run_experiment(load_spec(spec_path), progress=False)
    assert [r["policy"] for r in result.rows] == ["a", "b"]
    assert all("server exited with code 3" in r["error"] and "boom" in r["error"] for r in result.rows)
    assert (tmp_path / "out" / "report.md").exists()


def test_ctrl_c_keeps_results_and_stops_server(tmp_path, monkeypatch):
    real = experiment.run_load
    calls = []

    def flaky(cfg, **kw):
        calls.append(cfg.rate)
        if len(calls) == 2:
            result = real(cfg, **kw)
            result.interrupted = True
            raise RunInterrupted(result)
        return real(cfg, **kw)

    monkeypatch.setattr(experiment, "run_load", flaky)
    result = experiment.run_experiment(load_spec(launch_spec(tmp_path)), progress=False)
    assert result.interrupted and len(calls) == 2
    with open(tmp_path / "out" / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and rows[1]["interrupted"] == "True"
    assert "interrupted" in (tmp_path / "out" / "report.md").read_text()
    pids, alive = pids_gone(tmp_path)
    assert len(pids) == 1 and alive == []


@pytest.mark.parametrize("body,line,field,message", [
    ("server: {url: 'http://x:1'}\ngrid:\n  rate: [1]\n  polcy: [a]\nworkload: {num_requests: 1}\n",
     4, "grid.polcy", "unknown key"),
    ("server: {url: 'http://x:1'}\ngrid:\n  rate:\n    - 1\n    - -2\nworkload: {num_requests: 1}\n",
     5, "grid.rate[1]", "must be > 0"),
    ("server: {url: 'http://x:1'}\ngrid:\n  rate: [1]\n  policy: [a, b]\nworkload: {num_requests: 1}\n",
     4, "grid.policy", "server.launch"),
    ("server:\n  launch:\n    command: run {polcy}\ngrid: {rate: [1]}\nworkload: {num_requests: 1}\n",
     3, "server.launch.command", "unknown placeholder {polcy}"),
    ("server: {url: 'http://x:1'}\ngrid: {rate: [1]}\nworkload:\n  num_requests: 1\n  dataset:\n    input: zipf:2\n",
     6, "workload.dataset.input", "bad length distribution"),
    ("server: {url: 'http://x:1'}\ngrid: {rate: [1]}\nworkload: {num_requests: 1}\nslo:\n  ttft_s: 1\n",
     5, "slo.tpot_s", "required"),
    ("server: {url: 'http://x:1'}\ngrid: {rate: [1]\nworkload: {}\n", 3, None, "invalid YAML"),
    ("server: {url: 'http://x:1'}\ngrid: {rate: [1]}\nworkload:\n  num_requests: yes\n",
     4, "workload.num_requests", "whole number"),
])
def test_malformed_spec_names_file_line_field(tmp_path, body, line, field, message):
    p = tmp_path / "bad.yaml"
    p.write_text(body)
    with pytest.raises(SpecError) as info:
        load_spec(p)
    err = info.value
    assert (err.path, err.line, err.field) == (str(p), line, field), str(err)
    assert message in str(err)
    assert str(err).startswith(f"{p}:{line}: ")


def test_sigint_on_the_cli_keeps_results_and_stops_server(tmp_path):
    import signal
    import subprocess
    import time

    spec = launch_spec(tmp_path, rates="[2, 4]").read_text().replace("num_requests: 6", "num_requests: 40")
    spec = spec.replace("policy: [round-robin, network-aware]", "policy: [round-robin]")
    (tmp_path / "spec.yaml").write_text(spec)
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.loadgen.cli", "experiment", str(tmp_path / "spec.yaml"),
                             "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    records = tmp_path / "out" / "runs" / "round-robin_1gbps_small_rate2.jsonl"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (records.exists() and records.read_text().count("\n") >= 2):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        # the server runs in its own session: a CLI killed here would leave it behind
        for pid in (tmp_path / "pids").read_text().split() if (tmp_path / "pids").exists() else []:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        raise
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    with open(tmp_path / "out" / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1 and rows[0]["interrupted"] == "True" and 2 <= int(rows[0]["num_requests"]) < 40
    assert len(records.read_text().splitlines()) == int(rows[0]["num_requests"])
    pids, alive = pids_gone(tmp_path)
    assert len(pids) == 1 and alive == []
    assert (tmp_path / "out" / "report.md").exists()


def test_each_run_on_a_server_draws_its_own_prompts(tmp_path, monkeypatch):
    """A later run on one server must not replay an earlier run's prompts (the prefix cache
    would serve them); the same point on every server draws the same ones."""
    seeds = []
    real = experiment.run_load

    def spy(cfg, **kw):
        seeds.append((cfg.rate, cfg.seed))
        return real(cfg, **kw)

    monkeypatch.setattr(experiment, "run_load", spy)
    spec = load_spec(launch_spec(tmp_path, extra="seed: 7"))
    experiment.run_experiment(spec, progress=False)
    assert seeds == [(20.0, 7), (40.0, 8)] * 4
