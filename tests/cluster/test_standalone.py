"""`pdserve worker` x2 and `pdserve router` without Ray: addresses printed by the workers, a
completion through the static list, SIGTERM stops each one cleanly. The request plane is
locked with a cluster token (a file for the workers, the environment for the router): a call
without it is refused, and the token shows in no log."""

from __future__ import annotations

import re
import signal
import time

import httpx
import pytest

import grpc

from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.proto.auth import TOKEN_ENV, new_token
from tests.cluster.conftest import MODEL, cluster_env, free_port, kill_group, pdserve, stop, wait_healthy

pytestmark = pytest.mark.timeout(150)


def wait_address(proc, log_path: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(log_path) as f:
            match = re.search(r"listening on (\S+:\d+)", f.read())
        if match:
            return match.group(1)
        assert proc.poll() is None, open(log_path).read()[-3000:]
        time.sleep(0.2)
    raise AssertionError(f"no address within {timeout_s}s: " + open(log_path).read()[-3000:])


def test_workers_and_router_without_ray(tmp_path):
    procs = []
    token = new_token()
    token_file = tmp_path / "cluster-token"
    token_file.write_text(token + "\n")
    try:
        addresses = {}
        for role in ("prefill", "decode"):
            log = str(tmp_path / f"{role}.log")
            proc = pdserve("worker", "--role", role, "--model", MODEL, "--kv-cache-gib", "0.05", "--device", "cpu",
                           "--port", str(free_port()), "--worker-id", f"{role}-a",
                           "--cluster-token-file", str(token_file), log_path=log)
            procs.append(proc)
            addresses[role] = (proc, log)
        addresses = {role: wait_address(proc, log, 60) for role, (proc, log) in addresses.items()}
        port = free_port()
        log = str(tmp_path / "router.log")
        router = pdserve("router", "--model", MODEL, "--port", str(port),
                         "--worker", f"prefill#p0@nodeA={addresses['prefill']}",
                         "--worker", f"decode#d0@nodeB={addresses['decode']}", log_path=log,
                         env=cluster_env(**{TOKEN_ENV: token}))
        procs.append(router)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:  # healthy once the router has checked both workers
            workers = wait_healthy(base, router, 60, log)["backend"]["workers"]
            if all(w["healthy"] for w in workers.values()) and len(workers) == 2:
                break
            assert time.monotonic() < deadline, workers
            time.sleep(0.3)
        assert {k: (w["role"], w["node"]) for k, w in workers.items()} == {
            "p0": ("prefill", "nodeA"), "d0": ("decode", "nodeB")}
        r = httpx.post(f"{base}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": "Without Ray", "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        with grpc.insecure_channel(addresses["decode"]) as channel:  # a stray caller
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for proc in reversed(procs):
            assert stop(proc, signal.SIGTERM, timeout_s=30) == 0
        for name in ("prefill.log", "decode.log", "router.log"):
            text = (tmp_path / name).read_text()
            assert token not in text and "request plane is open" not in text
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_group(proc)
