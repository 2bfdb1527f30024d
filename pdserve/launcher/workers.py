"""One worker, however it is started: the one place that turns a `WorkerSpec` into what starts it.

Every way of starting a cluster builds its workers here:

- a process (`pdserve worker`, `pdserve.launcher.paced`, `pdserve.launcher.emulation`): ``worker_argv(spec)`` and
  ``worker_env(spec)``, the command line of ``python -m pdserve.launcher.cli worker`` and the variables
  to set over the parent's environment (the cluster token never goes on the command line);
- that command itself (`pdserve.launcher.cli`'s ``worker``): ``add_worker_args`` declares its flags,
  ``spec_from_args`` reads them back and ``worker_config`` makes the `WorkerConfig` it serves;
- a Ray actor (`pdserve up`, `pdserve.launcher.cluster.pools`): ``ray_actor(spec, engine, ...)``, the
  actor's options and its constructor's arguments.

A new worker flag is a field of `WorkerSpec` plus its lines in ``add_worker_args``,
``worker_argv`` and ``worker_config``, all in this file (and the `WorkerConfig` field it sets).
"""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.launcher.token_args import add_cluster_token_arg, cluster_token
from pdserve.engine_args import add_tensor_parallel_arg, int_arg

if TYPE_CHECKING:
    from pdserve.config import EngineConfig
    from pdserve.worker.server import WorkerConfig

WORKER_MODULE = "pdserve.launcher.cli"  # `python -m pdserve.launcher.cli worker ...` (the `pdserve worker` command)
ROLES = ("prefill", "decode", "mixed")
# Set in a GPU worker's Ray runtime env: Ray then leaves CUDA_VISIBLE_DEVICES alone, so every worker
# of a node sees all its GPUs and CUDA IPC (UCX cuda_ipc) can map a peer GPU's KV pool; the worker
# selects the GPU Ray assigned it (`pdserve.launcher.cluster.ray_workers.assigned_cuda_index`).
NOSET_VISIBLE_ENV = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker is given, whichever way it starts.

    The first group is the worker's own (`WorkerConfig`); the second says how its process is
    started (a process only: a Ray actor gets an `EngineConfig` and its GPU from Ray)."""

    role: str  # "prefill" | "decode" | "mixed"
    worker_id: str | None = None  # None: <role>-<hostname>[-<port>]
    host: str = "127.0.0.1"  # gRPC bind host (the address others dial)
    port: int = 0  # 0: any free port
    kv_backend: str = "ucx"
    kv_host: str | None = None  # KV listen host; None: host
    kv_port: int = 0  # KV listen port (decode side); 0: any free port
    kv_interface: str | None = None  # local address KV connections must arrive on; None: the KV host; "any"
    moves_kv: bool = False  # a mixed worker that also sends and receives KV (hybrid)
    kv_pacing: str | None = None  # a pacing spec or file:PATH (kvtransfer.pacing_spec)
    # ranks of the worker's engine (pdserve.parallel): rank 0 serves the gRPC and the KV plane and
    # starts ranks 1..N-1 as local processes (same node by construction); the router sees one worker
    tensor_parallel_size: int = 1
    cluster_token: str | None = field(default=None, repr=False)

    model: str | None = None  # --model (None: the CLI's default, or one in engine_args)
    device: str | None = None  # --device, unless engine_args give one
    engine_args: tuple[str, ...] = ()  # further `pdserve worker` flags (engine flags), last
    visible_devices: str | None = None  # CUDA_VISIBLE_DEVICES, in PCI bus order (None: unchanged)
    python: str = sys.executable

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"worker role must be one of {ROLES}, got {self.role!r}")
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"--tensor-parallel-size must be a positive integer, got {tp!r}")


def default_worker_id(role: str, port: int) -> str:
    return f"{role}-{socket.gethostname()}" + (f"-{port}" if port else "")


# ---- a process ----------------------------------------------------------------------------

def worker_argv(spec: WorkerSpec) -> list[str]:
    """The command line of a worker process: ``python -m pdserve.launcher.cli worker ...``."""
    flags = ["--role", spec.role, "--host", spec.host, "--port", str(spec.port)]
    if spec.worker_id is not None:
        flags += ["--worker-id", spec.worker_id]
    if spec.model is not None:
        flags += ["--model", spec.model]
    if spec.device is not None and "--device" not in spec.engine_args:
        flags += ["--device", spec.device]
    if spec.kv_backend != "ucx":
        flags += ["--kv-backend", spec.kv_backend]
    if spec.kv_host is not None:
        flags += ["--kv-host", spec.kv_host]
    if spec.kv_port:
        flags += ["--kv-port", str(spec.kv_port)]
    if spec.kv_interface is not None:
        flags += ["--kv-interface", spec.kv_interface]
    if spec.moves_kv:
        flags += ["--moves-kv"]
    if spec.kv_pacing is not None:
        flags += ["--kv-pacing", spec.kv_pacing]
    if spec.tensor_parallel_size != 1:
        flags += ["--tensor-parallel-size", str(spec.tensor_parallel_size)]
    return [spec.python, "-m", WORKER_MODULE, "worker", *flags, *spec.engine_args]


def worker_env(spec: WorkerSpec) -> dict[str, str]:
    """The variables a worker process gets over its parent's environment."""
    from pdserve.proto.auth import TOKEN_ENV

    env = {}
    if spec.cluster_token is not None:
        env[TOKEN_ENV] = spec.cluster_token
    if spec.visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = spec.visible_devices
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # the indices nvidia-smi shows
    return env


