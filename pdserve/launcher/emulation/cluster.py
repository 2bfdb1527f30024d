"""Standalone workers inside an emulated cluster, and a router in front of them.

Lifecycle of ``EmulatedDeployment(spec)`` (``python -m pdserve.launcher.emulation up SPEC``):

1. Create the namespaces and links (``EmulatedCluster``); with ``method: pacing`` the
   veths stay unshaped and each worker paces its own KV sends instead.
2. Start every worker inside its node: ``ip netns exec pds-<run>-n<i> python -m
   launcher.cli worker --role R --host <node ip> --port P --worker-id ID --model M ...``
   (launcher.workers builds it; with pacing, ``--kv-pacing SPEC`` too).
   gRPC and the UCX listener bind the node's address; UCX runs over TCP on the node's
   veth (``netns.UCX_ENV``). Wait until each prints ``listening on``.
3. Write ``topology.yaml`` for the router's network-aware policy (router/topology.py
   format: the SET rate of each link, workers mapped to nodes).
4. Start the router in the root namespace on 127.0.0.1:<port> (``python -m pdserve.launcher.cli
   router --worker role#id@node=ip:port ...``, plus ``--topology`` when the router has
   it). The root namespace reaches every node through its veth into the hub bridge, so
   the router dials the workers' gRPC addresses directly; that traffic falls into each
   node's unshaped default class: only KV between nodes is shaped.
5. On exit (normal, exception, Ctrl-C, SIGTERM): stop the router, the workers, then
   delete the namespaces. Logs stay in ``log_dir``.

The deployment makes a cluster token and gives it to the workers and the router through
``$PDSERVE_CLUSTER_TOKEN``, so its request plane is locked like `pdserve up`'s. A fault
experiment may ``kill_worker`` and ``restart_worker`` (the supervisor's part: same node, same
address, same flags).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from pdserve.kvtransfer.pacing_spec import pacing_for_node
from pdserve.launcher.emulation.errors import EmulationError
from pdserve.launcher.emulation.netns import EmulatedCluster
from pdserve.launcher.emulation.spec import TopologySpec
from pdserve.launcher.workers import WorkerSpec, worker_argv, worker_env
from pdserve.proto.auth import TOKEN_ENV, new_token

logger = logging.getLogger(__name__)

WORKER_BASE_PORT = 50051


def topology_document(spec: TopologySpec) -> dict:
    """The router's topology (router/topology.py's YAML) for ``spec``: SET link rates."""
    doc: dict = {"nodes": list(spec.nodes), "workers": {w.id: w.node for w in spec.workers}, "links": []}
    if spec.default_link is not None and spec.default_link.gbps is not None:
        doc["defaults"] = {"remote_gbps": spec.default_link.gbps, "remote_latency_ms": spec.default_link.latency_ms}
    for (a, b), link in spec.links.items():
        if link.gbps is not None:
            doc["links"].append({"between": [a, b], "gbps": link.gbps, "latency_ms": link.latency_ms})
    return doc


class EmulatedDeployment:
    """Workers of ``spec`` in an emulated cluster plus a router on 127.0.0.1:``port``."""

    def __init__(self, spec: TopologySpec, log_dir: str | Path, port: int | None = None,
                 policy: str | None = None, run_id: str | None = None, startup_timeout_s: float = 300.0,
                 python: str = sys.executable):
        self.spec = spec
        self.log_dir = Path(log_dir)
        self.port = port or spec.router.port
        self.policy = policy or spec.router.policy
        self.startup_timeout_s = startup_timeout_s
        self.python = python
        links = spec.all_links() if spec.method == "tc" else {}
        self.cluster = EmulatedCluster(list(spec.nodes), links, run_id=run_id)
        self.workers: dict[str, tuple[subprocess.Popen, str]] = {}  # id -> (process, grpc address)
        self.router: subprocess.Popen | None = None
        self.topology_path = self.log_dir / "topology.yaml"
        self.cluster_token = new_token()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> EmulatedDeployment:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.cluster.__enter__()
        try:
            self._start_workers()
            self.topology_path.write_text(
                f"# written by launcher.emulation for run {self.cluster.run_id}: SET link rates "
                f"(method {self.spec.method})\n" + yaml.safe_dump(topology_document(self.spec), sort_keys=False))
            self._start_router()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        router, self.router = self.router, None
        if router is not None and router.poll() is None:
            router.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                router.wait(20)
            if router.poll() is None:
                router.kill()
                router.wait()
        self.cluster.destroy()  # stops the workers (run_in processes) first

    # ---- workers -----------------------------------------------------------------------

    def worker_spec(self, index: int, worker) -> WorkerSpec:
        """The spec's ``worker`` on its node's address; with ``method: pacing`` it paces its KV
        sends to the other nodes at their links' rates."""
        ip = self.cluster.ip(worker.node)
        pacing = None
        if self.spec.method == "pacing":
            peers = {self.cluster.ip(other): self.spec.link(worker.node, other).gbps
                     for other in self.spec.nodes if other != worker.node}
            pacing = pacing_for_node({h: g for h, g in peers.items() if g is not None}) or None
        return WorkerSpec(role=worker.role, worker_id=worker.id, host=ip, port=WORKER_BASE_PORT + index,
                          model=self.spec.model, kv_pacing=pacing, engine_args=tuple(self.spec.worker_args),
                          cluster_token=self.cluster_token, python=self.python)

    def _spawn_worker(self, index: int, worker, mode: str = "wb") -> None:
        launch = self.worker_spec(index, worker)
        with open(self.log_dir / f"{worker.id}.log", mode) as log:
            if mode != "wb":
                log.write(b"\n---- restarted ----\n")
                log.flush()
            proc = self.cluster.run_in(worker.node, worker_argv(launch), env=worker_env(launch),
                                       stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        self.workers[worker.id] = (proc, f"{launch.host}:{launch.port}")

    def kill_worker(self, worker_id: str, sig: int = signal.SIGKILL) -> int:
        """Sends `sig` to the worker's process; returns its pid."""
        proc, _ = self.workers[worker_id]
        os.kill(proc.pid, sig)  # `ip netns exec` execs the worker: same process
        return proc.pid

    def restart_worker(self, worker_id: str) -> None:
        """Starts the worker again as it was (same node, port and flags); waits until it listens."""
        index, worker = next((i, w) for i, w in enumerate(self.spec.workers) if w.id == worker_id)
        old, _ = self.workers[worker_id]
        with contextlib.suppress(subprocess.TimeoutExpired):
            old.wait(10)
        size = (self.log_dir / f"{worker_id}.log").stat().st_size
        self._spawn_worker(index, worker, mode="ab")
        self._wait_listening({worker_id}, offsets={worker_id: size})

    def _start_workers(self) -> None:
        for i, worker in enumerate(self.spec.workers):
            self._spawn_worker(i, worker)
        self._wait_listening(set(self.workers))

    def _wait_listening(self, pending: set[str], offsets: dict[str, int] | None = None) -> None:
        offsets = offsets or {}
        deadline = time.monotonic() + self.startup_timeout_s
        while pending:
            for wid in sorted(pending):
                proc, _ = self.workers[wid]
                text = (self.log_dir / f"{wid}.log").read_text(errors="replace")[offsets.get(wid, 0):]
                if "listening on" in text:
                    pending.discard(wid)
                elif proc.poll() is not None:
                    raise EmulationError(f"worker {wid} exited with {proc.returncode} while starting; "
                                         f"log {self.log_dir / (wid + '.log')}: {_tail(text)}")
            if pending and time.monotonic() > deadline:
                raise EmulationError(f"workers {sorted(pending)} not up after {self.startup_timeout_s:g}s; "
                                     f"logs in {self.log_dir}")
            time.sleep(0.2)

    # ---- router ------------------------------------------------------------------------

    def router_argv(self) -> list[str]:
        level = ["--log-level", self.spec.router.log_level] if self.spec.router.log_level else []
        argv = [self.python, "-m", "pdserve.launcher.cli", *level, "router", "--model", self.spec.model,
                "--policy", self.policy, "--host", "127.0.0.1", "--port", str(self.port)]
        for worker in self.spec.workers:
            argv += ["--worker", f"{worker.role}#{worker.id}@{worker.node}={self.workers[worker.id][1]}"]
        if _router_takes_topology(self.python):
            argv += ["--topology", str(self.topology_path)]
        return [*argv, *self.spec.router.args_for(self.policy)]

    def _start_router(self) -> None:
        import httpx

        log_path = self.log_dir / "router.log"
        with open(log_path, "wb") as log:
            self.router = subprocess.Popen(self.router_argv(), stdin=subprocess.DEVNULL, stdout=log,
                                           stderr=subprocess.STDOUT,
                                           env=dict(os.environ) | {TOKEN_ENV: self.cluster_token})
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self.router.poll() is not None:
                raise EmulationError(f"router exited with {self.router.returncode}; log {log_path}: "
                                     f"{_tail(log_path.read_text(errors='replace'))}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise EmulationError(f"router not healthy at {self.url} after {self.startup_timeout_s:g}s")
            time.sleep(0.2)

    def failed(self) -> str | None:
        """A line naming the first process that died, else None."""
        for wid, (proc, _) in self.workers.items():
            if proc.poll() is not None:
                return f"worker {wid} exited with {proc.returncode} (log {self.log_dir / (wid + '.log')})"
        if self.router is not None and self.router.poll() is not None:
            return f"router exited with {self.router.returncode} (log {self.log_dir / 'router.log'})"
        return None

    def summary(self) -> str:
        lines = [f"emulated cluster {self.cluster.run_id} ({self.spec.method}), subnet {self.cluster.subnet}:"]
        for w in self.spec.workers:
            lines.append(f"  {w.id:<8} {w.role:<8} node {w.node} ({self.cluster.ns(w.node)}) "
                         f"grpc {self.workers[w.id][1]}")
        for (a, b), link in self.spec.all_links().items():
            lines.append(f"  link {a}<->{b}: {link.gbps:g} Gbit/s"
                         + (f", +{link.latency_ms:g} ms" if link.latency_ms else ""))
        lines.append(f"  router {self.url}/v1  topology {self.topology_path}  logs {self.log_dir}")
        return "\n".join(lines)


def _tail(text: str, lines: int = 5) -> str:
    return " | ".join(text.strip().splitlines()[-lines:])


_TOPOLOGY_FLAG: dict[str, bool] = {}


def _router_takes_topology(python: str) -> bool:
    if python not in _TOPOLOGY_FLAG:
        out = subprocess.run([python, "-m", "pdserve.launcher.cli", "router", "--help"], capture_output=True, text=True)
        _TOPOLOGY_FLAG[python] = "--topology" in out.stdout
    return _TOPOLOGY_FLAG[python]
