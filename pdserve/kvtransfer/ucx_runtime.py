"""The process-wide UCX runtime shared by every UCX sender and receiver in a process:
the ucxx context plus one asyncio event loop in a daemon thread, reference counted.

Environment (read by UCX at the first use in the process, so set it before that):
``UCX_TLS`` / ``UCX_NET_DEVICES`` choose transports and NICs (defaults: UCX decides).
``UCX_WARN_UNUSED_ENV_VARS`` defaults to ``n`` here (ucxx sets variables that a given
UCX build may not use). ``UCX_TCP_CM_REUSEADDR`` defaults to ``y`` here: the KV listener
binds with SO_REUSEADDR, so a worker restarted at its address (a fixed ``--kv-port``) listens at
once instead of waiting out the TIME_WAIT of its dead predecessor's connections (about 60 s on
Linux). ucxx itself sets ``UCX_MEMTYPE_CACHE=n``,
``UCX_RNDV_THRESH=8192``, ``UCX_RNDV_FRAG_MEM_TYPE=cuda`` and
``UCX_MAX_RNDV_RAILS=1`` unless already set. A process whose KV pools are in host memory (the
CPU path: the first sender or receiver that makes the runtime says so) gets
``UCX_RNDV_THRESH=inf`` instead, unless set: every KV message goes eagerly. Under rendezvous
(UCX 1.21), a receiver whose sender died while it was fetching a message's payload crashed
in ``ucp_proto_rndv_send_reply`` (SIGSEGV in its progress thread: 1 of 8 kills of a prefill
worker mid-transfer took its decode worker with it); an eager message has no reply to send.
CUDA pools keep rendezvous (zero-copy; the same-host pull path sends no payload messages).

The process's KV settings (``kvtransfer.settings``, set at the process's start from
``PDSERVE_UCX_PROGRESS_MODE`` and the others) say the rest: ``ucx_progress_mode``
``thread`` (default; the progress thread sleeps in epoll) or ``thread-polling`` (it
spins: lower latency per message, one core busy). ``gil_switch_interval_s``
(default 0.0002): the runtime lowers ``sys.setswitchinterval`` to it (never raises it), so
that the loop thread gets the GIL within that time from a busy engine thread, not within
5 ms, at each of the few hand-offs every message needs. The UCX libraries must be the
``libucx`` wheel's (ucxx loads them by absolute path unless
``RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY`` is true); the runtime checks the loaded
``libucp`` and raises if it is another one, unless ``ucx_allow_system_lib``
(``PDSERVE_UCX_ALLOW_SYSTEM_LIB=1``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import gc
import logging
import os
import socket
import sys
import threading
from typing import Any, Coroutine

from pdserve.kvtransfer.errors import KVTransferError, KVTransferTimeout
from pdserve.kvtransfer.settings import current as kv_settings

logger = logging.getLogger(__name__)

SCHEME = "ucx://"
HOST_RNDV_THRESH = "inf"  # UCX_RNDV_THRESH when the process's KV pools are host memory
_CALL_TIMEOUT_S = 30.0


def _import_ucxx(host_memory: bool = False):
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    os.environ.setdefault("UCX_TCP_CM_REUSEADDR", "y")
    if host_memory and "ucxx" not in sys.modules:
        # before ucxx's own default (8192): see the module docstring
        os.environ.setdefault("UCX_RNDV_THRESH", HOST_RNDV_THRESH)
    try:
        import ucxx
    except Exception as e:  # ImportError, or an OSError from loading the UCX libraries
        raise KVTransferError(f"cannot import ucxx (pip package ucxx-cu12 / ucxx-cu13): {e}") from e
    _check_ucx_library()
    return ucxx


def _check_ucx_library() -> None:
    """Raise unless the loaded libucp is the libucx wheel's (see the module docstring)."""
    try:
        import libucx
    except ImportError:
        return  # UCX installed system-wide on purpose, no wheel to compare with
    wheel_dir = os.path.realpath(os.path.dirname(libucx.__file__))
    loaded = ucx_library_path()
    if loaded is None or loaded.startswith(wheel_dir):
        return
    message = f"ucxx loaded UCX from {loaded}, not from the libucx wheel in {wheel_dir}"
    if kv_settings().ucx_allow_system_lib:
        logger.warning("%s (allowed by PDSERVE_UCX_ALLOW_SYSTEM_LIB=1)", message)
        return
    raise KVTransferError(message + "; unset RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY / LD_PRELOAD, "
                          "or set PDSERVE_UCX_ALLOW_SYSTEM_LIB=1")


