"""pdserve.kvtransfer.trace: the time points of a real UCX transfer, in a fresh process that sets its
KV plane from its environment at its start (kvtransfer.settings, as a worker or a benchmark does),
and the monotonic end times the benchmark lines up across processes."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = r"""
import json, time, torch
from pdserve import kvtransfer
from pdserve.kvtransfer import settings, trace
settings.configure(settings.KVSettings.from_environment())

def caches():
    return [(torch.randn(8, 4, 2, 8), torch.randn(8, 4, 2, 8)) for _ in range(3)]

with kvtransfer.create_receiver("ucx", caches()) as receiver, kvtransfer.create_sender("ucx", caches()) as sender:
    out = []
    for n in range(2):
        receiver.expect(f"t{n}", [1, 5], 3, 20.0)
        start = time.monotonic()
        for layer in range(3):
            sender.send_layer(receiver.address(), f"t{n}", layer, [0, 2], [1, 5])
        sent = sender.finish(f"t{n}", timeout=20)
        landed = receiver.wait(f"t{n}", 20.0)
        out.append([start, sent.finished_at, landed.finished_at, time.monotonic()])
print(json.dumps({"enabled": trace.ENABLED, "points": trace.drain(), "ends": out, "after": trace.drain()}))
"""


def run(trace: str) -> dict:
    env = dict(os.environ, PDSERVE_KV_TRACE=trace, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_trace_marks_each_leg_in_order():
    got = run("1")
    assert got["enabled"] and got["after"] == []  # drain empties the buffer
    by_key: dict[int, list] = {}
    for point, key, layer, t in got["points"]:
        by_key.setdefault(key, []).append((t, point))
    assert len(by_key) == 2  # one key a transfer, on both sides
    for rows in by_key.values():
        first = {}
        for t, point in sorted(rows):
            first.setdefault(point, t)
        # host pools: one message a layer, each through every sender leg, then the receiver's
        assert sum(1 for _, p in rows if p == "s.flush") == 3
        assert sum(1 for _, p in rows if p == "r.control") == 3
        order = ["s.flush", "s.loop", "s.post", "r.control", "r.lander", "r.launched", "r.ack", "r.reply", "s.ack"]
        assert [first[p] for p in order] == sorted(first[p] for p in order), sorted(rows)
    for start, acked, landed, end in got["ends"]:
        assert start < landed <= acked <= end  # one monotonic clock: landing, then the ACK


def test_trace_off_marks_nothing():
    got = run("0")
    assert not got["enabled"] and got["points"] == []
    assert all(start < landed <= acked for start, acked, landed, _ in got["ends"])


DUMP = r"""
import time
from pdserve.kvtransfer import settings, trace
settings.configure(settings.KVSettings.from_environment())
trace.mark("s.flush", 7, 0)
trace.mark("s.ack", 7)
time.sleep(1.5)  # the dump thread writes every half second
"""


def test_a_served_process_dumps_its_points_to_the_trace_dir(tmp_path):
    """PDSERVE_KV_TRACE_DIR: the process appends its points to kv-trace-<pid>.jsonl (a served
    worker has nobody to drain it); without PDSERVE_KV_TRACE=1 nothing is written."""
    env = dict(os.environ, PDSERVE_KV_TRACE="1", PDSERVE_KV_TRACE_DIR=str(tmp_path), PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", DUMP], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = list(tmp_path.glob("kv-trace-*.jsonl"))
    assert len(files) == 1
    rows = [json.loads(line) for line in files[0].read_text().splitlines()]
    assert [(p, k, layer) for p, k, layer, _ in rows] == [("s.flush", 7, 0), ("s.ack", 7, -1)]
    assert rows[0][3] <= rows[1][3]
    off = tmp_path / "off"
    off.mkdir()
    env = dict(os.environ, PDSERVE_KV_TRACE="0", PDSERVE_KV_TRACE_DIR=str(off), PYTHONPATH=ROOT)
    subprocess.run([sys.executable, "-c", DUMP], env=env, capture_output=True, text=True, timeout=60, check=True)
    assert list(off.iterdir()) == []


TRANSFERS = r"""
import time, torch
from pdserve import kvtransfer
from pdserve.kvtransfer import settings, trace
settings.configure(settings.KVSettings.from_environment())

def caches():
    return [(torch.randn(8, 4, 2, 8), torch.randn(8, 4, 2, 8)) for _ in range(3)]

with kvtransfer.create_receiver("ucx", caches()) as receiver, kvtransfer.create_sender("ucx", caches()) as sender:
    for n in range(2):
        receiver.expect(f"t{n}", [1, 5], 3, 20.0)
        for layer in range(3):
            sender.send_layer(receiver.address(), f"t{n}", layer, [0, 2], [1, 5])
        sender.finish(f"t{n}", timeout=20)
        receiver.wait(f"t{n}", 20.0)
time.sleep(1.2)  # the dump thread writes every 0.5 s
"""


def test_the_trace_report_reads_a_served_processes_dump(tmp_path):
    """tools/kv_trace_report.py on what a real UCX transfer's process dumped: one line per
    transfer, in order, with its messages; --transfer N its messages; a bad flag is named."""
    env = dict(os.environ, PDSERVE_KV_TRACE="1", PDSERVE_KV_TRACE_DIR=str(tmp_path), PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", TRANSFERS], env=env, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = [sys.executable, "-m", "tools.kv_trace_report"]  # run as a module from the checkout's root
    out = subprocess.run([*report, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:3] == ["#", "msgs", "s.ready"] and len(lines) == 3  # two transfers
    for i, line in enumerate(lines[1:]):
        cells = line.split()
        assert int(cells[0]) == i and int(cells[1]) >= 1
        ready, post, sent, copied, ack, tail = (float(c) for c in cells[2:8])
        assert 0 <= ready <= post <= sent and copied <= ack and tail == pytest.approx(ack - ready, abs=0.11)
    one = subprocess.run([*report, str(tmp_path), "--transfer", "1"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert one.returncode == 0 and one.stdout.splitlines()[0].split()[:2] == ["layer", "s.flush"]
    assert one.stdout.splitlines()[1].split()[0] == "0"  # the first message starts at layer 0
    bad = subprocess.run([*report, str(tmp_path), "--transfer", "5"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "--transfer: 5 is not one of the 2 transfers" in bad.stderr
