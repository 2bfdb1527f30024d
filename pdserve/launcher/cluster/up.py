"""`pdserve up`: Ray, the worker pools and the router, in one foreground command.

1. Check the config and load the router's tokenizer (a bad --model fails before Ray starts).
2. Start a local Ray (small footprint, no dashboard), or join `--address`.
3. Place the pools and create the worker actors; wait for every worker, with a progress bar.
4. Serve the router (HTTP) over a `RayDirectory` of the actors; with `--autoscale`, the planner
   loop runs beside it on the router's event loop (`pdserve.launcher.autoscale.loop`) and resizes the pools.
5. On Ctrl-C or SIGTERM, at any step, to this process or to its whole process group, or when
   Ray dies under it: the router drains, aborts what is left and closes while the workers'
   servers stop (all at once; none waits for its engine's step in progress). A Ray we started
   then ends with its processes, as `ray.shutdown` ends them but without a call to Ray (a
   signal to the process group has reached its GCS and raylet too, which then answer nothing);
   on a joined cluster the actors are killed and the placement groups removed. Every step is
   bounded, and whatever is left of the processes we started is killed (and said so), so that
   all is gone within 15 s (`pdserve.launcher.cluster.shutdown`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
import sys
import threading
import time

from pdserve.launcher.cluster.config import UpConfig, router_mode

logger = logging.getLogger(__name__)

ROUTER_DRAIN_S = 2.5  # in-flight requests get this long to finish at shutdown

def gpu_share(config: UpConfig, gpus_in_cluster: float) -> float:
    """GPUs per engine rank (a worker at tensor-parallel size N has N ranks): ``--worker-gpus``
    when given, else one each when the cluster has that many, else an even share of them (two
    workers on one GPU: 0.5 each). ValueError, naming the flags that fit, when the pools cannot
    fit at all: Ray would wait for them forever."""
    workers = config.num_ranks()
    if config.worker_gpus is None:
        if gpus_in_cluster <= 0:
            return 0.0
        if workers <= gpus_in_cluster:
            return 1.0
        share = math.floor(gpus_in_cluster / workers * 100) / 100  # Ray takes two decimals
        if share <= 0:
            raise ValueError(f"{workers} workers cannot share {gpus_in_cluster:g} GPU(s); use fewer workers "
                             "(--prefill/--decode/--replicas) or --worker-gpus 0 for CPU workers")
        logger.warning("%d workers on %g GPU(s): each gets %g of a GPU (set --worker-gpus to choose)",
                       workers, gpus_in_cluster, share)
        return share
    need = workers * config.worker_gpus
    if need > gpus_in_cluster + 1e-9:
        fits = round(gpus_in_cluster / workers, 2) if gpus_in_cluster else 0
        raise ValueError(
            f"--worker-gpus {config.worker_gpus:g}: {workers} workers need {need:g} GPU(s), the Ray cluster has "
            f"{gpus_in_cluster:g}; use --worker-gpus {fits:g}, --mode colocated, or fewer workers "
            "(--prefill/--decode/--replicas)")
    return config.worker_gpus


def worker_device_type(device: str | None, num_gpus: float) -> str:
    """The device type ("cuda" or "cpu") a worker with `num_gpus` runs on (--device wins)."""
    if device is not None:
        return device.split(":", 1)[0]
    return "cuda" if num_gpus > 0 else "cpu"


def engine_sizes(config: UpConfig, num_gpus: float) -> str:
    """The scheduler sizes workers with `num_gpus` each get, and where they came from, in one
    line: "max_num_batched_tokens=8192 max_num_seqs=256 (defaults for cuda)"."""
    from pdserve.config import SchedulerConfig, resolve_scheduler

    device = worker_device_type(config.device, num_gpus)
    return resolve_scheduler(SchedulerConfig(max_num_batched_tokens=config.max_num_batched_tokens,
                                             max_num_seqs=config.max_num_seqs), device)[1]


def pool_specs(config: UpConfig, gpus_in_cluster: float, cluster_token: str | None = None):
    """One PoolSpec per role. The engine's scheduler sizes not given are resolved here for the
    workers' device (`pdserve.config.resolve_scheduler`) and sent to them explicitly."""
    from pdserve.launcher.cluster.pools import PoolSpec
    from pdserve.config import resolve_scheduler
    from pdserve.engine_args import ENGINE_DEFAULTS, engine_config

    num_gpus = gpu_share(config, gpus_in_cluster)
    values = config.engine_values()
    if num_gpus == 0 and values["device"] is None:
        values["device"] = "cpu"  # a worker without a GPU share must not grab one
    if 0 < num_gpus < 1 and values["gpu_memory_fraction"] == ENGINE_DEFAULTS["gpu_memory_fraction"]:
        # workers sharing a GPU start together and each reads the free memory: give each its share
        values["gpu_memory_fraction"] = round(values["gpu_memory_fraction"] * num_gpus, 4)
    scheduler, _ = resolve_scheduler(engine_config(values).scheduler, worker_device_type(values["device"], num_gpus))
    values["max_num_batched_tokens"], values["max_num_seqs"] = scheduler.max_num_batched_tokens, scheduler.max_num_seqs
    return [
        PoolSpec(role=role, size=size, engine=engine_config({**values, "tensor_parallel_size": config.pool_tp(role)},
                                                            role),
                 tensor_parallel_size=config.pool_tp(role), num_cpus=config.worker_cpus,
                 num_gpus=num_gpus, resources=config.pool_resources(role), strategy=config.placement_strategy,
                 kv_backend=config.kv_backend, cluster_token=cluster_token,
                 moves_kv=config.mode == "hybrid")
        for role, size in config.pool_sizes().items()
    ]


