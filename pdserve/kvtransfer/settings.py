"""The KV plane's settings, one frozen `KVSettings` per process.

They are the process's, not a sender's or a receiver's: the UCX runtime is one per process, and
so is the trace. Whoever starts the process's KV plane sets them once, before its first sender
or receiver (`configure`): a worker from `WorkerConfig.kv_settings` (`pdserve worker` and
`pdserve up` fill it from the environment, `pdserve.launcher.workers.worker_config`), a
benchmark or a test's peer process from `KVSettings.from_environment()`. The backends and the
UCX runtime read `current()`; nothing here reads the environment on its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pdserve import environment
from pdserve.kvtransfer import trace

PROGRESS_MODES = ("thread", "thread-polling")


@dataclass(frozen=True)
class KVSettings:
    recv_slots: int = 8  # staging slots of a UCX receiver (PDSERVE_KV_RECV_SLOTS)
    nixl_slot_bytes: int = 16 << 20  # a NIXL WRITE connection's slot (PDSERVE_NIXL_SLOT_BYTES)
    nixl_slots: int = 4  # and its slots (PDSERVE_NIXL_SLOTS)
    # how the UCX progress thread waits: in epoll, or spinning (PDSERVE_UCX_PROGRESS_MODE)
    ucx_progress_mode: str = "thread"
    # the UCX runtime lowers sys.setswitchinterval to it, never raises it (PDSERVE_GIL_SWITCH_INTERVAL_S)
    gil_switch_interval_s: float = 0.0002
    ucx_allow_system_lib: bool = False  # a libucp not from the libucx wheel (PDSERVE_UCX_ALLOW_SYSTEM_LIB)
    trace: bool = False  # mark each KV message's time points, kvtransfer.trace (PDSERVE_KV_TRACE)
    trace_dir: str | None = None  # and append them there every half second (PDSERVE_KV_TRACE_DIR)

    def __post_init__(self) -> None:
        for key in ("recv_slots", "nixl_slot_bytes", "nixl_slots"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"KV settings: {key} must be an int >= 1, got {value!r}")
        if self.ucx_progress_mode not in PROGRESS_MODES:
            raise ValueError(f"KV settings: ucx_progress_mode must be thread or thread-polling, "
                             f"got {self.ucx_progress_mode!r}")
        if not isinstance(self.gil_switch_interval_s, (int, float)) or not self.gil_switch_interval_s > 0:
            raise ValueError(f"KV settings: gil_switch_interval_s must be a positive number of seconds, "
                             f"got {self.gil_switch_interval_s!r}")

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> KVSettings:
        """The settings the process's environment gives (pdserve.environment); ValueError naming
        a bad variable. For the edge of a process: a worker's start, a benchmark's."""
        def get(name):
            return environment.get(name, environ)

        return cls(recv_slots=get("PDSERVE_KV_RECV_SLOTS"), nixl_slot_bytes=get("PDSERVE_NIXL_SLOT_BYTES"),
                   nixl_slots=get("PDSERVE_NIXL_SLOTS"), ucx_progress_mode=get("PDSERVE_UCX_PROGRESS_MODE"),
                   gil_switch_interval_s=get("PDSERVE_GIL_SWITCH_INTERVAL_S"),
                   ucx_allow_system_lib=get("PDSERVE_UCX_ALLOW_SYSTEM_LIB"), trace=get("PDSERVE_KV_TRACE"),
                   trace_dir=get("PDSERVE_KV_TRACE_DIR"))


_current = KVSettings()


def configure(settings: KVSettings) -> None:
    """Sets this process's KV settings (once, before its first sender or receiver: the UCX
    runtime reads its own when it starts) and switches the trace on or off with them."""
    global _current
    _current = settings
    trace.configure(settings.trace, settings.trace_dir)


def current() -> KVSettings:
    """This process's KV settings (the defaults until `configure`)."""
    return _current
