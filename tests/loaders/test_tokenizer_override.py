"""--tokenizer: a Hugging Face directory, a tokenizer.json or a .gguf replaces the model's own
tokenizer, in the loaders, the engine (LLM), the CLI, `pdserve up` settings and the router."""

from __future__ import annotations

import shutil

import pytest

from pdserve.launcher.cli import build_parser, main
from pdserve.launcher.cluster.config import load_up_config
from pdserve.launcher.cluster.serving import load_router_model
from pdserve.launcher.cluster.up import pool_specs
from pdserve.llm import LLM
from pdserve.loaders import load_model_source, load_tokenizer
from pdserve.sampling_params import SamplingParams
from tests.loaders.conftest import save_tiny_hf_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("tok")
    save_tiny_hf_tokenizer(str(directory))
    return str(directory)


def test_random_shape_takes_the_tokenizer_and_its_bos_eos(tok_dir):
    source = load_model_source("random:tiny-llama", tokenizer=tok_dir)
    tok = source.tokenizer
    assert tok is not None and tok.source == tok_dir and tok.has_chat_template
    assert source.config.bos_token_id == tok.bos_token_id == 1  # <|im_start|>
    assert source.config.eos_token_ids == tok.eos_token_ids == (2,)  # <|im_end|>
    assert tok_dir in source.description
    assert load_model_source("random:tiny-llama").tokenizer is None  # without it: token ids only


def test_tokenizer_json_alone_and_inside_a_directory(tok_dir, tmp_path):
    inside = load_tokenizer(f"{tok_dir}/tokenizer.json")
    assert inside.has_chat_template and inside.eos_token_ids == (2,)  # the directory's config applies
    alone = tmp_path / "vocab.json"
    shutil.copy(f"{tok_dir}/tokenizer.json", alone)
    tok = load_tokenizer(str(alone))
    assert tok.source == str(alone) and not tok.has_chat_template and tok.eos_token_ids == ()
    assert tok.encode("hello world", add_special_tokens=False) == inside.encode("hello world", add_special_tokens=False)
    source = load_model_source("random:tiny-llama", tokenizer=str(alone))
    assert source.tokenizer.source == str(alone)


def test_gguf_tokenizer_overrides_and_too_large_vocab_is_refused(smollm2_path, tok_dir):
    source = load_model_source("random:llama-3.2-1b", tokenizer=smollm2_path)
    assert source.tokenizer.source == smollm2_path and source.tokenizer.vocab_size == 49152
    own = load_model_source(smollm2_path, tokenizer=tok_dir)  # a real model's own tokenizer replaced
    assert own.tokenizer.source == tok_dir and own.config.vocab_size == 49152
    with pytest.raises(ValueError, match=r"--tokenizer .*49152 tokens, more than the vocabulary of random:tiny-llama"):
        load_model_source("random:tiny-llama", tokenizer=smollm2_path)


@pytest.mark.parametrize("bad, needle", [("/nonexistent/tok", "tokenizer not found"), ("README.md", "not a tokenizer")])
def test_bad_tokenizer_paths(bad, needle):
    with pytest.raises(ValueError, match=needle):
        load_model_source("random:tiny-llama", tokenizer=bad)


def test_llm_and_generate_command_use_it(tok_dir, capsys):
    llm = LLM("random:tiny-llama", tokenizer=tok_dir, device="cpu", num_blocks=16)
    out = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(max_tokens=3, temperature=0))[0]
    assert len(out.token_ids) <= 3 and isinstance(out.text, str)
    assert llm.tokenizer.source == tok_dir
    rc = main(["generate", "--model", "random:tiny-llama", "--tokenizer", tok_dir, "--device", "cpu",
               "--kv-cache-gib", "0.01", "--prompt", "hello", "--max-tokens", "3", "--raw"])
    assert rc == 0
    rc = main(["generate", "--model", "random:tiny-llama", "--tokenizer", "/nonexistent/tok", "--prompt", "x"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "/nonexistent/tok: tokenizer not found" in err[0]


def test_every_model_loading_command_has_the_flag(tok_dir):
    parser = build_parser()
    for argv in (["generate", "--prompt", "x"], ["worker", "--role", "decode"], ["up"],
                 ["router", "--worker", "prefill=h:1"], ["profile", "--out", "p.json"]):
        assert parser.parse_args([*argv, "--tokenizer", tok_dir]).tokenizer == tok_dir, argv


def test_up_config_and_router(tok_dir, tmp_path):
    path = tmp_path / "up.yaml"
    path.write_text(f"model: random:tiny-llama\ntokenizer: {tok_dir}\n")
    config = load_up_config({}, str(path))
    assert config.tokenizer == tok_dir
    assert all(spec.engine.tokenizer == tok_dir for spec in pool_specs(config, 0))
    model = load_router_model(config.model, tokenizer=config.tokenizer)
    assert model.tokenizer.source == tok_dir and model.max_model_len == 512
    with pytest.raises(ValueError, match="--model: 'random:tiny-llama' has no tokenizer.*--tokenizer"):
        load_router_model("random:tiny-llama")
