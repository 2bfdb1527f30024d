"""A worker's KV plane: the KV sender and receiver it builds over its engine's pools.

`build_kv_plane` (once, after the engine is built and warmed):
0. settings: the process's KV settings (`WorkerConfig.kv_settings`, kvtransfer.settings: staging,
   UCX runtime, trace), before the first sender or receiver; none given: the environment's;
1. layout: every rank's KV heads (worker.kv_routes) and the whole model's KV layout, whose
   fingerprint and `kv_compat` key a peer must share (workers at any two TP degrees of one model
   pair; their endpoints check the head ranges);
2. sender (prefill side, `WorkerConfig.sends_kv`): a routed sender over the backend's, and the
   `KVPusher` the engine's layer hook feeds (worker.kv_push);
3. receiver (decode side, `WorkerConfig.receives_kv`): one backend receiver (TP 1) or a routed one,
   listening on `kv_host` / `kv_interface`; it publishes the address the router hands to P;
4. the FP8 wire codec's kernels compiled before serving, when the layout sends FP8 and warm-up is on.

Backend options (`kv_options`) go to both sides, less what belongs to one: the receiver's address
options are not the sender's, and the sender's pacing, faults and checksum are not the receiver's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

from pdserve.config import EngineConfig
from pdserve.kernels.kv_codec import warm_codec
from pdserve.kvtransfer import WIRE_VERSION, KVLayout, KVReceiver, KVSender, create_receiver, create_sender
from pdserve.kvtransfer.settings import KVSettings, configure as configure_settings
from pdserve.worker.kv_push import KVPusher
from pdserve.worker.kv_routes import RoutedReceiver, RoutedSender, model_layout, rank_heads

logger = logging.getLogger(__name__)


class KVSides(Protocol):
    """What the KV plane reads of a worker's configuration (worker.server.WorkerConfig)."""

    @property
    def worker_id(self) -> str: ...
    @property
    def kv_backend(self) -> str: ...
    @property
    def kv_host(self) -> str: ...
    @property
    def kv_interface(self) -> str | None: ...
    @property
    def kv_options(self) -> tuple[tuple[str, object], ...]: ...
    @property
    def kv_settings(self) -> KVSettings | None: ...
    @property
    def cluster_token(self) -> str | None: ...
    @property
    def sends_kv(self) -> bool: ...
    @property
    def receives_kv(self) -> bool: ...


@dataclass(frozen=True)
class KVPlane:
    """A worker's KV endpoints and what its peers check (module docstring)."""

    layout: KVLayout
    layout_fingerprint: str  # the layout's fingerprint, as Reserve and Prefill carry it
    kv_compat: str  # the key the router pairs workers by
    sender: KVSender | None
    receiver: KVReceiver | None
    pusher: KVPusher | None
    address: str  # the receiver's address ("" without one)


def build_kv_plane(config: KVSides, engine, engine_config: EngineConfig) -> KVPlane:
    """The KV plane of a worker of `config` over the pools of `engine`, built from `engine_config`
    (module docstring); sets the engine's layer hook on the prefill side."""
    configure_settings(config.kv_settings if config.kv_settings is not None else KVSettings.from_environment())
    model = engine_config.model
    kv_caches = engine.runner.kv_caches
    # every rank's KV heads (kv_routes); the fingerprint is the whole model's KV layout, so
    # workers at any two TP degrees of one model pair (their endpoints check the head ranges)
    ranks = rank_heads(engine)
    layout = model_layout(ranks)
    # what a KV peer must share with this worker (the router pairs only equal keys; the
    # transfer handshake refuses the rest); the whole model's KV layout, whatever the TP
    kv_compat = (f"model={model} dtype={layout.dtype} block_size={layout.block_size} "
                 f"layers={layout.num_layers} kv_heads={layout.num_kv_heads} head_dim={layout.head_dim} "
                 f"wire=v{WIRE_VERSION}")
    opts = dict(config.kv_options)
    opts.setdefault("model", model)
    if config.kv_backend != "fake" and config.cluster_token is not None:
        opts.setdefault("token", config.cluster_token)  # KV peers prove it at handshake (kvtransfer.auth)
    sender = None
    receiver = None
    pusher: KVPusher | None = None
    if config.sends_kv:
        # a "pacer" option may be a pacing spec string (kvtransfer.pacing_spec)
        from pdserve.kvtransfer.pacing_spec import sender_options

        receiver_only = ("host", "port", "interface")  # where this worker's receiver listens
        sender_opts = sender_options({k: v for k, v in opts.items() if k not in receiver_only})
        sender = RoutedSender(ranks, lambda caches: create_sender(config.kv_backend, caches, **sender_opts))
        pusher = KVPusher(sender, engine_config.cache.block_size, engine.model_config.num_layers)
        engine.layer_hook = pusher.on_layer
    if config.receives_kv:
        for name in ("pacer", "faults", "checksum"):  # the sender's; one kv_options may serve both roles
            opts.pop(name, None)
        if config.kv_backend != "fake":
            opts.setdefault("host", config.kv_host)
            if config.kv_interface is not None:
                opts.setdefault("interface", config.kv_interface)
        if len(ranks) == 1:
            receiver = create_receiver(config.kv_backend, kv_caches, **opts)
        else:
            receiver = RoutedReceiver(ranks, lambda caches: create_receiver(config.kv_backend, caches, **opts))
    if (config.sends_kv or config.receives_kv) and layout.fp8_wire and engine_config.warmup:
        t = time.perf_counter()
        if warm_codec(kv_caches[0][0]):  # the FP8 wire codec's kernels, compiled before serving
            logger.info("worker %s: FP8 wire codec compiled in %.1fs", config.worker_id, time.perf_counter() - t)
    address = receiver.address() if receiver is not None else ""
    return KVPlane(layout, f"{layout.fingerprint:016x}", kv_compat, sender, receiver, pusher, address)
