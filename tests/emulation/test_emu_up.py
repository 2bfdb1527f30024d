"""`python -m pdserve.launcher.emulation up`: workers in namespaces, router on 127.0.0.1, a request
through it whose KV crosses the shaped link; SIGTERM removes everything."""

import dataclasses
import ipaddress
import signal
import subprocess
import sys
import time

import httpx
import pytest

from pdserve.launcher.emulation.cluster import EmulatedDeployment
from pdserve.launcher.emulation.spec import load_topology
from pdserve.launcher.workers import worker_argv
from tests.emulation.conftest import assert_gone, needs_netns

SPEC = """\
model: random:smollm2-135m
worker_args: [--kv-cache-gib, "0.05"]
workers:
  - {id: p0, role: prefill, node: n0}
  - {id: d0, role: decode, node: n1}
topology:
  nodes: [n0, n1]
  defaults: {remote_latency_ms: 0}
  links:
    - {between: [n0, n1], gbps: 2}
"""


def test_pacing_method_passes_the_pacer_to_workers(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text(SPEC + "method: pacing\n")
    deployment = EmulatedDeployment(load_topology(path), tmp_path, run_id="argv")
    deployment.cluster.subnet = ipaddress.ip_network("10.250.0.0/24")
    deployment.cluster._created = True  # addresses only; nothing is created
    argv = worker_argv(deployment.worker_spec(0, deployment.spec.workers[0]))
    assert argv[1:4] == ["-m", "pdserve.launcher.cli", "worker"]
    assert argv[argv.index("--kv-pacing") + 1] == "10.250.0.2=2"
    assert argv[argv.index("--host") + 1] == "10.250.0.1"
    assert argv[-2:] == ["--kv-cache-gib", "0.05"]  # the spec's worker_args, last
    deployment.spec = dataclasses.replace(deployment.spec, method="tc")
    argv = worker_argv(deployment.worker_spec(0, deployment.spec.workers[0]))
    assert argv[1:4] == ["-m", "pdserve.launcher.cli", "worker"] and "--kv-pacing" not in argv


@needs_netns
@pytest.mark.slow
def test_up_serves_and_sigterm_cleans_up(tmp_path, run_id):
    from pdserve.loadgen.launcher import free_port

    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.launcher.emulation", "up", str(spec), "--port", str(port),
                             "--run-id", run_id, "--log-dir", str(tmp_path / "logs")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        lines = []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "serving at" in line:
                break
        assert any("serving at" in line for line in lines), "".join(lines)
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                           json={"model": "random:smollm2-135m", "prompt": "one two three four five " * 8,
                                 "max_tokens": 4})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
        # the KV went through the prefill node's shaped class towards the decode node
        stats = subprocess.run(["ip", "netns", "exec", f"pds-{run_id}-n0", "tc", "-s", "class", "show", "dev",
                                "pds0", "classid", "1:10"], capture_output=True, text=True).stdout
        sent = int(stats.split("Sent ")[1].split()[0])
        assert sent > 30 * 2 * 16 * 3 * 64 * 4, stats  # at least one block of every layer's K and V
        assert (tmp_path / "logs" / "topology.yaml").exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert_gone(f"pds-{run_id}-")
