"""Bad input to the engine, the Python API and the CLI: a clear error, nothing left allocated."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.launcher.cli import main
from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM("random:tiny-llama", device="cpu", num_blocks=16, block_size=16)


def assert_idle(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not llm.engine.requests and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs, needle", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-3), "top_k"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(logprobs=50), "logprobs"),
])
def test_sampling_params_name_the_field(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kwargs)


def test_prompt_over_the_context_and_bad_ids_leave_nothing(llm):
    limit = llm.engine.max_model_len  # 256: 16 blocks of 16 tokens
    with pytest.raises(ValueError, match=f"over the maximum context length of {limit}"):
        llm.generate([[5] * (limit + 1)], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="plus max_tokens"):
        llm.generate([[5] * (limit - 3)], SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[5, 100000]], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["text needs a tokenizer"], SamplingParams(max_tokens=1))
    # a bad prompt among good ones: nothing of the batch is admitted
    with pytest.raises(ValueError):
        llm.generate([[1, 2, 3], [5] * (limit + 1)], SamplingParams(max_tokens=2))
    assert_idle(llm)
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids) == 2
    assert_idle(llm)


def test_duplicate_request_id_and_abort(llm):
    engine = llm.engine
    engine.add_request("dup", [1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [1, 2], SamplingParams(max_tokens=4))
    engine.step()
    assert engine.abort_request("dup")
    assert not engine.abort_request("dup")
    assert_idle(llm)


@pytest.mark.parametrize("spec, needle", [
    ("random:no-such-shape", "unknown random model"),
    ("/no/such/dir", "/no/such/dir"),
    ("missing.gguf", "missing.gguf"),
])
def test_unknown_models_name_the_problem(spec, needle):
    with pytest.raises(ValueError, match=needle):
        LLM(spec, device="cpu")


def test_malformed_gguf_and_config(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="bad.gguf"):
        LLM(str(bad), device="cpu")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path), device="cpu")
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="(?i)unsupported"):
        LLM(str(tmp_path), device="cpu")


@pytest.mark.parametrize("args, flag", [
    (["--max-tokens", "0"], "max-tokens"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "2"], "top-p"),
    (["--top-p", "abc"], "--top-p"),
    (["--model", "random:nope"], "random:nope"),
])
def test_cli_errors_are_one_line(capsys, args, flag):
    try:
        rc = main(["generate", "--prompt", "hi", "--device", "cpu", *args])
    except SystemExit as exc:  # argparse's own errors
        rc = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("pdserve: error: ") and flag in err[0], err


def test_cli_missing_file_exits_non_zero():
    proc = subprocess.run([sys.executable, "-m", "pdserve.launcher.cli", "generate", "--prompt", "x", "--model",
                           "/no/such/model.gguf"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "/no/such/model.gguf" in proc.stderr


def test_a_prefill_released_while_still_waiting_ends_it_and_a_later_abort_is_harmless():
    # a cancelled Prefill runs release then abort_request: release must not orphan a request
    # that was never held (it would be admitted later and hold its KV for good): it ends it
    from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine import LLMEngine
    from pdserve.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model="random:tiny-qwen2", device="cpu", dtype="float32",
                                    cache=CacheConfig(block_size=4, num_blocks=16),
                                    scheduler=SchedulerConfig(role="prefill")))
    engine.add_request("w", [5] * 10, SamplingParams(max_tokens=4))
    engine.release("w")
    assert "w" not in engine.requests and not engine.scheduler.waiting
    assert not engine.abort_request("w")  # already ended: the caller's abort finds nothing, and that is fine
    assert not engine.scheduler.has_work() and not engine.requests
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