def _autoscale_profile(config: UpConfig):
    """The profile `up_load: auto` reads: `autoscale.profile`, else the cluster's --profile (the
    network-aware policy's), else None (also when up_load is not auto: nothing is read). A bad
    `autoscale.profile` is a ValueError naming it (run before Ray starts); a bad --profile is the
    policy's to report."""
    from pdserve.launcher.autoscale.rule import AUTO
    from pdserve.router.placement.profiles import load_profile

    if config.autoscale is None or config.autoscale.up_load != AUTO:
        return None
    own = getattr(config.autoscale, "profile", None)
    if own:
        try:
            return load_profile(own)
        except ValueError as exc:
            raise ValueError(f"autoscale.profile: {exc}") from None
    if not config.profile:
        return None
    try:
        return load_profile(config.profile)
    except ValueError as exc:
        logger.warning("autoscale: the profile is not used for up_load: %s", exc)
        return None


def _policy_slos(config: UpConfig) -> dict:
    """The SLOs the placement policy gets: all given, except that with --autoscale they are the
    autoscaler's, and a policy that does not use them (all but network-aware) gets none."""
    if config.autoscale is not None and config.policy != "network-aware":
        return {"slo_ttft": None, "slo_tpot": None}
    return {"slo_ttft": config.slo_ttft, "slo_tpot": config.slo_tpot}


def check_tensor_parallel_pools(config: UpConfig, num_local_gpus: int | None = None) -> None:
    """One-line ValueError naming the flag when a pool's tensor-parallel size cannot split the
    model, or (CUDA workers) asks for more GPUs than one node has: run before Ray starts.
    `num_local_gpus`: the GPUs of this machine, checked when we start the Ray ourselves."""
    from pdserve.loaders import load_model_source
    from pdserve.parallel.layout import check_tensor_parallel

    sizes = {role: config.pool_tp(role) for role in config.pool_sizes()}
    if all(tp == 1 for tp in sizes.values()):
        return
    model = load_model_source(config.model, config.tokenizer).config
    device = worker_device_type(config.device, 1.0 if num_local_gpus else 0.0)
    for role, tp in sizes.items():
        own = {"prefill": "--prefill-tp", "decode": "--decode-tp"}.get(role)
        named = own if own and getattr(config, f"{role}_tp") is not None else "--tensor-parallel-size"
        try:
            check_tensor_parallel(model, tp, expert_parallel=config.expert_parallel, device_type=device,
                                  num_gpus=num_local_gpus if config.address is None else None)
        except ValueError as e:
            raise ValueError(str(e).replace("--tensor-parallel-size", named, 1)) from None


