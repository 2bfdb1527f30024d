import json
import subprocess
import sys

import pytest

from pdserve.loadgen.cli import main


def run_cli(capsys, *argv):
    with pytest.raises(SystemExit) as info:
        code = main(list(argv))
        raise SystemExit(code)
    out, err = capsys.readouterr()
    return info.value.code, out, err


@pytest.mark.parametrize("argv,flag", [
    (["run", "--url", "http://127.0.0.1:1", "--num-requests", "3"], "--rate"),
    (["run", "--url", "http://127.0.0.1:1", "--rate", "abc", "--num-requests", "3"], "--rate"),
    (["run", "--url", "http://127.0.0.1:1", "--rate", "-1", "--num-requests", "3"], "--rate"),
    (["run", "--url", "http://127.0.0.1:1", "--rate", "1"], "--num-requests"),
    (["run", "--url", "http://127.0.0.1:1", "--rate", "1", "--num-requests", "2", "--input-len", "zipf:1"],
     "--input-len"),
    (["run", "--url", "ftp://x", "--rate", "1", "--num-requests", "2"], "--url"),
    (["run", "--url", "http://x:1", "--arrival", "trace", "--num-requests", "2"], "--trace"),
    (["run", "--url", "http://x:1", "--rate", "1", "--num-requests", "2", "--slo-ttft", "1"], "--slo-tpot"),
    (["search", "--url", "http://x:1", "--num-requests", "2"], "--slo-ttft"),
    (["run", "--url", "http://x:1", "--rate", "1", "--num-requests", "2", "--bogus"], "--bogus"),
])
def test_bad_flags_one_line_exit_2(capsys, argv, flag):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert err.count("\n") == 1 and flag in err and "Traceback" not in err


def test_missing_spec_and_trace_files(capsys, tmp_path):
    code, _, err = run_cli(capsys, "experiment", str(tmp_path / "nope.yaml"))
    assert code == 2 and err.count("\n") == 1 and "nope.yaml" in err
    bad = tmp_path / "t.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n1,x,2\n")
    code, _, err = run_cli(capsys, "run", "--url", "http://127.0.0.1:1", "--arrival", "trace", "--trace", str(bad))
    assert code == 2 and err.strip() == (f"pdserve-loadgen: error: {bad}:2: field 'ContextTokens': "
                                         "expected a whole number, got 'x'")


def test_unreachable_server(capsys, closed_port):
    url = f"http://127.0.0.1:{closed_port}"
    code, _, err = run_cli(capsys, "run", "--url", url, "--rate", "1", "--num-requests", "1")
    assert code == 1
    assert err == f"pdserve-loadgen: error: cannot reach {url}: connection refused\n"


def test_run_and_search_against_fake_server(capsys, fake_server, tmp_path):
    url = fake_server(ttft_s=0.01, itl_s=0.001)
    code, out, err = run_cli(capsys, "run", "--url", url, "--rate", "100", "--num-requests", "5",
                             "--output-len", "4", "--slo-ttft", "1", "--slo-tpot", "0.1",
                             "--output", str(tmp_path / "run"), "--no-progress", "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["num_ok"] == 5 and summary["slo_attainment"] == 1.0
    assert len((tmp_path / "run" / "records.jsonl").read_text().splitlines()) == 5

    code, out, err = run_cli(capsys, "search", "--url", url, "--num-requests", "4", "--lo", "10", "--hi", "40",
                             "--output-len", "3", "--slo-ttft", "1", "--slo-tpot", "0.1", "--no-progress",
                             "--output", str(tmp_path / "search"))
    assert code == 0, err
    assert "max rate meeting the SLO for 90% of requests: 40.000 req/s (the upper bound" in out
    assert (tmp_path / "search" / "search.csv").exists()


def test_console_entry_point_help():
    out = subprocess.run([sys.executable, "-m", "pdserve.loadgen.cli", "--help"], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0 and "experiment" in out.stdout and "search" in out.stdout
