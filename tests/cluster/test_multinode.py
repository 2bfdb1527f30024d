"""Two Ray nodes on one machine (`ray start --head` with resource node_a, `ray start
--address` with node_b); `pdserve up --address` pins prefill to node_a and decode to node_b,
so the KV crosses nodes over UCX. Every process started here is gone at the end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.cluster.conftest import (
    BIN,
    MODEL,
    REPO,
    cluster_env,
    descendants,
    free_port,
    kill_group,
    pdserve,
    stop,
    wait_gone,
    wait_healthy,
)

pytestmark = [pytest.mark.multinode, pytest.mark.timeout(240)]

_NODES = """
import json, sys, ray
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
print(json.dumps({"nodes": {n["NodeID"]: [k for k in n["Resources"] if k.startswith("node_")]
                           for n in ray.nodes() if n["Alive"]},
                  "available": ray.available_resources()}))
"""


def _ray_start(args: list[str], log_path: str) -> subprocess.Popen:
    ports = []
    for flag in ("--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--metrics-export-port",
                 "--runtime-env-agent-port"):
        ports += [flag, str(free_port())]
    cmd = [f"{BIN}/ray", "start", "--block", "--num-cpus", "2", "--object-store-memory", str(80 * 1024 * 1024),
           "--disable-usage-stats", "--node-ip-address", "127.0.0.1", *ports, *args]
    return subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=cluster_env(),
                            start_new_session=True)


def _cluster_state(address: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _NODES, address], capture_output=True, text=True, timeout=60,
                         env=cluster_env(), cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def two_nodes(tmp_path):
    gcs_port = free_port()
    address = f"127.0.0.1:{gcs_port}"  # both nodes on loopback: the test sends nothing elsewhere
    head = _ray_start(["--head", "--port", str(gcs_port), "--include-dashboard", "false",
                       "--ray-client-server-port", str(free_port()), "--resources", '{"node_a": 2}'],
                      str(tmp_path / "head.log"))
    procs = [head]
    try:
        deadline = time.monotonic() + 60
        while True:  # the head's GCS answers
            try:
                _cluster_state(address)
                break
            except (AssertionError, subprocess.TimeoutExpired):
                if time.monotonic() > deadline or head.poll() is not None:
                    raise AssertionError("ray head did not start: " + open(tmp_path / "head.log").read()[-2000:])
                time.sleep(1)
        procs.append(_ray_start(["--address", address, "--resources", '{"node_b": 2}'], str(tmp_path / "b.log")))
        deadline = time.monotonic() + 60
        while len(_cluster_state(address)["nodes"]) < 2:
            assert time.monotonic() < deadline, open(tmp_path / "b.log").read()[-2000:]
            time.sleep(1)
        yield address
    finally:
        tree = [p for proc in procs for p in descendants(proc.pid)]
        for proc in reversed(procs):  # the worker node first, then the head
            try:
                stop(proc, signal.SIGTERM, timeout_s=30)
            except subprocess.TimeoutExpired:
                pass
        assert wait_gone(tree, 20) == []
        _forget_cluster(address)


def _forget_cluster(address: str) -> None:
    """`ray start --head` records its address for `--address auto`; drop the record if it is ours."""
    path = "/tmp/ray/ray_current_cluster"
    try:
        with open(path) as f:
            if f.read().strip() == address:
                os.remove(path)
    except OSError:
        pass


def test_prefill_and_decode_on_pinned_nodes(two_nodes, tmp_path):
    address = two_nodes
    port = free_port()
    log = str(tmp_path / "up.log")
    up = pdserve("up", "--address", address, "--namespace", "pdserve-multinode", "--model", MODEL,
                 "--port", str(port), "--kv-cache-gib", "0.05", "--prefill-resources", '{"node_a": 1}',
                 "--decode-resources", '{"node_b": 1}', "--startup-timeout-s", "120", log_path=log)
    base = f"http://127.0.0.1:{port}"
    try:
        workers = wait_healthy(base, up, 150, log)["backend"]["workers"]
        nodes = _cluster_state(address)["nodes"]
        placed = {w["role"]: nodes[w["node"]] for w in workers.values()}
        assert placed == {"prefill": ["node_a"], "decode": ["node_b"]}

        from pdserve.llm import LLM
        from pdserve.sampling_params import SamplingParams

        prompts = ["Two nodes, one request", "The KV crosses nodes " * 12, "short"]
        engine = LLM(MODEL, device="cpu", dtype="float32", kv_cache_gib=0.05)
        expected = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0))
        for prompt, ref in zip(prompts, expected):  # token-identical to the single-process engine
            r = httpx.post(f"{base}/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 0})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["usage"]["completion_tokens"] == 8
            assert body["choices"][0]["logprobs"]["tokens"] == [engine.tokenizer.token_to_str(t)
                                                                for t in ref.token_ids]
        assert stop(up, signal.SIGTERM, timeout_s=60) == 0
    finally:
        if up.poll() is None:
            kill_group(up)
    # `up` joined an existing cluster: it removed its actors and placement groups, not the cluster.
    deadline = time.monotonic() + 20
    while (available := _cluster_state(address)["available"]).get("CPU") != 4.0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert available.get("CPU") == 4.0 and available.get("node_a") == 2.0 and available.get("node_b") == 2.0