def check_listen(host: str, port: int, flag: str = "--port") -> None:
    """ValueError naming `flag` when host:port cannot be listened on (in use, bad host)."""
    try:
        socket.create_server((host, port)).close()
    except OSError as e:
        raise ValueError(f"{flag}: cannot listen on {host}:{port} ({_reason(e)})") from None


def check_ray_address(address: str, timeout_s: float = 5.0) -> None:
    """A quick reachability check, so that a wrong --address fails in seconds, not after Ray's
    minute of retries (e.g. "auto" finding a stale /tmp/ray/ray_current_cluster)."""
    target = address
    if address == "auto":
        try:  # Ray's own resolution of "auto" (RAY_ADDRESS, then the last `ray start`); private API
            from ray._private.services import canonicalize_bootstrap_address

            target = canonicalize_bootstrap_address(address)
        except Exception:
            return  # Ray reports it
        if not target:
            return
    host, _, port = target.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--address: expected auto, host:port or ray://host:port, got {address!r}")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        where = address if target == address else f"{target} (from --address {address})"
        raise ValueError(f"--address: cannot reach Ray at {where} ({_reason(e)})") from None


def _reason(e: OSError) -> str:
    return os.strerror(e.errno) if e.errno else str(e) or type(e).__name__


def _local_gpus(config: UpConfig) -> int | None:
    """The GPUs a Ray we start would have (None: CPU workers, or a Ray we join)."""
    if config.address is not None or (config.device or "").startswith("cpu") or config.worker_gpus == 0:
        return None
    import torch

    return torch.cuda.device_count() or None


def _start_ray(config: UpConfig) -> bool:
    """Starts or joins Ray; True when we started it (and so must shut it down)."""
    import ray

    if ray.is_initialized():
        raise RuntimeError("Ray is already initialized in this process")
    common = dict(namespace=config.namespace, include_dashboard=False, log_to_driver=True,
                  configure_logging=True, logging_level=logging.WARNING)
    if config.address:
        check_ray_address(config.address)
        try:
            ray.init(address=config.address, **common)
        except ConnectionError as e:
            raise ValueError(f"--address: cannot connect to Ray at {config.address}: {e}") from None
        return False
    needed_cpus = config.worker_cpus * config.num_ranks()
    # A Ray we start is this machine alone: keep its nodes, gRPC and KV on loopback.
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, int(needed_cpus + 0.999)),
             object_store_memory=config.ray_object_store_mb * 1024 * 1024, _node_ip_address="127.0.0.1",
             **common)
    return True


