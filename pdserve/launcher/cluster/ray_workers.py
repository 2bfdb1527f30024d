"""`WorkerActor`: one `WorkerServer` (engine + gRPC + KV plane) in a Ray actor process.

Ray is the control plane only: the actor loads the model and starts the gRPC server in its
constructor, then answers small queries (`address`, `info`, `health`). Requests and KV never
pass through Ray. When Ray restarts a dead actor the constructor runs again, so the server
comes back on a new port; `RayDirectory` asks again for the address.

A worker outlives neither its raylet nor its driver's shutdown: a thread exits the process
when the raylet that spawned it is gone (its parent changes), as happens when a signal to
`pdserve up`'s process group kills Ray's daemons first.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Any

from pdserve import environment
from pdserve.launcher.workers import NOSET_VISIBLE_ENV
from pdserve.worker.server import WorkerConfig, WorkerServer

logger = logging.getLogger(__name__)

RAYLET_CHECK_S = 0.5


def assigned_cuda_index(gpu_ids: list, environ: dict | None = None) -> int | None:
    """The CUDA device index of the first GPU Ray assigned this process, when Ray did not mask
    the visible devices (`NOSET_VISIBLE_ENV`); None when masked or no GPU was assigned.

    Ray's ids are the node's device ids: positions in the raylet's CUDA_VISIBLE_DEVICES when
    that was set (then they are strings naming its entries), else CUDA ordinals."""
    if (environment.get(NOSET_VISIBLE_ENV, environ) or "") not in ("1", "true", "True") or not gpu_ids:
        return None
    gid = str(gpu_ids[0]).strip()
    visible = environment.get("CUDA_VISIBLE_DEVICES", environ)
    if visible is not None and visible.strip() != "":
        entries = [v.strip() for v in visible.split(",")]
        if gid not in entries:
            raise RuntimeError(f"Ray assigned GPU {gid!r}, which CUDA_VISIBLE_DEVICES={visible!r} does not list")
        return entries.index(gid)
    return int(gid)


def exit_when_orphaned(interval_s: float = RAYLET_CHECK_S) -> threading.Thread:
    """Starts a daemon thread that ends this process once its parent (the raylet) is gone."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent:
                logger.error("the raylet (pid %d) is gone; this worker exits", parent)
                os._exit(1)

    thread = threading.Thread(target=watch, name="pdserve-raylet-watch", daemon=True)
    thread.start()
    return thread


def _node_ip(node_id: str) -> str:
    """The address this Ray node registered (the cluster's interface, loopback for a local Ray),
    not the address of the host's default route."""
    import ray

    for node in ray.nodes():
        if node.get("NodeID") == node_id and node.get("NodeManagerAddress"):
            return node["NodeManagerAddress"]
    return ray.util.get_node_ip_address()


class WorkerActor:
    """Used as `ray.remote(WorkerActor)`; see `pdserve.launcher.cluster.pools`.

    `bind_node_ip`: bind gRPC and KV to this Ray node's IP (the address other nodes reach)
    instead of `config.host` / `config.kv_host`.
    """

    def __init__(self, config: WorkerConfig, bind_node_ip: bool = True) -> None:
        import ray

        exit_when_orphaned()
        context = ray.get_runtime_context()
        self._node_id = context.get_node_id()
        self._node_ip = _node_ip(self._node_id)
        if bind_node_ip:
            config = dataclasses.replace(config, host=self._node_ip, kv_host=self._node_ip)
        index = assigned_cuda_index(ray.get_gpu_ids())
        if index is not None and (config.engine.device in (None, "cuda")):
            # WorkerServer selects cuda:<index> for the threads that build and run the engine
            config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, device=f"cuda:{index}"))
            logger.info("worker %s on cuda:%d (all of the node's GPUs visible)", config.worker_id, index)
        self._config = config
        self._standby = False  # a warm spare (launcher.cluster.resize): started, not yet serving
        self._started_at = time.time()
        self._server = WorkerServer(config)
        self._address = self._server.start()

    def address(self) -> str:
        return self._address

    def kv_address(self) -> str:
        return self._server.kv_address

    def info(self) -> dict[str, Any]:
        """Where the worker is: worker_id, role, address, kv_address, node_id, node_ip, pid, max_model_len;
        and its start-up: seconds and what it spent them on (load, warm-up)."""
        return {
            "worker_id": self._config.worker_id,
            "role": self._config.role,
            "address": self._address,
            "kv_address": self._server.kv_address,
            "node_id": self._node_id,
            "node_ip": self._node_ip,
            "pid": os.getpid(),
            "max_model_len": self._server.engine.max_model_len,
            "started_at": self._started_at,
            "startup_s": self._server.startup_s,
            "startup": self._server.startup,
            "standby": self._standby,
        }

    def set_standby(self, standby: bool) -> None:
        """Marks the worker a warm spare (True) or a serving worker (False): a router that finds
        its workers by name (`RayDirectory` without a list) leaves spares out. Ray restarts a
        worker as a serving one."""
        self._standby = bool(standby)

    def health(self) -> dict[str, Any]:
        """{"healthy": bool, "detail": str, **info()}: healthy while the engine loop runs."""
        alive = bool(self._server.loop.alive)
        return {**self.info(), "healthy": alive, "detail": "" if alive else "engine loop stopped"}

    def stop(self, grace: float = 5.0) -> None:
        """Stops the gRPC server and tells the engine loop to stop; the process stays until killed
        (`ray.kill`, or the end of the Ray we started), which frees the KV plane and ends the
        engine's step in progress with it: tearing UCX down first, or waiting for that step, only
        delays the kill (a full garbage collection of the worker, or a whole prefill step, is
        seconds on a loaded CPU and raced the driver's bound; docs/results.md, "Figures behind the
        code's choices")."""
        self._server.stop(grace, close_kv=False, wait_engine=False)