def ucx_library_path() -> str | None:
    """Path of the libucp shared library mapped into this process (Linux), else None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if os.path.basename(path).startswith("libucp.so"):
                    return os.path.realpath(path)
    except OSError:
        pass
    return None


class UcxRuntime:
    """The process-wide ucxx context and its asyncio loop thread, reference counted."""

    _lock = threading.Lock()
    _instance: UcxRuntime | None = None
    _refs = 0

    def __init__(self, host_memory: bool = False):
        self.ucxx = _import_ucxx(host_memory)
        _lower_switch_interval()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kvtransfer-ucx-loop", daemon=True)
        self._thread.start()
        try:
            self.call(self._init())
        except BaseException:
            self._stop()
            raise

    async def _init(self) -> None:
        # on the loop thread: ucxx binds its progress and notifier to the running loop
        try:
            self.ucxx.init(progress_mode=kv_settings().ucx_progress_mode, enable_python_future=True)
        except Exception as e:
            raise KVTransferError(f"UCX failed to initialise: {type(e).__name__}: {e}") from e
        self.worker_address = bytes(self.ucxx.get_worker_address())

    @classmethod
    def acquire(cls, host_memory: bool = False) -> UcxRuntime:
        """The runtime, made on the first call; `host_memory`: the caller's KV pools are in host
        memory (UCX_RNDV_THRESH's default then, if this call makes the runtime)."""
        with cls._lock:
            if cls._instance is None:
                cls._instance = UcxRuntime(host_memory)
            cls._refs += 1
            return cls._instance

    @classmethod
    def release(cls) -> None:
        with cls._lock:
            cls._refs -= 1
            if cls._refs > 0 or cls._instance is None:
                return
            runtime, cls._instance = cls._instance, None
        runtime._stop()

    def call(self, coro: Coroutine, timeout: float | None = _CALL_TIMEOUT_S) -> Any:
        """Run ``coro`` on the loop and wait for its result from another thread."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("kvtransfer sync API called from its own event loop thread")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise KVTransferTimeout(f"UCX event loop did not answer within {timeout}s") from None

    def call_soon(self, fn, *args) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def _stop(self) -> None:
        try:
            self.ucxx.stop_notifier_thread()
        except Exception as e:
            logger.debug("stopping the ucxx notifier thread: %s", e)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if self._thread.is_alive():
            logger.warning("kvtransfer UCX loop thread did not stop within 10s")
            return
        self.loop.close()  # ucxx cancels its progress tasks here
        gc.collect()
        try:
            self.ucxx.reset()
        except Exception as e:  # objects still referencing the context: harmless at exit
            logger.debug("ucxx.reset() after the last kvtransfer endpoint closed: %s", e)


def _lower_switch_interval() -> None:
    interval = kv_settings().gil_switch_interval_s
    if interval < sys.getswitchinterval():
        sys.setswitchinterval(interval)


def parse_address(address: str) -> tuple[str, int]:
    """``"ucx://host:port"`` (``"ucx://[v6addr]:port"``), optionally followed by
    ``"#<incarnation, hex>"`` -> (host, port)."""
    if not isinstance(address, str) or not address.startswith(SCHEME):
        raise ValueError(f"not a UCX KV address: {address!r} (expected {SCHEME}host:port)")
    where, _, incarnation = address[len(SCHEME):].partition("#")
    host, sep, port = where.rpartition(":")
    if not sep or not host or not port.isdigit() or (incarnation and not _is_hex(incarnation)):
        raise ValueError(f"not a UCX KV address: {address!r} (expected {SCHEME}host:port[#incarnation])")
    return host.strip("[]"), int(port)


def address_incarnation(address: str) -> int:
    """The receiver incarnation an address names (0: none named)."""
    _, _, incarnation = address.partition("#")
    return int(incarnation, 16) if incarnation else 0


def _is_hex(text: str) -> bool:
    try:
        int(text, 16)
    except ValueError:
        return False
    return True


class TaskSet:
    """Strong references to fire-and-forget tasks until they finish."""

    def __init__(self):
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def cancel_all(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def abort_endpoint(ep) -> None:
    try:
        ep.abort(period=10**9)  # ns
    except Exception as e:
        logger.debug("closing a UCX endpoint: %s", e)


class _EpAttr(ctypes.Structure):
    """``ucp_ep_attr_t`` up to ``remote_sockaddr`` (ucp.h; the fields after it are not asked
    for and the buffer is generously padded)."""

    _fields_ = [("field_mask", ctypes.c_uint64), ("name", ctypes.c_char * 32),
                ("local", ctypes.c_ubyte * 128), ("remote", ctypes.c_ubyte * 128),
                ("rest", ctypes.c_ubyte * 256)]


_LOCAL_SOCKADDR = 1 << 1  # UCP_EP_ATTR_FIELD_LOCAL_SOCKADDR
_REMOTE_SOCKADDR = 1 << 2  # UCP_EP_ATTR_FIELD_REMOTE_SOCKADDR
_ucp_ep_query = None


def _query_fn(library_path: str):
    global _ucp_ep_query
    if _ucp_ep_query is None:
        fn = ctypes.CDLL(library_path).ucp_ep_query
        fn.argtypes = [ctypes.c_void_p, ctypes.POINTER(_EpAttr)]
        fn.restype = ctypes.c_int
        _ucp_ep_query = fn
    return _ucp_ep_query


def _sockaddr(raw) -> str | None:
    data = bytes(raw)
    family = int.from_bytes(data[:2], "little")
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, data[4:8])
    if family == socket.AF_INET6:
        return socket.inet_ntop(socket.AF_INET6, data[8:24])
    return None


def endpoint_sockaddrs(ep) -> tuple[str | None, str | None]:
    """(local, remote) IP addresses of a ucxx endpoint a listener accepted, asked of UCX itself
    (``ucp_ep_query`` with ``UCP_EP_ATTR_FIELD_LOCAL_SOCKADDR | REMOTE_SOCKADDR``, UCX >= 1.14,
    through the libucp this process loaded: ucxx exposes neither address); None for one UCX
    cannot tell."""
    path = ucx_library_path()
    if path is None:
        return None, None
    attr = _EpAttr()
    attr.field_mask = _LOCAL_SOCKADDR | _REMOTE_SOCKADDR
    if _query_fn(path)(ctypes.c_void_p(ep.ucp_endpoint), ctypes.byref(attr)) != 0:
        return None, None
    return _sockaddr(attr.local), _sockaddr(attr.remote)