def run_up(config: UpConfig, log_level: str = "warning") -> int:
    """Starts the workers and serves the router until SIGINT/SIGTERM; then stops everything it
    started and exits the process with its status (returns only for a configuration error)."""
    from tqdm import tqdm

    from pdserve.launcher.cluster.pools import ClusterPools, ClusterStartError
    from pdserve.launcher.cluster.serving import (
        RouterSettings,
        build_app,
        ignore_shutdown_signals,
        install_shutdown_signals,
        load_router_model,
        make_router_policy,
        restore_signals,
        serve_router,
    )
    from pdserve.engine_args import engine_config

    from pdserve.kvtransfer.settings import KVSettings

    engine_config(config.engine_values())  # bad engine values fail here, before Ray starts
    KVSettings.from_environment()  # and bad KV plane variables (the workers' config takes them)
    check_tensor_parallel_pools(config, _local_gpus(config))
    check_listen(config.host, config.port)
    autoscale_profile = _autoscale_profile(config)
    model = load_router_model(config.model, config.max_model_len, config.served_model_name,
                              tokenizer=config.tokenizer)
    from pdserve.proto.auth import new_token

    cluster_token = new_token()  # the request plane's: workers get it through Ray, the router here
    settings = RouterSettings(model=config.model, tokenizer=config.tokenizer,
                              served_model_name=config.served_model_name,
                              max_model_len=config.max_model_len, policy=config.policy, mode=router_mode(config.mode),
                              max_batch=config.max_num_seqs,
                              host=config.host, port=config.port, api_key=config.api_key,
                              kv_deadline_s=config.kv_deadline_s, kv_wire_precision=config.kv_wire_precision,
                              worker_wait_s=config.worker_wait_s,
                              max_tokens_default=config.max_tokens_default, usage_timing=config.usage_timing,
                              max_queued_requests=config.max_queued_requests, queue_timeout_s=config.queue_timeout_s,
                              log_level=log_level.lower(),
                              topology=config.topology, profile=config.profile, **_policy_slos(config),
                              admission_control=config.admission_control,
                              calibrate=not config.no_calibration, local_prefill=not config.no_local_prefill,
                              graceful_shutdown_s=ROUTER_DRAIN_S, cluster_token=cluster_token)
    policy = make_router_policy(settings)

    import ray

    from pdserve.launcher.cluster.shutdown import ProcessTracker, RayWatchdog

    stopping = threading.Event()  # set at the first SIGINT/SIGTERM
    install_shutdown_signals(stopping.set)
    started_ray = config.address is None  # ours to shut down, even if interrupted while starting
    tracker = ProcessTracker().start() if started_ray else None  # what we may kill at the end
    watchdog: RayWatchdog | None = None
    pools: ClusterPools | None = None
    code = 0
    try:
        _start_ray(config)
        install_shutdown_signals(stopping.set)  # ray.init installs its own SIGTERM handler
        if tracker is not None:
            tracker.scan()
        watchdog = RayWatchdog(tracker, None if started_ray else ray.get_runtime_context().gcs_address,
                               stopping=stopping).start()
        gpus = ray.cluster_resources().get("GPU", 0.0)
        try:
            specs = pool_specs(config, gpus, cluster_token)
        except ValueError as e:
            print(f"pdserve: error: {e}", file=sys.stderr)
            return 2
        if config.max_num_seqs is None and specs:  # network-aware's hybrid model needs the workers' value
            settings = dataclasses.replace(settings, max_batch=specs[0].engine.scheduler.max_num_seqs)
            policy = make_router_policy(settings)
        sizes = engine_sizes(config, specs[0].num_gpus if specs else 0.0)
        logger.info("engine: %s", sizes)
        print(f"pdserve up: engine: {sizes}", file=sys.stderr, flush=True)
        pools = ClusterPools(config.cluster_name, config.namespace, specs)
        total = sum(s.size for s in specs)
        print(f"pdserve up: starting {_describe(specs)} on Ray "
              f"({'local' if started_ray else config.address}, namespace {config.namespace})",
              file=sys.stderr, flush=True)
        pools.start(config.startup_timeout_s)
        with tqdm(total=total, desc="workers ready", unit="worker", file=sys.stderr) as bar:
            health = pools.wait_ready(config.startup_timeout_s, on_ready=lambda name, h: bar.update(1))
        for name, h in sorted(health.items()):
            logger.info("%s at %s on node %s (pid %s)", name, h["address"], h["node_id"][:12], h["pid"])
            if h.get("startup"):
                print(f"pdserve up: {name} ready (warm): {h['startup']}", file=sys.stderr, flush=True)
        max_len = min([model.max_model_len] + [h["max_model_len"] for h in health.values() if h.get("max_model_len")])
        model.max_model_len = max_len

        from pdserve.launcher.cluster.directory import RayDirectory

        directory = RayDirectory(config.namespace, config.cluster_name, pools.names)
        wrap_backend, background = None, ()
        if config.autoscale is not None:
            from pdserve.launcher.autoscale.loop import attach

            wrap_backend, background = attach(
                config.autoscale, pools, directory, slo_ttft=config.slo_ttft, slo_tpot=config.slo_tpot,
                max_num_seqs=specs[0].engine.scheduler.max_num_seqs, profile=autoscale_profile,
                on_change=lambda what: print(f"pdserve up: autoscale: {what}", file=sys.stderr, flush=True))
        app, backend = build_app(directory, settings, model, policy, wrap_backend=wrap_backend)
        scheme_host = f"http://{config.host}:{config.port}"

        def ready() -> None:
            print(f"pdserve up: serving {model.name} at {scheme_host}/v1 ({total} workers, {config.mode}, "
                  f"policy {config.policy}); Ctrl-C to stop", file=sys.stderr, flush=True)

        def stop_workers() -> None:  # while the router closes: its aborts then wait for no engine step
            pools.stop_servers(grace_s=SHUTDOWN_WORKERS_S / 2, alive=_worker_alive if started_ray else None)

        serve_router(app, backend, settings, on_ready=ready, background=background, on_signal=stopping.set,
                     on_drained=stop_workers)
    except KeyboardInterrupt:
        pass
    except ClusterStartError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        code = 1
    finally:
        ignore_shutdown_signals()
        _shutdown(pools, watchdog, tracker, started_ray)
        restore_signals()
    from pdserve.launcher.cluster.shutdown import hard_exit

    # What we started is gone: exit now, clean or not. Ray's atexit hook would wait a minute for
    # a dead GCS, and the interpreter's own teardown (a full garbage collection of a heap holding
    # torch, the tokenizer and Ray's client) takes seconds on a loaded host (docs/results.md,
    # "Figures behind the code's choices").
    hard_exit(code)
    return code  # not reached


