"""`pdserve profile --mixed` on a tiny random model (CPU): the engine's own scheduler and runner
time steps of a decode batch plus a prefill chunk, into a mixed table that router.placement.profiles loads."""

from __future__ import annotations

import json

import pytest

from pdserve.launcher.cli import main
from pdserve.launcher.profile import Profiler
from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.router.placement.profiles import load_profile

TINY = ["--model", "random:tiny-llama", "--device", "cpu", "--kv-cache-gib", "0.01", "--quiet",
        "--prefill-tokens", "16,64", "--decode-batches", "1,2", "--decode-contexts", "16,64",
        "--repeats", "1", "--decode-steps", "2"]


def test_profile_mixed_writes_a_loadable_mixed_table(tmp_path, capsys):
    out = tmp_path / "profile.json"
    rc = main(["profile", *TINY, "--out", str(out), "--max-num-seqs", "8", "--max-num-batched-tokens", "128",
               "--mixed", "--mixed-batches", "1,2,64", "--mixed-chunks", "16,64,1000", "--mixed-context", "48"])
    assert rc == 0
    assert "3x2 mixed points at context 48" in capsys.readouterr().out
    profile = load_profile(str(out))
    assert profile.has_mixed and profile.mixed_context == 48
    # batch 64 is measured at max-num-seqs - 1 = 7 (the prompt takes a slot); chunk 1000 is over
    # the 128-token budget: left out
    assert profile.mixed_batch_sizes == (1, 2, 7)
    assert profile.mixed_chunk_tokens == (16, 64)
    assert all(0 < t < 1.0 for row in profile.mixed_times for t in row)
    assert profile.mixed_step_seconds(4, 40, 60) > 0
    # the other tables are as without --mixed
    assert (profile.decode_batch_sizes, profile.decode_contexts) == ((1, 2), (16, 64))
    assert json.loads(out.read_text())["mixed"]["batch_sizes"] == [1, 2, 7]


def test_without_mixed_the_profile_has_no_mixed_table(tmp_path):
    out = tmp_path / "profile.json"
    assert main(["profile", *TINY, "--out", str(out)]) == 0
    assert "mixed" not in json.loads(out.read_text())
    assert not load_profile(str(out)).has_mixed


def test_mixed_grid_flags_need_mixed(tmp_path, capsys):
    rc = main(["profile", *TINY, "--out", str(tmp_path / "p.json"), "--mixed-chunks", "64"])
    assert rc != 0
    assert "--mixed-chunks needs --mixed" in capsys.readouterr().err


def test_each_timed_step_is_the_decodes_plus_one_chunk_and_the_engine_is_left_as_it_was():
    config = EngineConfig(model="random:tiny-llama", device="cpu",
                          cache=CacheConfig(num_blocks=256, block_size=16),
                          scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8))
    profiler = Profiler(config, repeats=1, decode_steps=3, progress=False)
    engine = profiler.engine
    batches = []
    schedule = engine.scheduler.schedule

    def recording():
        batch = schedule()
        batches.append(sorted(batch.num_new_tokens))
        return batch

    engine.scheduler.schedule = recording
    seconds = profiler.mixed_step_seconds(3, 32, 40)
    assert seconds > 0
    # the last 4 steps (a warm-up and 3 timed): 3 decodes of one token and a 32-token chunk,
    # under a budget of 3 + 32 tokens (the engine's 64 would give a chunk of 61)
    assert batches[-4:] == [[1, 1, 1, 32]] * 4
    assert batches[-5] == [1, 1, 1]  # the decode-only step before the prompt arrives
    assert engine.scheduler.config.max_num_batched_tokens == 64
    assert not engine.requests and engine.scheduler.block_manager.num_free_blocks == 256
    assert engine.scheduler.block_manager.enable_prefix_caching is False


def test_a_grid_that_fits_nothing_is_refused():
    config = EngineConfig(model="random:tiny-llama", device="cpu", cache=CacheConfig(num_blocks=8, block_size=16),
                          scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8))
    profiler = Profiler(config, repeats=1, decode_steps=2, progress=False)
    with pytest.raises(ValueError, match="no mixed"):
        profiler.mixed_grid([4], [64], 200)


def test_the_decode_step_before_the_prompt_launches_nothing_ahead():
    """With CUDA graphs and overlapped steps (as on a GPU), the decode-only step before the
    prompt arrives would launch the next decode step ahead, and the first mixed step would only
    collect it. The profile runs that step without the overlap and restores it after."""
    config = EngineConfig(model="random:tiny-llama", device="cpu", overlap_steps=True,
                          cache=CacheConfig(num_blocks=256, block_size=16),
                          scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8))
    profiler = Profiler(config, repeats=1, decode_steps=3, progress=False)
    engine = profiler.engine
    engine.runner.use_cuda_graphs = True  # off CUDA: the graph path's static buffers, eagerly
    assert engine.overlap_steps
    ahead = engine.num_steps_ahead
    assert profiler.mixed_step_seconds(2, 16, 40) > 0
    assert engine.overlap_steps
    assert engine.num_steps_ahead == ahead
    assert not engine.requests and not engine.has_unfinished_requests()
