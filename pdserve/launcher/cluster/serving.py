"""The router in the foreground: a `ClusterBackend` over a worker directory, behind the HTTP app.

Shared by `pdserve up` (Ray directory) and `pdserve router` (static list). Serves until
SIGINT/SIGTERM, then:

1. stops accepting; in-flight requests get `graceful_shutdown_s` to finish (one whose worker
   fails meanwhile ends: nothing is placed again while the cluster stops);
2. closes the backend, which aborts what is still in flight: those responses end (a finish
   reason or an error the client reads) instead of being cancelled under the server's feet;
3. `on_drained` (`pdserve up`: stop the workers) runs while the backend closes, so that the
   aborts it sends do not wait for engine steps in progress (seconds each on a loaded CPU).

A signal raises `KeyboardInterrupt` out of `serve_router`, after the server and backend are
down, so that callers run their own cleanup in `finally`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterSettings:
    model: str  # model spec: the router loads its tokenizer and shape
    tokenizer: str | None = None  # tokenizer spec that replaces the model's (--tokenizer)
    served_model_name: str | None = None
    max_model_len: int | None = None
    policy: str = "round-robin"
    mode: str = "disaggregated"
    max_batch: int | None = None  # the workers' --max-num-seqs (network-aware's hybrid model)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    kv_deadline_s: float = 10.0
    kv_wire_precision: str = "auto"  # the KV's precision on the wire: auto (the policy's) | full | fp8
    worker_wait_s: float = 30.0  # a request no worker can serve waits this long for one, then 503
    max_tokens_default: int | None = None  # max_tokens of a request that gives none (None: OpenAI's defaults)
    max_queued_requests: int = 1024  # requests without a first token yet; past it 429
    queue_timeout_s: float = 600.0  # no first token after this: 503 (a burst beyond the KV waits)
    usage_timing: bool = False  # usage.pdserve_timing in every response (else only when a request asks)
    cluster_token: str | None = field(default=None, repr=False)  # sent with every call to a worker
    log_level: str = "warning"
    graceful_shutdown_s: float = 10.0
    # placement options (see router.placement.policies.build_policy)
    topology: str | None = None
    profile: str | None = None
    slo_ttft: float | None = None
    slo_tpot: float | None = None
    admission_control: bool = False
    calibrate: bool = True  # network-aware corrects its model from outcomes (--no-calibration: False)
    local_prefill: bool = True  # network-aware may run a prompt on its decode worker (--no-local-prefill: False)
    seed: int = 0


@dataclass
class RouterModel:
    tokenizer: Any
    max_model_len: int
    name: str


def load_router_model(model: str, max_model_len: int | None = None, served_model_name: str | None = None,
                      flag: str = "--model", tokenizer: str | None = None) -> RouterModel:
    """The tokenizer and length limit the router needs (`tokenizer` replaces the model's own);
    ValueError naming `flag` when there is none (tiny random shapes without --tokenizer)."""
    from pdserve.loaders import load_model_source

    source = load_model_source(model, tokenizer)
    if source.tokenizer is None:
        raise ValueError(f"{flag}: {model!r} has no tokenizer, which the router needs "
                         "(name one with --tokenizer, or use a real model or random:smollm2-135m)")
    limit = source.config.max_position_embeddings
    if max_model_len is not None:
        limit = min(limit, max_model_len)
    return RouterModel(tokenizer=source.tokenizer, max_model_len=limit, name=served_model_name or model)


def make_router_policy(settings: RouterSettings) -> Any:
    """The placement policy, built before anything starts so that a policy that cannot be built
    (unknown, or missing what it needs) fails at once; ValueError naming --policy."""
    from pdserve.router.placement.registry import build_policy

    try:
        return build_policy(settings.policy, topology_path=settings.topology, profile_path=settings.profile,
                            slo_ttft=settings.slo_ttft, slo_tpot=settings.slo_tpot,
                            admission_control=settings.admission_control, calibrate=settings.calibrate,
                            seed=settings.seed,
                            max_batch=settings.max_batch, kv_wire_precision=settings.kv_wire_precision,
                            local_prefill=settings.local_prefill)
    except ValueError as e:
        raise ValueError(f"--policy {settings.policy}: {e}") from None


def build_app(directory: Any, settings: RouterSettings, model: RouterModel, policy: Any, wrap_backend=None):
    """(app, backend) for `directory`; `wrap_backend(backend, metrics)`, when given, is what the
    HTTP app calls instead of the backend (the autoscaler's observer)."""
    from pdserve.router.cluster.backend import ClusterBackend
    from pdserve.router.metrics import RouterMetrics
    from pdserve.router.http.server import create_app

    metrics = RouterMetrics()
    backend = ClusterBackend(directory, policy, model.tokenizer, model.name,
                             model.max_model_len, mode=settings.mode, kv_deadline_s=settings.kv_deadline_s,
                             metrics=metrics, worker_wait_s=settings.worker_wait_s,
                             max_queued_requests=settings.max_queued_requests, queue_timeout_s=settings.queue_timeout_s,
                             cluster_token=settings.cluster_token, kv_wire_precision=settings.kv_wire_precision)
    served = wrap_backend(backend, metrics) if wrap_backend is not None else backend
    app = create_app(served, api_key=settings.api_key, metrics=metrics, max_tokens_default=settings.max_tokens_default,
                     usage_timing=settings.usage_timing)
    return app, backend


def install_shutdown_signals(on_signal: Callable[[], None] | None = None) -> None:
    """SIGTERM behaves like Ctrl-C (KeyboardInterrupt) in the main thread; `on_signal()` is
    called first (`pdserve up` tells its Ray watchdog that a stop was asked for)."""

    def interrupt(signum, frame):
        if on_signal is not None:
            on_signal()
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)


def ignore_shutdown_signals() -> None:
    """During cleanup: a second signal must not cut it short (it is bounded in time)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def restore_signals() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def serve_router(app: Any, backend: Any, settings: RouterSettings, on_ready=None, background=(),
                 on_signal: Callable[[], None] | None = None, on_drained: Callable[[], None] | None = None) -> None:
    """Serves in the foreground until a signal (see the module docstring). `background`: async
    callables run as tasks beside the server once the backend has started (the autoscaler),
    cancelled when the server stops. `on_signal()`: called at the first SIGINT/SIGTERM.
    `on_drained()`: called in a thread once the drain is over and the backend is closing (step 3)."""
    import uvicorn

    drain_s = settings.graceful_shutdown_s

    loop: asyncio.AbstractEventLoop | None = None
    stop_asked = asyncio.Event()

    class Server(uvicorn.Server):
        signalled: str | None = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.signalled is None:
                self.signalled = signal.Signals(sig).name
                if on_signal is not None:
                    on_signal()
                drain = getattr(backend, "drain", None)
                if drain is not None:  # a request whose worker fails now ends: it is not placed again
                    drain()
                if loop is not None:
                    loop.call_soon_threadsafe(stop_asked.set)  # safe from a signal handler
            super().handle_exit(sig, frame)
            # uvicorn raises a captured signal again once it has served, inside the event loop
            # (where a KeyboardInterrupt would cut the backend's close short): it is raised below,
            # once the loop is done
            getattr(self, "_captured_signals", []).clear()

    # uvicorn's own bound on the drain only backs up step 2, which ends the responses before it
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=math.ceil(2 * drain_s) + 1, proxy_headers=False,
                            lifespan="off")
    server = Server(config)
    closing: asyncio.Future | None = None

    async def close_backend() -> None:
        done = asyncio.ensure_future(backend.close())
        await asyncio.sleep(0)  # closed: a request whose worker stops now is not placed again
        if on_drained is not None:
            try:
                await asyncio.to_thread(on_drained)
            except Exception:
                logger.warning("stopping the workers behind the router failed", exc_info=True)
        await asyncio.wait_for(done, drain_s)

    def close() -> asyncio.Future:
        nonlocal closing
        if closing is None:
            closing = asyncio.ensure_future(close_backend())
        return closing

    async def end_requests_after_drain() -> None:
        await stop_asked.wait()
        await asyncio.sleep(drain_s)
        close()  # the requests still in flight are aborted: their responses end, and the server's wait

    async def announce() -> None:
        while not server.started and not server.should_exit:
            await asyncio.sleep(0.05)
        if server.started:
            on_ready()

    async def run() -> None:
        nonlocal loop
        loop = asyncio.get_running_loop()
        await backend.start()
        serving = getattr(getattr(app, "state", None), "serving", None)
        if serving is not None:  # the first request's one-time costs, before the port opens
            await serving.warm_up()
        try:
            announcer = asyncio.create_task(announce()) if on_ready is not None else None
            drain = asyncio.create_task(end_requests_after_drain())
            tasks = [asyncio.create_task(run_task()) for run_task in background]
            try:
                await server.serve()
            finally:
                drain.cancel()
                for task in tasks:
                    task.cancel()
                if tasks:
                    await asyncio.gather(*tasks, return_exceptions=True)
            if announcer is not None:
                announcer.cancel()
        finally:
            try:
                await close()
            except Exception:
                logger.warning("closing the router backend failed", exc_info=True)

    asyncio.run(run())
    if server.signalled is not None:
        raise KeyboardInterrupt(server.signalled)
