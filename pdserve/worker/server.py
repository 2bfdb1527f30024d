"""A worker: the engine in one role behind the gRPC request plane, with its KV data plane.

`WorkerServer`'s lifecycle:
1. load: the engine is built on its device (the model and its KV pools);
2. warm-up: kernels compiled and CUDA graphs captured before the first request (pdserve.warmup);
3. KV plane: its sender and/or receiver over the engine's pools (worker.kv_plane);
4. start: the engine thread (worker.engine_loop), then the gRPC server (worker.servicer);
5. serve: until `stop`; a reservation no Decode claimed is freed when its lease ends;
6. stop: the gRPC server (in-flight calls get a grace), the engine thread, then the KV plane.

The request lifecycle, the leases and the status codes of the calls: worker.servicer.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import dataclass, field, replace

import grpc

from pdserve.config import ROLES, EngineConfig
from pdserve.engine import LLMEngine
from pdserve.proto import worker_pb2 as pb
from pdserve.proto.auth import TokenInterceptor, check_token
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.warmup import warm_up
from pdserve.worker.engine_loop import EngineLoop
from pdserve.kvtransfer.settings import KVSettings
from pdserve.worker.kv_plane import build_kv_plane
from pdserve.worker.servicer import WorkerServicer

logger = logging.getLogger(__name__)

EXIT_RANK_DIED = 3  # the process status of a worker whose tensor-parallel rank died


@dataclass(frozen=True)
class WorkerConfig:
    worker_id: str
    role: str  # "prefill" | "decode" | "mixed"
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 0
    kv_backend: str = "ucx"
    kv_host: str = "127.0.0.1"
    # the local address KV connections must arrive on (None: kv_host; "any": every interface)
    kv_interface: str | None = None
    kv_options: tuple[tuple[str, object], ...] = ()  # extra backend options (e.g. pacing)
    # the KV plane's process-wide settings (kvtransfer.settings: staging, UCX runtime, trace);
    # None: the process's environment, read when the worker builds its KV plane
    kv_settings: KVSettings | None = None
    # gRPC calls must carry it (pdserve.proto.auth); None: an open request plane
    cluster_token: str | None = field(default=None, repr=False)
    # a mixed worker that also hands its prefilled KV to another worker (Prefill) and takes KV
    # prefilled elsewhere (Reserve/Decode), so the router can choose per request (hybrid clusters)
    moves_kv: bool = False

    @property
    def sends_kv(self) -> bool:
        return self.role == "prefill" or (self.role == "mixed" and self.moves_kv)

    @property
    def receives_kv(self) -> bool:
        return self.role == "decode" or (self.role == "mixed" and self.moves_kv)

    def __post_init__(self) -> None:
        if self.cluster_token is not None:
            check_token(self.cluster_token, "worker cluster_token")
        if self.role not in ROLES:
            raise ValueError(f"worker role must be one of {ROLES}, got {self.role!r}")
        if self.moves_kv and self.role != "mixed":
            raise ValueError(f"moves_kv applies to mixed workers (a {self.role} worker's role fixes its KV side)")
        if not 0 <= self.port < 65536:
            raise ValueError(f"worker port must be in [0, 65535], got {self.port}")


class WorkerServer:
    """Loads the model, then serves it: `start()` returns the gRPC address."""

    def __init__(self, config: WorkerConfig, default_deadline_s: float = 30.0,
                 reservation_grace_s: float = 10.0) -> None:
        self.config = config
        self.default_deadline_s = default_deadline_s
        self.reservation_grace_s = reservation_grace_s  # a reservation's lease: its deadline plus this
        self.reservations_expired = 0
        engine_config = config.engine
        if engine_config.scheduler.role != config.role:
            engine_config = replace(engine_config, scheduler=replace(engine_config.scheduler, role=config.role))
        if engine_config.device and engine_config.device.startswith("cuda:"):
            import torch

            # this thread builds and warms the engine (CUDA graphs are captured here): on the
            # engine's GPU when the process sees several
            torch.cuda.set_device(torch.device(engine_config.device))
        if config.moves_kv and engine_config.tensor_parallel_size > 1:
            raise ValueError("--moves-kv (hybrid) workers run at --tensor-parallel-size 1 for now")
        t0 = time.perf_counter()
        self.engine = LLMEngine(engine_config)
        load_s = time.perf_counter() - t0
        # Ready means warm: kernels compiled and CUDA graphs captured before the first request.
        self.warmup = warm_up(self.engine) if engine_config.warmup else None
        self.startup_s = time.perf_counter() - t0
        self.startup = (f"model {engine_config.model} loaded in {load_s:.1f}s; "
                        + (self.warmup.describe() if self.warmup else "warm-up skipped (--no-warmup)")
                        + f"; start-up {self.startup_s:.1f}s")
        logger.info("worker %s (%s): %s", config.worker_id, config.role, self.startup)
        self.block_size = engine_config.cache.block_size
        self.loop = EngineLoop(self.engine, name=f"engine-{config.worker_id}")
        if engine_config.tensor_parallel_size > 1:
            self.loop.on_fatal = self._rank_died
        kv = build_kv_plane(config, self.engine, engine_config)
        self.kv_layout, self.layout_fingerprint, self.kv_compat = kv.layout, kv.layout_fingerprint, kv.kv_compat
        self.sender, self.receiver, self.pusher = kv.sender, kv.receiver, kv.pusher
        self.kv_address = kv.address
        self.transfers: dict[str, str] = {}  # request id -> transfer id (decode role)
        self.kv_bytes = 0
        self.kv_seconds = 0.0
        self.address = ""
        self._aio_loop: asyncio.AbstractEventLoop | None = None
        self._server: grpc.aio.Server | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._stop_event: asyncio.Event | None = None
        self._grace = 5.0

    def start(self) -> str:
        self.loop.start()
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._aio_loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._serve(ready))
            except BaseException as exc:  # surfaced to start()
                errors.append(exc)
                ready.set()
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name=f"grpc-{self.config.worker_id}", daemon=True)
        self._thread.start()
        ready.wait(30)
        if errors:
            self.stop()
            raise errors[0]
        logger.info("worker %s (%s) serving on %s, KV at %s", self.config.worker_id, self.config.role,
                    self.address, self.kv_address or "-")
        return self.address

    async def _serve(self, ready: threading.Event) -> None:
        interceptors = [TokenInterceptor(self.config.cluster_token)] if self.config.cluster_token else []
        if not interceptors:
            logger.warning("worker %s: no cluster token, its request plane accepts any caller that reaches "
                           "%s", self.config.worker_id, self.config.host)
        server = grpc.aio.server(interceptors=interceptors,
                                 options=[("grpc.max_receive_message_length", 64 << 20),
                                          ("grpc.max_send_message_length", 64 << 20)])
        pb_grpc.add_WorkerServicer_to_server(WorkerServicer(self), server)
        port = server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        if port == 0:
            raise OSError(f"cannot bind the worker's gRPC port {self.config.host}:{self.config.port}")
        self.address = f"{self.config.host}:{port}"
        self._server = server
        self._stop_event = asyncio.Event()
        await server.start()
        ready.set()
        await self._stop_event.wait()
        await server.stop(self._grace)

    def lease_reservation(self, request_id: str, transfer_id: str, lease_s: float) -> None:
        """Frees the reservation `request_id` -> `transfer_id` after `lease_s` unless a Decode or an
        Abort claimed it first (on the gRPC loop's thread)."""
        asyncio.get_running_loop().call_later(lease_s, self._expire_reservation, request_id, transfer_id)

    def _expire_reservation(self, request_id: str, transfer_id: str) -> None:
        if self.transfers.get(request_id) != transfer_id:
            return  # claimed by a Decode or an Abort
        del self.transfers[request_id]
        self.reservations_expired += 1
        logger.warning("worker %s: the reservation of request %s expired unclaimed; its blocks are freed",
                       self.config.worker_id, request_id)
        if self.receiver is not None:
            self.receiver.cancel(transfer_id)
        self.loop.submit(lambda e: e.abort_request(request_id))

    def stats(self) -> pb.StatsResponse:
        s = self.engine.stats()
        elapsed = max(time.monotonic() - self.loop.started_at, 1e-9)
        return pb.StatsResponse(
            worker_id=self.config.worker_id, role=self.config.role, num_waiting=s["num_waiting"],
            num_running=s["num_running"], num_held=s["num_held"], num_awaiting_kv=s["num_awaiting_kv"],
            num_blocks=s["num_blocks"], num_free_blocks=s["num_free_blocks"], block_size=self.block_size,
            prefix_cache_hits=s["prefix_cache_hits"], prefix_cache_queries=s["prefix_cache_queries"],
            kv_transfer_bytes=self.kv_bytes, kv_transfer_seconds=self.kv_seconds, kv_address=self.kv_address,
            model=self.config.engine.model, max_model_len=self.engine.max_model_len,
            num_preemptions=s["num_preemptions"], kv_compat=self.kv_compat,
            tokens_per_second=self.loop.num_generated_tokens / elapsed,
            engine_steps=self.loop.num_steps, engine_step_seconds=self.loop.step_seconds,
            engine_decode_only_steps=self.loop.num_decode_only_steps,
            engine_decode_only_seconds=self.loop.decode_only_seconds, engine_idle_seconds=self.loop.idle_seconds,
            engine_prefill_graph_steps=self.loop.num_prefill_graph_steps,
            engine_prefill_graph_seconds=self.loop.prefill_graph_seconds,
            engine_cpu_seconds=self.loop.cpu_seconds, process_cpu_seconds=time.process_time(),
            tensor_parallel_size=self.engine.config.tensor_parallel_size)

    def _rank_died(self, exc: BaseException) -> None:
        """One rank of this tensor-parallel worker died: the whole worker goes (its other ranks
        are stopped by the engine's group), as a worker's death does; under Ray it comes back."""
        logger.error("worker %s: %s; exiting", self.config.worker_id, exc)
        self.engine.shutdown()
        logging.shutdown()
        os._exit(EXIT_RANK_DIED)

    def stop(self, grace: float = 5.0, close_kv: bool = True, wait_engine: bool = True) -> None:
        """Stops the gRPC server (in-flight calls get `grace` seconds) and the engine loop, then
        closes the KV plane. `close_kv=False` leaves the KV plane to the end of the process, for a
        process that is killed next: closing the last UCX endpoint resets ucxx after a full garbage
        collection, seconds in a process that holds a model. `wait_engine=False`, for such a
        process too: the engine loop is told to stop, but the step it is in is not waited for (a
        prefill step takes seconds on a loaded CPU), nor are the other tensor-parallel ranks
        stopped (they end with this process, whose pipe they read)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._grace = grace
        if self._stop_event is not None and self._aio_loop is not None and self._aio_loop.is_running():
            try:
                self._aio_loop.call_soon_threadsafe(self._stop_event.set)
            except RuntimeError:  # the loop closed meanwhile
                pass
        if self._thread is not None:
            self._thread.join(grace + 5)
        self.loop.stop(timeout=5.0 if wait_engine else 0.0)
        for part in (self.sender, self.receiver) if close_kv else ():
            if part is not None:
                try:
                    part.close()
                except Exception:
                    logger.warning("closing the KV transfer backend failed", exc_info=True)
        if wait_engine:
            self.engine.shutdown()  # the other tensor-parallel ranks (nothing at TP=1)

    def wait_for_termination(self) -> None:
        if self._thread is not None:
            self._thread.join()
