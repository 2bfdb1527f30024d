"""A TP engine never hangs: a dead rank stops the engine with a clear error, rank 0's death
ends the others, bad input fails in one line before any process starts."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest

from pdserve.launcher.cli import main
from pdserve.llm import LLM
from pdserve.parallel.errors import TPRankError
from pdserve.sampling_params import SamplingParams

ENGINE = dict(device="cpu", num_blocks=32, block_size=8)
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def test_killed_rank_stops_the_engine_within_seconds():
    llm = LLM("random:tiny-llama-tp", tensor_parallel_size=3, **ENGINE)
    try:
        assert len(llm.generate([[1, 2, 3]], GREEDY)[0].token_ids) == 4
        procs = llm.engine.tp_group.procs
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].join(5)
        start = time.monotonic()
        with pytest.raises(TPRankError, match="rank 1 exited with code -9"):
            llm.generate([[4, 5, 6]], GREEDY)
        assert time.monotonic() - start < 10
        assert procs[2].exitcode is not None  # the rank that was still alive was stopped
        with pytest.raises(TPRankError):  # and the engine stays stopped
            llm.engine.step()
    finally:
        llm.close()
    assert not multiprocessing.active_children()


def test_rank_killed_inside_a_step_fails_that_step():
    """Rank 1 dies while rank 0 waits on it in a collective (gloo: the connection closes)."""
    llm = LLM("random:tiny-llama-tp", tensor_parallel_size=2, **ENGINE)
    try:
        proc = llm.engine.tp_group.procs[1]
        channel = llm.engine.tp_group.channel
        publish = channel.publish

        def publish_then_kill(message):
            publish(message)
            if message[0] != "stop":
                os.kill(proc.pid, signal.SIGKILL)

        channel.publish = publish_then_kill
        start = time.monotonic()
        with pytest.raises(TPRankError, match="rank 1"):
            llm.generate([[1, 2, 3]], GREEDY)
        assert time.monotonic() - start < 15
    finally:
        llm.close()


CHILD = """
import os, sys, time
from pdserve.llm import LLM
if __name__ == "__main__":
    llm = LLM("random:tiny-llama-tp", tensor_parallel_size=2, device="cpu", num_blocks=16)
    print(llm.engine.tp_group.procs[1].pid, flush=True)
    os._exit(0)  # rank 0 dies without closing anything
"""


def test_other_ranks_exit_when_rank_0_dies(tmp_path):
    script = tmp_path / "rank0.py"
    script.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    pid = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    pytest.fail("rank 1 outlived rank 0 by 15 s")


@pytest.mark.parametrize("argv, message", [
    (["-tp", "0"], "argument -tp/--tensor-parallel-size: must be a positive integer, got 0"),
    (["--tensor-parallel-size", "x"], "argument -tp/--tensor-parallel-size: must be an integer, got 'x'"),
    (["-tp", "3"], "--tensor-parallel-size 3 does not divide the 4 attention heads of random:tiny-llama"),
    (["-tp", "2", "--compile"], "--compile (the CPU torch.compile decode) does not support --tensor-parallel-size > 1"),
])
def test_cli_bad_tensor_parallel_size_is_one_line(capsys, argv, message):
    args = ["generate", "--model", "random:tiny-llama", "--device", "cpu", "--prompt", "x", *argv]
    try:
        code = main(args)
    except SystemExit as e:  # argparse
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and message in err, err
    assert not multiprocessing.active_children()  # refused before any rank started


def test_llm_refuses_bad_sizes_before_starting_ranks():
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer, got 0"):
        LLM("random:tiny-llama", tensor_parallel_size=0, device="cpu")
    with pytest.raises(ValueError, match="the 6 KV heads of random:tiny-mistral-tp neither divide by 4 nor divide it"):
        LLM("random:tiny-mistral-tp", tensor_parallel_size=4, device="cpu")
    assert not multiprocessing.active_children()


def test_cli_generate_at_tp2_stops_its_ranks_after_an_error(capsys):
    assert main(["generate", "--model", "random:tiny-llama-tp", "--device", "cpu", "-tp", "2",
                 "--prompt", "hi", "--max-tokens", "3"]) == 2  # no tokenizer: a one-line error, ranks stopped
    assert "no tokenizer" in capsys.readouterr().err
    assert not multiprocessing.active_children()
