"""Start a server under test as a subprocess, wait for its health check, always stop it.

The server runs in its own process group (a new session), so Ctrl-C in the terminal does
not reach it directly; `stop()` sends SIGTERM to the whole group, waits, then SIGKILL.
Use it as a context manager so that stop runs on success, failure and Ctrl-C alike.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

from loadgen.errors import LoadgenError

log = logging.getLogger(__name__)


class LaunchError(LoadgenError):
    """The server did not start or did not become healthy."""


def free_port(host: str = "127.0.0.1") -> int:
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
