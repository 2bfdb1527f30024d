"""A kvtransfer peer in a separate process (multiprocessing spawn), driven over a Pipe.

The child holds at most one receiver and one sender, built over KV caches made by
``make_caches`` so both processes can compute the expected bytes. Exceptions in the
child come back as ``PeerError`` carrying the exception's type name and message.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import traceback
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheSpec:
    num_layers: int = 3
    num_blocks: int = 16
    block_size: int = 4
    num_kv_heads: int = 2
    head_dim: int = 8
    dtype: str = "float32"
    device: str = "cpu"
    stacked: bool = False  # every pool a view of one [layers, 2, ...] allocation (as the engine makes them)


def make_caches(spec: CacheSpec, seed: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random caches for ``seed``, zero caches for ``seed=None``."""
    shape = (spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    dtype = getattr(torch, spec.dtype)
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    if spec.stacked:
        full = (spec.num_layers, 2, *shape)
        pools = (torch.zeros(full) if gen is None else torch.randn(full, generator=gen)).to(dtype).to(spec.device)
        return [(pools[i, 0], pools[i, 1]) for i in range(spec.num_layers)]
    caches = []
    for _ in range(spec.num_layers):
        pair = []
        for _ in range(2):
            t = torch.zeros(shape) if gen is None else torch.randn(shape, generator=gen)
            pair.append(t.to(dtype).to(spec.device).contiguous())
        caches.append(tuple(pair))
    return caches


def block_bytes(caches, layer: int, block_ids: list[int]) -> tuple[bytes, bytes]:
    """Raw bytes of K and V of ``block_ids`` in ``layer``."""
    out = []
    for pool in caches[layer]:
        out.append(pool[block_ids].cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return tuple(out)


class PeerError(RuntimeError):
    def __init__(self, type_name: str, message: str):
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.message = message


_WIRE_VERSION = None


class _Child:
    def __init__(self):
        self.backend = "ucx"
        self.receiver = None
        self.sender = None
        self.caches = None
        self.sender_caches = None

    def open_receiver(self, spec: CacheSpec, wire_version: int | None = None, **options):
        from pdserve import kvtransfer
        from pdserve.kvtransfer import layout

        layout.WIRE_VERSION = wire_version if wire_version is not None else _WIRE_VERSION
        if self.receiver is not None:
            self.receiver.close()
        self.caches = make_caches(spec, None)
        self.receiver = kvtransfer.create_receiver(self.backend, self.caches, **options)
        return self.receiver.address()

    def open_sender(self, spec: CacheSpec, seed: int, **options):
        from pdserve import kvtransfer

        if self.sender is not None:
            self.sender.close()
        self.sender_caches = make_caches(spec, seed)
        self.sender = kvtransfer.create_sender(self.backend, self.sender_caches, **options)

    def setenv(self, name: str, value: str | None):
        """Set (None: unset) an environment variable of this process; its KV settings follow it
        (this process is its own edge: kvtransfer.settings, read before the next receiver)."""
        import os

        from pdserve.kvtransfer import settings

        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
        settings.configure(settings.KVSettings.from_environment())

    def use_backend(self, backend: str):
        """The backend of the receiver and sender opened next (default ``"ucx"``)."""
        self.backend = backend

    def expect(self, *args):
        self.receiver.expect(*args)

    def wait(self, transfer_id, timeout):
        return self.receiver.wait(transfer_id, timeout)

    def cancel(self, transfer_id):
        self.receiver.cancel(transfer_id)

    def read(self, layer, block_ids):
        return block_bytes(self.caches, layer, block_ids)

    def read_all(self):
        blocks = list(range(len(self.caches[0][0])))
        return [block_bytes(self.caches, layer, blocks) for layer in range(len(self.caches))]

    def metrics(self):
        return self.receiver.metrics()

    def send_layer(self, *args):
        self.sender.send_layer(*args)

    def finish(self, transfer_id, timeout):
        return self.sender.finish(transfer_id, timeout)

    def close(self):
        for obj in (self.receiver, self.sender):
            if obj is not None:
                obj.close()
                obj.close()  # idempotent
        self.receiver = self.sender = None

    def busy_stream(self, cycles: int):
        """Queue a kernel of ``cycles`` GPU clock cycles on this process's current stream (what
        a worker's engine stream runs: decode steps) and return at once."""
        torch.cuda._sleep(cycles)

    def stream_busy(self) -> bool:
        return not torch.cuda.current_stream().query()

    def threads(self):
        return [t.name for t in threading.enumerate()]

    def native_threads(self):
        return len(os.listdir("/proc/self/task"))


def _serve(conn) -> None:
    global _WIRE_VERSION
    from pdserve.kvtransfer import layout

    _WIRE_VERSION = layout.WIRE_VERSION
    child = _Child()
    while True:
        cmd, args, kwargs = conn.recv()
        if cmd == "exit":
            child.close()
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(child, cmd)(*args, **kwargs)))
        except Exception as e:
            conn.send(("err", (type(e).__name__, f"{e}\n{traceback.format_exc()}")))


class Peer:
    """Parent-side handle: ``peer.call("expect", tid, ids, layers, deadline)``."""

    def __init__(self):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child_conn,), daemon=True)
        self.process.start()
        child_conn.close()

    def call(self, cmd: str, *args, timeout: float = 30.0, **kwargs):
        self._conn.send((cmd, args, kwargs))
        if not self._conn.poll(timeout):
            raise TimeoutError(f"peer did not answer {cmd!r} within {timeout}s")
        status, value = self._conn.recv()
        if status == "err":
            raise PeerError(*value)
        return value

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.process.is_alive():
            try:
                self.call("exit", timeout=timeout)
            except (TimeoutError, EOFError, BrokenPipeError):
                pass
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        return self.process.exitcode
