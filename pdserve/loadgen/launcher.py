"""Start a server under test as a subprocess, wait for its health check, always stop it.

The server runs in its own process group (a new session), so Ctrl-C in the terminal does
not reach it directly; `stop()` sends SIGTERM to the whole group, waits, then SIGKILL.
Use it as a context manager so that stop runs on success, failure and Ctrl-C alike.
"""

from __future__ import annotations

import logging
import os
import random
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

from pdserve.loadgen.errors import LoadgenError

log = logging.getLogger(__name__)


class LaunchError(LoadgenError):
    """The server did not start or did not become healthy."""


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


class ServerProcess:
    def __init__(
        self,
        command: str,
        *,
        health_url: str,
        log_path: str | Path,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        startup_timeout_s: float = 300.0,
        shutdown_timeout_s: float = 20.0,
    ):
        self.argv = shlex.split(command)
        if not self.argv:
            raise LaunchError("the launch command is empty")
        self.health_url = health_url
        self.log_path = Path(log_path)
        self.env = env or {}
        self.cwd = cwd
        self.startup_timeout_s = startup_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "ServerProcess":
        try:
            self.start()
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("starting server: %s", shlex.join(self.argv))
        with open(self.log_path, "wb") as log_file:
            try:
                self.proc = subprocess.Popen(
                    self.argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                    env=os.environ | self.env, cwd=self.cwd, start_new_session=True,
                )
            except OSError as e:
                raise LaunchError(f"cannot start {self.argv[0]!r}: {e.strerror or e}") from None

    def wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout_s
        with httpx.Client(timeout=2.0) as http:
            while True:
                code = self.proc.poll()
                if code is not None:
                    raise LaunchError(
                        f"server exited with code {code} before {self.health_url} answered; "
                        f"log {self.log_path}: {_tail(self.log_path)}"
                    )
                try:
                    if http.get(self.health_url).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() >= deadline:
                    raise LaunchError(
                        f"{self.health_url} not healthy after {self.startup_timeout_s:g}s; log {self.log_path}"
                    )
                time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM the process group, wait, SIGKILL what is left. Idempotent."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        pgid = proc.pid  # session leader: its pid is the group id
        if proc.poll() is None:
            self._signal(pgid, signal.SIGTERM)
            try:
                proc.wait(timeout=self.shutdown_timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("server did not stop within %.0fs; killing it", self.shutdown_timeout_s)
        self._signal(pgid, signal.SIGKILL)  # children that outlived the leader, or the leader itself
        proc.wait()

    @staticmethod
    def _signal(pgid: int, sig: int) -> None:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
