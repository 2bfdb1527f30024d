"""`pdserve worker` and `pdserve router`: the two halves without Ray (e.g. plain Kubernetes).

A standalone worker serves in the foreground and prints its address; a standalone router
serves over a fixed list of workers (`--worker role[#id][@node]=host:port`, repeatable).
"""

from __future__ import annotations

import sys
import threading

from pdserve.worker.server import WorkerConfig


def run_worker(config: WorkerConfig) -> int:
    """Loads the model, serves until SIGINT/SIGTERM or until the server stops, then frees it."""
    from pdserve.launcher.cluster.serving import ignore_shutdown_signals, install_shutdown_signals, restore_signals
    from pdserve.worker.server import WorkerServer

    install_shutdown_signals()
    server = None
    try:
        print(f"pdserve worker {config.worker_id}: loading {config.engine.model} ({config.role})",
              file=sys.stderr, flush=True)
        server = WorkerServer(config)
        address = server.start()
        kv = f" kv={server.kv_address}" if server.kv_address else ""
        print(f"pdserve worker {config.worker_id} role={config.role} listening on {address}{kv}", flush=True)
        done = threading.Event()
        waiter = threading.Thread(target=lambda: (server.wait_for_termination(), done.set()), daemon=True)
        waiter.start()
        while not done.wait(0.5):  # wakes up for signals
            pass
    except KeyboardInterrupt:
        pass
    finally:
        ignore_shutdown_signals()
        if server is not None:
            server.stop()
        restore_signals()
    return 0


def run_router(entries: list[str], settings) -> int:
    from pdserve.router.cluster.directory import StaticDirectory, parse_endpoint

    from pdserve.launcher.cluster.serving import (
        build_app,
        install_shutdown_signals,
        load_router_model,
        make_router_policy,
        restore_signals,
        serve_router,
    )

    try:
        directory = StaticDirectory.parse(entries)
    except ValueError as e:
        raise ValueError(f"--worker: {e}") from None
    roles = {parse_endpoint(entry).role for entry in entries}
    if settings.mode == "disaggregated" and not ({"prefill", "decode"} <= roles or "mixed" in roles):
        raise ValueError("--worker: --mode disaggregated needs at least one prefill and one decode worker "
                         "(or mixed workers started with --moves-kv)")
    from pdserve.launcher.cluster.up import check_listen

    check_listen(settings.host, settings.port)
    policy = make_router_policy(settings)
    model = load_router_model(settings.model, settings.max_model_len, settings.served_model_name,
                              tokenizer=settings.tokenizer)
    app, backend = build_app(directory, settings, model, policy)
    if settings.cluster_token is None:
        from pdserve.proto.auth import TOKEN_ENV

        print(f"pdserve router: warning: no --cluster-token-file or ${TOKEN_ENV}: calls to the workers carry no "
              "cluster token (workers that have one refuse them)", file=sys.stderr, flush=True)
    install_shutdown_signals()
    try:
        serve_router(app, backend, settings, on_ready=lambda: print(
            f"pdserve router: serving {model.name} at http://{settings.host}:{settings.port}/v1 over "
            f"{len(entries)} worker(s)", file=sys.stderr, flush=True))
    except KeyboardInterrupt:
        pass
    finally:
        restore_signals()
    return 0
