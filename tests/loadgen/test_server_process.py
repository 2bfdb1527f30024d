"""pdserve.loadgen.launcher.ServerProcess, the one helper that starts, waits for and stops a server
(loadgen's experiments, the scripts in experiments/ and tools/): on real child processes."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from pdserve.loadgen.launcher import LaunchError, ServerProcess, free_port

# A small HTTP server: /health says how many of its "workers" are up (all after `--after` s); it
# prints "listening on PORT tag=TAG", the variables it was given, and on SIGINT writes `--mark`.
SERVER = r"""
import http.server, json, os, signal, sys, time
port, after, tag, mark = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4]
t0 = time.monotonic()

def on_sigint(*_):
    open(mark, "w").write("SIGINT")
    os._exit(0)

signal.signal(signal.SIGINT, on_sigint)

class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        up = 2 if time.monotonic() - t0 >= after else 1
        body = json.dumps({"workers": up}).encode()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass

server = http.server.HTTPServer(("127.0.0.1", port), H)
print(f"listening on {port} tag={tag}", flush=True)
print("env", os.environ.get("SP_SET"), os.environ.get("SP_GONE"), flush=True)
server.serve_forever()
"""


def server(tmp_path, tag="a", after=0.0, port=None, **kw) -> ServerProcess:
    port = port or free_port()
    argv = [sys.executable, "-c", SERVER, str(port), str(after), tag, str(tmp_path / "mark")]
    return ServerProcess(argv, health_url=f"http://127.0.0.1:{port}/health", log_path=tmp_path / "server.log",
                         **kw)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_ready_is_the_callers_test_and_stop_sends_the_stop_signal(tmp_path, monkeypatch):
    monkeypatch.setenv("SP_GONE", "inherited")
    two_up = lambda r: r.status_code == 200 and r.json()["workers"] == 2  # noqa: E731
    proc = server(tmp_path, after=0.6, ready=two_up, env={"SP_SET": "yes", "SP_GONE": None},
                  stop_signal=signal.SIGINT, shutdown_timeout_s=10, name="fake up")
    with proc:
        assert proc.startup_s is not None and proc.startup_s >= 0.6  # /health answered at once, 2 workers later
        assert proc.poll() is None
        pid = proc.pid
    assert proc.returncode == 0 and gone(pid)
    assert (tmp_path / "mark").read_text() == "SIGINT"
    assert "env yes None" in (tmp_path / "server.log").read_text()  # set, and removed although inherited
    assert proc.stop() == 0.0  # idempotent


def test_stop_returns_the_seconds_to_exit_and_kills_a_process_that_ignores_the_signal(tmp_path):
    ignore = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
              "time.sleep(60)")
    proc = ServerProcess([sys.executable, "-c", ignore], health_url=None, log_path=tmp_path / "x.log",
                         shutdown_timeout_s=0.5)
    proc.launch()  # no health URL: started, not waited for
    proc.wait_for_line("up", timeout_s=20)
    t0 = time.monotonic()
    took = proc.stop()
    assert 0.5 <= took <= time.monotonic() - t0 and proc.returncode == -signal.SIGKILL


def test_a_restart_appends_to_the_log_and_waits_read_only_its_own_lines(tmp_path):
    port = free_port()
    first = server(tmp_path, tag="first", port=port, append_log=True)
    with first:
        assert first.wait_for_line(r"listening on \S+ tag=\S+", timeout_s=20).endswith("tag=first")
    second = server(tmp_path, tag="second", port=port, append_log=True)
    second.start()
    try:
        assert second.wait_for_line(r"listening on \S+ tag=\S+", timeout_s=20).endswith("tag=second")
    finally:
        second.stop()
    text = (tmp_path / "server.log").read_text()
    assert text.index("tag=first") < text.index("tag=second")


def test_an_exit_before_ready_names_the_code_and_the_log(tmp_path):
    proc = ServerProcess([sys.executable, "-c", "print('boom'); raise SystemExit(3)"], name="pdserve up",
                         health_url=f"http://127.0.0.1:{free_port()}/health", log_path=tmp_path / "x.log")
    with pytest.raises(LaunchError, match=r"pdserve up exited with code 3 before .* answered; log .*x.log: boom"):
        proc.launch()
    assert isinstance(LaunchError("x"), RuntimeError)  # the scripts' `except RuntimeError` still catch it


def test_wait_until_returns_what_the_check_found_or_says_what_was_late(tmp_path):
    proc = ServerProcess([sys.executable, "-c", "import time; time.sleep(60)"], health_url=None,
                         log_path=tmp_path / "x.log", name="workers")
    proc.start()
    try:
        state = tmp_path / "cluster.json"
        with pytest.raises(LaunchError, match=r"workers: cluster.json written not within 0.3s; log "):
            proc.wait_until(lambda: state.exists(), "cluster.json written", timeout_s=0.3)
        state.write_text(json.dumps({"workers": 2}))
        assert proc.wait_until(lambda: json.loads(state.read_text()), "cluster.json written") == {"workers": 2}
    finally:
        proc.stop()
    assert gone(proc.pid)
