"""An in-process router over real workers on the embedded SmolLM2 (KV over the in-process backend):
a prefill and a decode worker ("disaggregated"), or one mixed worker ("colocated")."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

SERVED = "smollm2"
ROLES = {"disaggregated": ("prefill", "decode"), "colocated": ("mixed",)}


@contextmanager
def agents_cluster(mode: str) -> Iterator[tuple[str, list]]:
    """Yields the router's base URL (".../v1") and the workers."""
    from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.launcher.cluster.serving import RouterSettings, build_app, load_router_model, make_router_policy
    from pdserve.router.cluster.directory import StaticDirectory
    from pdserve.worker.server import WorkerConfig, WorkerServer
    from tests.router.conftest import ServerThread

    workers = []
    try:
        for role in ROLES[mode]:
            engine = EngineConfig(model=SERVED, device="cpu", cache=CacheConfig(cpu_kv_gib=0.05),
                                  scheduler=SchedulerConfig(role=role))
            workers.append(WorkerServer(WorkerConfig(f"{role}-0", role, engine, kv_backend="fake")))
        directory = StaticDirectory.parse([f"{w.config.role}#{w.config.worker_id}={w.start()}" for w in workers])
        settings = RouterSettings(model=SERVED, served_model_name=SERVED, mode=mode)
        model = load_router_model(SERVED, served_model_name=SERVED)
        app, _ = build_app(directory, settings, model, make_router_policy(settings))
        with ServerThread(app) as server:
            yield server.url + "/v1", workers
    finally:
        for worker in workers:
            worker.stop(0.5)
