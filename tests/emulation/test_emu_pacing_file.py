"""A pacer whose rates live in a file: switching the rates of a running sender."""

import os

import pytest

from pdserve.kvtransfer.pacing_spec import FilePacer, build_pacer, read_pacing_file


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _write(path, text, bump_ns):
    path.write_text(text)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + bump_ns))  # a distinct mtime, however coarse


def test_file_pacer_switches_rates_when_the_file_changes(tmp_path):
    path = tmp_path / "pacing.txt"
    _write(path, "# p0's links\nucx://127.0.0.1:7001=10\nucx://127.0.0.1:7002=1\n", 0)
    clock = Clock()
    pacer = build_pacer(f"file:{path}", clock=clock, sleep=lambda s: None)
    assert isinstance(pacer, FilePacer)
    assert pacer.bucket_for("ucx://127.0.0.1:7001").rate_gbps == 10.0
    assert pacer.bucket_for("ucx://127.0.0.1:7002").rate_gbps == 1.0
    # 1 MiB at 1 Gbit/s past the (full) burst: the sender owes 8.39 ms
    pacer.reserve("ucx://127.0.0.1:7002", 1 << 20)
    assert pacer.reserve("ucx://127.0.0.1:7002", 1 << 20) == pytest.approx((1 << 20) * 8 / 1e9)

    _write(path, "ucx://127.0.0.1:7001=100,ucx://127.0.0.1:7002=25", 10**9)
    assert pacer.bucket_for("ucx://127.0.0.1:7001").rate_gbps == 10.0  # not re-checked within check_s
    clock.t += 1.0
    assert pacer.bucket_for("ucx://127.0.0.1:7001").rate_gbps == 100.0
    assert pacer.bucket_for("ucx://127.0.0.1:7002").rate_gbps == 25.0
    assert pacer.rates() == {"ucx://127.0.0.1:7001": 100.0, "ucx://127.0.0.1:7002": 25.0}
    assert pacer.reloads == 1


def test_file_pacer_keeps_the_last_good_rates(tmp_path):
    path = tmp_path / "pacing.txt"
    _write(path, "default=5", 0)
    clock = Clock()
    pacer = build_pacer(f"file:{path}", clock=clock)
    _write(path, "default=fast", 10**9)
    clock.t += 1.0
    assert pacer.bucket_for("ucx://h:1").rate_gbps == 5.0
    assert pacer.reloads == 0


def test_pacing_file_errors_name_the_file(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        read_pacing_file(str(tmp_path / "missing.txt"))
    bad = tmp_path / "bad.txt"
    bad.write_text("default=0\n")
    with pytest.raises(ValueError, match=r"bad\.txt: pacing entry 'default=0'"):
        read_pacing_file(str(bad))
