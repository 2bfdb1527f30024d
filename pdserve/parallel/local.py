"""Ranks 1..N-1 of a tensor-parallel engine as local processes; rank 0 is the caller.

    group = LocalTPGroup.start(config)     # spawns the followers, joins the process group
    runner = load_rank_runner(config, source, 0, group.comm, group.channel)
    ...                                    # rank 0 runs the engine; each step is published
    group.close()

Start-up: the followers are spawned (`torch.multiprocessing`, "spawn") with a pipe each and a
free TCP port for the `torch.distributed` rendezvous. Each says hello once its imports are
done; rank 0 waits for every hello (seeing a follower that dies or reports an error), then all
ranks join the process group, load their shard and agree on the number of KV blocks.

KV pools: for a worker whose KV moves (prefill and decode roles), each follower then shares
its KV pools with rank 0 (shared memory on CPU, CUDA IPC on GPU; `LocalTPGroup.peer_kv_caches`),
so that rank 0's KV plane reads and writes every rank's heads (kvtransfer.shards).

Steps: rank 0 publishes each step on the pipes (`PipeChannel`, one pickle per step); each
follower runs `ModelRunner.follow` on its end. Nothing of the step goes through a collective
outside the forward, so an idle engine has no timeout to run into.

Failure: a follower that raises sends its error on its pipe and exits; a follower whose pipe
closes (rank 0 gone) exits. Rank 0 checks that every follower is alive before publishing, and
a collective whose peer died fails (gloo: the connection closes; both: the process group's
timeout, `TPComm` DEFAULT_TIMEOUT_S). `LocalTPGroup.failure` turns either into a `TPRankError`
naming the rank and stops the others: a rank that dies takes the whole engine down.

The channel is the seam for other hosts of rank 0: a Ray actor holding rank 0 would publish
on a channel to follower actors (and `follow` them with a matching `StepSource`) instead.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from pdserve.config import EngineConfig, KernelConfig
from pdserve.kernels import dispatch as kernel_dispatch
from pdserve.loaders import ModelSource, load_model_source
from pdserve.model_runner import ModelRunner, StepChannel, resolve_device, resolve_dtype
from pdserve.parallel.comm import DEFAULT_TIMEOUT_S, TPComm
from pdserve.parallel.errors import TPRankError
from pdserve.parallel.layout import TPLayout

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 180.0  # spawn + imports of every follower
JOIN_TIMEOUT_S = 10.0  # a follower's exit after ("stop",) before it is terminated
HOST = "127.0.0.1"


def free_port(host: str = HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """cuda:<rank> on CUDA (one GPU per rank, selected as this process's current device), else cpu."""
    device = resolve_device(config.device)
    if device.type != "cuda":
        return device
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def load_rank_runner(config: EngineConfig, source: ModelSource, device: torch.device, comm: TPComm | None,
                     channel: StepChannel | None = None) -> ModelRunner:
    """The `ModelRunner` of one rank: its shard of `source`'s weights (each tensor cut as it is
    read) and the KV pools of its KV heads. Rank 0 passes the `channel` it publishes steps on."""
    size = comm.size if comm is not None else 1
    layout = TPLayout(source.config, comm.rank if comm is not None else 0, size, config.expert_parallel)
    if size > 1:
        logger.info("tensor parallel %s", layout.describe())
    dtype = resolve_dtype(config.dtype, device)
    shard = layout.shard_index if size > 1 else None
    return ModelRunner(source.config, source.iter_weights(device, shard=shard), config.cache, device, dtype,
                       config.seed, layout if size > 1 else None, comm, channel)


@dataclass(frozen=True)
class _RankSpec:
    config: EngineConfig
    rank: int
    size: int
    port: int
    timeout_s: float
    share_kv: bool = False  # send this rank's KV pools to rank 0 once loaded


class PipeChannel:
    """Rank 0's `StepChannel` over one pipe per follower."""

    def __init__(self, group: "LocalTPGroup") -> None:
        self._group = group

    def publish(self, message: tuple) -> None:
        self._group.check_alive()
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in self._group.conns.items():
            try:
                conn.send_bytes(data)
            except (OSError, EOFError) as exc:
                raise self._group.failure(exc) from exc


class PipeSource:
    """A follower's `StepSource`: the next message rank 0 published on its pipe."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def receive(self) -> tuple:
        return pickle.loads(self._conn.recv_bytes())


class LocalTPGroup:
    """Rank 0's handle on ranks 1..N-1 of one engine, started as local processes."""

    def __init__(self, config: EngineConfig, procs: dict, conns: dict[int, Connection]) -> None:
        self.config = config
        self.size = config.tensor_parallel_size
        self.procs = procs
        self.conns = conns
        self.comm: TPComm | None = None
        self.channel = PipeChannel(self)
        self.error: TPRankError | None = None
        self._closed = False
        self._finalizer = weakref.finalize(self, _terminate, dict(procs))

    @classmethod
    def start(cls, config: EngineConfig, *, start_timeout_s: float = START_TIMEOUT_S,
              timeout_s: float = DEFAULT_TIMEOUT_S, share_kv: bool = False) -> "LocalTPGroup":
        """Spawns ranks 1..N-1, waits for them, and joins the process group as rank 0.
        `share_kv`: the followers share their KV pools (`peer_kv_caches`) once loaded."""
        size = config.tensor_parallel_size
        device = rank_device(config, 0)
        port = free_port()
        ctx = torch.multiprocessing.get_context("spawn")
        procs, conns = {}, {}
        for rank in range(1, size):
            parent, child = ctx.Pipe(duplex=True)
            spec = _RankSpec(config, rank, size, port, timeout_s, share_kv)
            proc = ctx.Process(target=follower_main, args=(spec, child), name=f"pdserve-tp-rank{rank}", daemon=True)
            proc.start()
            child.close()
            procs[rank], conns[rank] = proc, parent
        group = cls(config, procs, conns)
        try:
            group._wait_hello(start_timeout_s)
            group.comm = TPComm.init(backend_for(device), HOST, port, 0, size, timeout_s)
        except BaseException:
            group.close()
            raise
        return group

    def _wait_hello(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        waiting = set(self.conns)
        while waiting:
            for rank in sorted(waiting):
                conn = self.conns[rank]
                if conn.poll(0.05):
                    try:
                        kind, detail = conn.recv()
                    except EOFError:
                        raise self.failure(None) from None
                    if kind == "error":
                        raise TPRankError(f"tensor-parallel rank {rank} failed to start: {detail}")
                    waiting.discard(rank)
                elif not self.procs[rank].is_alive():
                    raise self.failure(None)
            if waiting and time.monotonic() > deadline:
                raise TPRankError(f"tensor-parallel ranks {sorted(waiting)} did not start within "
                                  f"{timeout_s:.0f} s")

    def peer_kv_caches(self, timeout_s: float = START_TIMEOUT_S) -> dict[int, list]:
        """Rank -> the KV pools of that follower (`share_kv`), mapped into this process: per
        layer (K, V), the same memory the follower's forward reads and writes."""
        out: dict[int, list] = {}
        deadline = time.monotonic() + timeout_s
        for rank, conn in self.conns.items():
            while not conn.poll(0.05):
                if not self.procs[rank].is_alive() or time.monotonic() > deadline:
                    raise self.failure(None)
            try:
                kind, detail = conn.recv()
            except (EOFError, OSError) as exc:
                raise self.failure(exc) from exc
            if kind == "error":
                self.error = TPRankError(f"tensor-parallel engine stopped: rank {rank}: {detail}")
                self._stop_all()
                raise self.error
            if kind != "kv":
                raise TPRankError(f"tensor-parallel rank {rank} sent {kind!r}, expected its KV pools")
            out[rank] = detail
        return out

    # ---- failures --------------------------------------------------------------------------
    def check_alive(self) -> None:
        if self.error is not None:
            raise self.error
        if any(proc.exitcode is not None for proc in self.procs.values()):
            raise self.failure(None)

    def failure(self, cause: BaseException | None, wait_s: float = 2.0) -> TPRankError:
        """The error of a failed step (or start): names the rank that died or reported an error,
        stops every other follower, and is raised again by every later step."""
        if self.error is not None:
            return self.error
        deadline = time.monotonic() + wait_s
        reports: list[str] = []
        while True:  # a dead peer's collective may fail before its exit code is in
            for rank, conn in self.conns.items():
                try:
                    while conn.poll(0):
                        kind, detail = conn.recv()
                        if kind == "error":
                            reports.append(f"rank {rank}: {detail}")
                except (EOFError, OSError):
                    pass
            dead = {r: p.exitcode for r, p in self.procs.items() if p.exitcode is not None}
            if dead or reports or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if reports:
            what = "; ".join(reports)
        elif dead:
            what = ", ".join(f"rank {r} exited with code {code}" for r, code in sorted(dead.items()))
        else:
            detail = str(cause).strip().splitlines()[0] if cause and str(cause).strip() else ""
            what = f"a collective failed ({type(cause).__name__}: {detail})"
        self.error = TPRankError(f"tensor-parallel engine stopped: {what}")
        self._stop_all()
        return self.error

    # ---- shutdown --------------------------------------------------------------------------
    def close(self, timeout_s: float = JOIN_TIMEOUT_S) -> None:
        """Stops the followers (("stop",), then terminate, then kill) and leaves the group."""
        if self._closed:
            return
        self._closed = True
        if self.error is None:
            data = pickle.dumps(("stop",))
            for conn in self.conns.values():
                try:
                    conn.send_bytes(data)
                except (OSError, EOFError):
                    pass
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        self._stop_all()
        for conn in self.conns.values():
            conn.close()
        if self.comm is not None:
            self.comm.close()
        self._finalizer.detach()

    def _stop_all(self) -> None:
        _terminate(self.procs)


def _terminate(procs: dict) -> None:
    for proc in procs.values():
        if proc.exitcode is None:
            proc.terminate()
    for proc in procs.values():
        proc.join(JOIN_TIMEOUT_S / 2)
        if proc.exitcode is None:
            proc.kill()
            proc.join(JOIN_TIMEOUT_S / 2)


def follower_main(spec: _RankSpec, conn: Connection) -> None:
    """Rank `spec.rank` (>= 1): joins the group, loads its shard, runs what rank 0 publishes."""
    try:
        kernels = spec.config.kernels or KernelConfig()  # rank 0's engine resolved them
        kernel_dispatch.configure(kernels.backend, kernels.prefill_attention)
        device = rank_device(spec.config, spec.rank)
        if spec.config.seed is not None:
            torch.manual_seed(spec.config.seed)
        conn.send(("hello", os.getpid()))
        comm = TPComm.init(backend_for(device), HOST, spec.port, spec.rank, spec.size, spec.timeout_s)
        source = load_model_source(spec.config.model, spec.config.tokenizer)
        runner = load_rank_runner(spec.config, source, device, comm)
        if spec.share_kv:
            for k, v in runner.kv_caches:  # on CPU: into shared memory (in place); CUDA: IPC handles
                if not k.is_cuda:
                    k.share_memory_()
                    v.share_memory_()
            conn.send(("kv", [(k, v) for k, v in runner.kv_caches]))
        runner.follow(PipeSource(conn))
    except (EOFError, BrokenPipeError):  # rank 0 is gone: so is this engine
        os._exit(0)
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0, then this rank exits
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        try:
            conn.send(("error", f"{type(exc).__name__}: {text}"))
        except (OSError, EOFError):
            pass
        os._exit(1)
    comm.close()
    conn.close()