# ---- the `pdserve worker` command ---------------------------------------------------------

def add_worker_args(p: argparse.ArgumentParser) -> None:
    """The flags of `pdserve worker` (besides the engine's), read back by ``spec_from_args``."""
    p.add_argument("--role", required=True, choices=list(ROLES),
                   help="prefill (sends KV), decode (receives KV) or mixed (serves requests whole)")
    p.add_argument("--host", default="127.0.0.1", help="gRPC bind host (the address others dial)")
    p.add_argument("--port", type=int_arg("--port"), default=0, help="gRPC port (0: any free port)")
    p.add_argument("--worker-id", default=None, help="default <role>-<hostname>[-<port>]")
    p.add_argument("--kv-backend", default="ucx", help="KV transfer backend: ucx, or nixl (needs pdserve[nixl])")
    p.add_argument("--kv-host", default=None, help="KV listen host (default: --host)")
    p.add_argument("--kv-port", type=int_arg("--kv-port"), default=0,
                   help="KV listen port of a worker that receives KV (0: any free port); a worker restarted "
                        "on the same port is told apart from its old process by its incarnation")
    p.add_argument("--kv-interface", default=None, metavar="ADDR",
                   help="the local address KV connections must arrive on; one that arrives on another "
                        "interface is refused (default: the KV host, the address the worker advertises; "
                        "'any': every interface)")
    p.add_argument("--moves-kv", action="store_true",
                   help="--role mixed: also send prefilled KV to, and receive KV from, other workers (hybrid)")
    p.add_argument("--kv-pacing", default=None, metavar="SPEC",
                   help="pace this worker's KV sends per destination: a pacing spec (e.g. "
                        "'10.0.0.3=1,default=10', kvtransfer.pacing_spec) or file:PATH of a file holding one, "
                        "re-read when it changes")
    add_tensor_parallel_arg(p)
    add_cluster_token_arg(p)