# Time budget of the shutdown after the router has stopped (the router's own drain is
# RouterSettings.graceful_shutdown_s, twice at most); the whole stays under 15 s.
SHUTDOWN_WORKERS_S = 4.0
SHUTDOWN_HARD_DEADLINE_S = 8.5
# what ray.shutdown gives each of its processes between SIGTERM and SIGKILL
RAY_PROCESS_GRACE_S = 1.0


def _shutdown(pools, watchdog, tracker, started_ray: bool) -> bool:
    """Stops the workers and Ray, each step bounded; kills what is left of what we started.
    False when Ray had died under us or a step had to be abandoned (the caller then exits hard)."""
    import ray

    from pdserve.launcher.cluster.shutdown import HardDeadline, run_bounded

    deadline = HardDeadline(tracker, SHUTDOWN_HARD_DEADLINE_S).arm()
    died = None  # why Ray died under us, before any stop was asked for (or a joined cluster's is gone)
    if watchdog is not None:
        watchdog.stop()
        # a signal to our process group takes down a Ray we started, not a joined cluster's GCS
        died = watchdog.dead_reason or (None if started_ray else watchdog.check())
    clean = died is None
    if ray.is_initialized():
        print("pdserve up: shutting down" + (f" ({died})" if died else ""), file=sys.stderr, flush=True)
    start = time.monotonic()
    if pools is not None and clean:
        # done already when the router ran its on_drained; direct calls to the actors, no GCS needed
        alive = _worker_alive if started_ray else None
        clean = run_bounded(lambda: pools.stop_servers(grace_s=SHUTDOWN_WORKERS_S / 2, alive=alive),
                            SHUTDOWN_WORKERS_S, "stopping the workers")
        logger.info("workers stopped in %.2fs", time.monotonic() - start)
    if not started_ray:
        if pools is not None and clean and ray.is_initialized():
            clean = run_bounded(lambda: pools.shutdown(grace_s=SHUTDOWN_WORKERS_S / 2), SHUTDOWN_WORKERS_S,
                                "removing the workers from the Ray cluster")
    elif tracker is not None:
        # Ray's processes end as ray.shutdown ends them, without its calls to a GCS that a signal
        # to our process group may have stopped already (it then answers none, and never exits)
        tracker.stop()
        workers = {w.pid for w in pools.workers if w.pid} if pools is not None and clean else set()
        killed, left = tracker.end_all(RAY_PROCESS_GRACE_S, kill_at_once=workers)
        logger.info("Ray and the workers ended %.2fs into the shutdown%s%s", time.monotonic() - start,
                    f" ({len(killed)} after their grace: {', '.join(killed)})" if killed else "",
                    f"; killed, still exiting: {', '.join(left)}" if left else "")
        if not clean and killed:
            logger.warning("killed what was left of the cluster: %s", ", ".join(killed))
    deadline.cancel()
    return clean


def _worker_alive(worker) -> bool:
    """Whether a worker of a Ray we started (this machine alone) still runs: False once its
    process is gone (with the raylet that a signal to our process group stopped, say)."""
    from pdserve.launcher.cluster.shutdown import pid_running

    return worker.pid is None or pid_running(worker.pid)


def _describe(specs) -> str:
    parts = [f"{s.size} {s.role}" for s in specs]
    first = specs[0]
    each = f"{first.num_gpus:g} GPU" if first.num_gpus else f"{first.num_cpus:g} CPU"
    return " + ".join(parts) + f" worker(s), {each} each"
