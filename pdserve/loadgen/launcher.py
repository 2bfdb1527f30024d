"""Start a server under test as a subprocess, wait until it is ready, always stop it.

The one way the load generator, the experiments and the tools start a server (`pdserve up`,
`pdserve router`, `python -m pdserve.launcher.paced ...`, a worker, any OpenAI server): by its
command line, so that this package imports nothing of the server it measures.

The server runs in its own process group (a new session), so Ctrl-C in the terminal does
not reach it directly; `stop()` sends `stop_signal` (SIGTERM by default) to the whole group,
waits, then SIGKILL. Use it as a context manager so that stop runs on success, failure and
Ctrl-C alike. Ready means: `health_url` answers and `ready` accepts the answer (by default a
200), or, for a process without HTTP, whatever `wait_until` / `wait_for_line` is asked to see.
"""

from __future__ import annotations

import logging
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import httpx

from pdserve import environment
from pdserve.loadgen.errors import LoadgenError

log = logging.getLogger(__name__)

T = TypeVar("T")


class LaunchError(LoadgenError, RuntimeError):
    """The server did not start or did not become ready."""


# Ports a server is started on are drawn below the kernel's ephemeral range: a port the kernel
# handed out for port 0 and took back can be handed out again at once to anything that binds port 0
# (a worker's gRPC server, Ray's processes), so a server started on it a moment later finds it taken,
# or a client finds another protocol behind it. Ray's own defaults (6379, 8265, 10002-19999) lie
# below FIRST_PORT.
FIRST_PORT = 20000
_handed: set[int] = set()  # ports this process handed out: never twice


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that binds now, below the ephemeral range (see above) where there is room
    (else one the kernel picks)."""
    low, _ = _ephemeral_range()
    if low - FIRST_PORT >= 1000:
        rng = random.Random()
        for _ in range(200):
            port = rng.randrange(FIRST_PORT, low)
            if port in _handed:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
            _handed.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])


def answers_200(response: httpx.Response) -> bool:
    return response.status_code == 200


class ServerProcess:
    """One server process (and whatever it starts in its process group).

    `command`: a shell-style string or an argv list. `env`: variables set on top of this process's
    environment; a value of None removes that variable. `log_path`: the server's stdout and stderr
    (`append_log`: added to what is there, e.g. a process restarted under the same name; the
    waits read only what this start wrote). `name` names it in errors and log lines.
    """

    def __init__(
        self,
        command: str | Sequence[str],
        *,
        health_url: str | None,
        log_path: str | Path,
        env: Mapping[str, str | None] | None = None,
        cwd: str | Path | None = None,
        startup_timeout_s: float = 300.0,
        shutdown_timeout_s: float = 20.0,
        stop_signal: int = signal.SIGTERM,
        ready: Callable[[httpx.Response], bool] = answers_200,
        poll_interval_s: float = 0.1,
        append_log: bool = False,
        name: str = "server",
    ):
        self.argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
        if not self.argv:
            raise LaunchError("the launch command is empty")
        self.health_url = health_url
        self.log_path = Path(log_path)
        self.env = dict(env or {})
        self.cwd = cwd
        self.startup_timeout_s = startup_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.stop_signal = stop_signal
        self.ready = ready
        self.poll_interval_s = poll_interval_s
        self.append_log = append_log
        self.name = name
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None  # start() to ready, once wait_healthy() returned
        self._started_at = 0.0
        self._log_offset = 0
        self._stopped = False

    def __enter__(self) -> "ServerProcess":
        self.launch()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def launch(self) -> "ServerProcess":
        """start(), then wait_healthy() where there is a health URL; stopped again if either fails."""
        try:
            self.start()
            if self.health_url is not None:
                self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    # ---- the process

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise LaunchError(f"{self.name} was not started")
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.returncode

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        """The process's exit status (subprocess.TimeoutExpired past `timeout`)."""
        if self.proc is None:
            raise LaunchError(f"{self.name} was not started")
        return self.proc.wait(timeout)

    def environment(self) -> dict[str, str]:
        env = environment.child_env()
        for key, value in self.env.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_offset = self.log_path.stat().st_size if self.append_log and self.log_path.exists() else 0
        log.info("starting %s: %s", self.name, shlex.join(self.argv))
        self._started_at = time.monotonic()
        with open(self.log_path, "ab" if self.append_log else "wb") as log_file:
            try:
                self.proc = subprocess.Popen(
                    self.argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                    env=self.environment(), cwd=self.cwd, start_new_session=True,
                )
            except OSError as e:
                raise LaunchError(f"cannot start {self.argv[0]!r}: {e.strerror or e}") from None
        self._stopped = False

    # ---- waiting until it is ready

    def wait_until(self, check: Callable[[], T], what: str, timeout_s: float | None = None, *,
                   interval_s: float | None = None, late: str | None = None) -> T:
        """Calls `check` every `interval_s` (default poll_interval_s) until it returns something
        true, which is returned. LaunchError when the process exits first ("NAME exited with code
        N before WHAT") or when `timeout_s` (default startup_timeout_s) passes (`late`, default
        "NAME: WHAT not within Ts"); both name the log."""
        if self.proc is None:
            raise LaunchError(f"{self.name} was not started")
        timeout_s = self.startup_timeout_s if timeout_s is None else timeout_s
        interval_s = self.poll_interval_s if interval_s is None else interval_s
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                raise LaunchError(f"{self.name} exited with code {code} before {what}; "
                                  f"log {self.log_path}: {_tail(self.log_path)}")
            found = check()
            if found:
                return found
            if time.monotonic() >= deadline:
                late = late or f"{self.name}: {what} not within {timeout_s:g}s"
                raise LaunchError(f"{late}; log {self.log_path}")
            time.sleep(interval_s)

    def wait_healthy(self, timeout_s: float | None = None) -> None:
        """Until `health_url` answers and `ready` accepts the answer; sets startup_s."""
        if self.health_url is None:
            raise LaunchError(f"{self.name} has no health URL to wait for")
        with httpx.Client(timeout=2.0) as http:
            def healthy() -> bool:
                try:
                    return self.ready(http.get(self.health_url))
                except httpx.HTTPError:
                    return False

            timeout_s = self.startup_timeout_s if timeout_s is None else timeout_s
            self.wait_until(healthy, f"{self.health_url} answered", timeout_s,
                            late=f"{self.health_url} not healthy after {timeout_s:g}s")
        self.startup_s = time.monotonic() - self._started_at

    def wait_for_line(self, pattern: str, timeout_s: float | None = None) -> str:
        """The first match of the regular expression `pattern` in what this start wrote to the log."""
        def match() -> str | None:
            try:
                with open(self.log_path, "rb") as f:
                    f.seek(self._log_offset)
                    text = f.read().decode(errors="replace")
            except OSError:
                return None
            found = re.search(pattern, text)
            return found.group(0) if found else None

        return self.wait_until(match, f"{pattern!r} was in its log", timeout_s)

    # ---- stopping it

    def stop(self) -> float:
        """`stop_signal` to the process group, wait, SIGKILL what is left. Idempotent. Seconds from
        the signal until the process exited (0 when it was not running)."""
        proc = self.proc
        if proc is None or self._stopped:
            return 0.0
        self._stopped = True
        pgid = proc.pid  # session leader: its pid is the group id
        t0 = time.monotonic()
        if proc.poll() is None:
            self._signal(pgid, self.stop_signal)
            try:
                proc.wait(timeout=self.shutdown_timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0fs; killing it", self.name, self.shutdown_timeout_s)
        self._signal(pgid, signal.SIGKILL)  # children that outlived the leader, or the leader itself
        proc.wait()
        return time.monotonic() - t0

    @staticmethod
    def _signal(pgid: int, sig: int) -> None:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