def spec_from_args(args: argparse.Namespace) -> WorkerSpec:
    """The `WorkerSpec` of parsed `pdserve worker` flags; ValueError naming a bad flag."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if not 0 <= args.kv_port <= 65535:
        raise ValueError(f"--kv-port must be in 0..65535, got {args.kv_port}")
    if args.moves_kv and args.role != "mixed":
        raise ValueError(f"--moves-kv applies to --role mixed, not --role {args.role}")
    if args.kv_pacing is not None:
        check_pacing(args.kv_pacing)
    return WorkerSpec(role=args.role, worker_id=args.worker_id, host=args.host, port=args.port,
                      kv_backend=args.kv_backend, kv_host=args.kv_host, kv_port=args.kv_port,
                      kv_interface=args.kv_interface, moves_kv=args.moves_kv,
                      kv_pacing=args.kv_pacing, tensor_parallel_size=args.tensor_parallel_size,
                      cluster_token=cluster_token(args))


def check_pacing(text: str) -> None:
    """ValueError naming --kv-pacing when `text` is not a pacing spec (or its file cannot be read)."""
    from pdserve.kvtransfer.pacing_spec import FILE_PREFIX, parse_pacing, read_pacing_file

    try:
        if text.startswith(FILE_PREFIX):
            read_pacing_file(text[len(FILE_PREFIX):])
        else:
            parse_pacing(text)
    except ValueError as e:
        raise ValueError(f"--kv-pacing: {e}") from None


def worker_config(spec: WorkerSpec, engine: EngineConfig) -> WorkerConfig:
    """The `WorkerConfig` a worker serves with (in its own process or in a Ray actor); the
    spec's tensor-parallel size is the engine's. The KV plane's variables (PDSERVE_KV_FAULTS,
    PDSERVE_KV_TRACE, ..., pdserve.environment) are read here, in the process that starts the
    worker, and travel in the config; ValueError naming a bad one."""
    import dataclasses

    from pdserve import environment
    from pdserve.kvtransfer.faults import FAULTS_ENV, FAULTS_OPTION, parse_faults
    from pdserve.kvtransfer.pacing_spec import PACER_OPTION
    from pdserve.kvtransfer.settings import KVSettings
    from pdserve.worker.server import WorkerConfig

    if engine.tensor_parallel_size != spec.tensor_parallel_size:
        engine = dataclasses.replace(engine, tensor_parallel_size=spec.tensor_parallel_size)
    kv_options: tuple[tuple[str, object], ...] = ((PACER_OPTION, spec.kv_pacing),) if spec.kv_pacing is not None else ()
    faults = environment.get(FAULTS_ENV)  # fault injection (tests, experiments/faults.py); off unless set
    if faults:
        try:
            parse_faults(faults)
        except ValueError as e:
            raise ValueError(f"{FAULTS_ENV}: {e}") from None
        kv_options += ((FAULTS_OPTION, faults),)
    if spec.kv_port:
        kv_options += (("port", spec.kv_port),)
    return WorkerConfig(
        worker_id=spec.worker_id or default_worker_id(spec.role, spec.port), role=spec.role, engine=engine,
        host=spec.host, port=spec.port, kv_backend=spec.kv_backend, kv_host=spec.kv_host or spec.host,
        kv_interface=spec.kv_interface, kv_options=kv_options, kv_settings=KVSettings.from_environment(),
        cluster_token=spec.cluster_token, moves_kv=spec.moves_kv)


# ---- a Ray actor --------------------------------------------------------------------------

def ray_actor(spec: WorkerSpec, engine: EngineConfig, *, namespace: str, num_cpus: float, num_gpus: float,
              resources: Mapping[str, float], scheduling_strategy: Any) -> tuple[dict[str, Any], tuple]:
    """(options for ``ray.remote(WorkerActor).options(...)``, arguments for its ``.remote(...)``) of
    a pool worker named ``spec.worker_id``. Ray restarts it when it dies; a GPU worker sees every
    GPU of its node (``NOSET_VISIBLE_ENV``), for CUDA IPC between workers.

    `num_cpus` and `num_gpus` are per rank: a worker at tensor-parallel size N is one actor that
    asks for N times them (one Ray resource request, so one node) and starts its ranks 1..N-1 as
    local processes; Ray then masks CUDA_VISIBLE_DEVICES to its N GPUs, which rank r uses as
    cuda:r."""
    if spec.worker_id is None:
        raise ValueError("a Ray worker needs its actor name as worker_id")
    tp = spec.tensor_parallel_size
    options = dict(name=spec.worker_id, namespace=namespace, lifetime=None, max_restarts=-1, max_task_retries=0,
                   num_cpus=num_cpus * tp, num_gpus=num_gpus * tp, resources=dict(resources),
                   runtime_env={"env_vars": {NOSET_VISIBLE_ENV: "1"}} if num_gpus and tp == 1 else None,
                   scheduling_strategy=scheduling_strategy)
    return options, (worker_config(spec, engine),)
