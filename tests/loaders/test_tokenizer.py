"""Tokenizer wrapper and IncrementalDetokenizer, on the SmolLM2 GGUF tokenizer."""

from __future__ import annotations

import pytest

from pdserve.loaders import load_model_source
from pdserve.tokenizer import IncrementalDetokenizer, Tokenizer

from .conftest import save_tiny_hf_tokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nnewlines  ",
    "naïve café — déjà vu",
    "日本語のテキストと中文混合",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "code: def f(x):\n    return x ** 2  # ok",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_source) -> Tokenizer:
    return smollm2_source.tokenizer


def test_properties(tokenizer):
    assert tokenizer.vocab_size == 49152
    assert tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_ids == (2,)
    assert tokenizer.has_chat_template


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids and all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text


def test_ids_match_transformers_gguf_tokenizer(tokenizer):
    """The wrapper (straight to the Rust backend) agrees with transformers' API on the tokenizer
    transformers built from the GGUF (AutoTokenizer.from_pretrained(dir, gguf_file=...))."""
    reference = tokenizer.hf_tokenizer
    assert type(reference).__module__.startswith("transformers.")
    for text in TEXTS + ["<|im_start|>user\nhi<|im_end|>"]:
        assert tokenizer.encode(text) == reference.encode(text), text
        assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)
        ids = reference.encode(text)
        assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True)


def test_special_tokens(tokenizer):
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tokenizer.decode(ids) == "user\nhi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    assert tokenizer.token_to_str(2) == "<|im_end|>"
    assert tokenizer.token_to_str(tokenizer.encode(" world")[0]) == " world"


def test_chat_template(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    rendered = tokenizer.apply_chat_template(messages)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    default_system = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert default_system.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    no_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert no_prompt.endswith("<|im_end|>\n")


def test_no_chat_template_raises(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path)
    save_tiny_hf_tokenizer(str(tmp_path), chat_template=None)
    tokenizer = load_model_source(str(tmp_path)).tokenizer
    assert not tokenizer.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def _stream(tokenizer, ids, prompt_ids=None, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.text
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    deltas = _stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert not any("\ufffd" in d for d in deltas)


def test_incremental_holds_back_split_characters(tokenizer):
    ids = tokenizer.encode("😀日本")
    assert len(ids) > 3  # byte-level pieces of multi-byte characters
    deltas = _stream(tokenizer, ids)
    assert "" in deltas[:-1]  # something was held back until its character completed
    assert "".join(deltas) == "😀日本"


def test_incremental_with_prompt(tokenizer):
    prompt = tokenizer.encode("<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n")
    generated = tokenizer.encode(" Hi there 👋, 你好!<|im_end|>")
    deltas = _stream(tokenizer, generated, prompt_ids=prompt)
    assert "".join(deltas) == " Hi there 👋, 你好!"
    full = tokenizer.decode(prompt + generated, skip_special_tokens=False)
    kept = _stream(tokenizer, generated, prompt_ids=prompt, skip_special_tokens=False)
    assert full.endswith("".join(kept)) and "".join(kept).endswith("<|im_end|>")


def test_flush_emits_incomplete_tail(tokenizer):
    ids = tokenizer.encode("ok 😀")
    detok = IncrementalDetokenizer(tokenizer)
    partial = "".join(detok.add(i) for i in ids[:-1])
    assert partial == "ok"  # " " shares a token with the emoji's first bytes
    tail = detok.flush()
    assert partial + tail == tokenizer.decode(ids[:-1]) and tail.endswith("\ufffd")
    assert detok.text == partial + tail


def test_byte_level_table_only_for_byte_level_bpe(tokenizer):
    skip, keep = tokenizer.byte_table  # SmolLM2: BPE with the ByteLevel decoder
    assert len(skip) == len(keep) >= tokenizer.vocab_size
    eos = tokenizer.eos_token_ids[0]
    assert skip[eos] == b"" and keep[eos] == tokenizer.token_to_str(eos).encode()
    hello = tokenizer.encode(" hello", add_special_tokens=False)
    assert b"".join(skip[i] for i in hello) == b" hello"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_byte_table_detokenizer_equals_window_decoding(tokenizer, skip_special_tokens):
    """The table path and the window-decoding path emit the same deltas, token by token, on
    text with multi-byte characters and on random ids (special tokens and invalid byte runs)."""
    import random

    rng = random.Random(0)
    streams = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS + ["naïve — “ok” 😀🚀 日本語\n\t x"]]
    streams += [[rng.randrange(tokenizer.vocab_size) for _ in range(60)] for _ in range(40)]
    for ids in streams:
        fast = IncrementalDetokenizer(tokenizer, [5, 6], skip_special_tokens=skip_special_tokens)
        slow = IncrementalDetokenizer(tokenizer, [5, 6], skip_special_tokens=skip_special_tokens)
        assert fast._bytes is not None
        slow._bytes = None  # the window-decoding path every other tokenizer takes
        assert [fast.add(i) for i in ids] + [fast.flush()] == [slow.add(i) for i in ids] + [slow.flush()]
        assert fast.text == slow.text


# ---- the on-disk cache of GGUF tokenizers -------------------------------------------------------

_TEXTS = ["The capital of France is", "  leading spaces\tand tabs\n\nnew lines", "émigré naïve 東京 🚀 ü",
          "<|im_start|>user\nhi<|im_end|>", "def f(x):\n    return x ** 2  # code", "1234567890 3.14159", ""]


def _fresh_gguf_tokenizer(path, monkeypatch, cache_dir):
    from pdserve import tokenizer as tk

    tk._gguf_hf_tokenizer.cache_clear()
    monkeypatch.setenv("PDSERVE_CACHE_DIR", cache_dir)
    try:
        return tk.load_gguf_tokenizer(path)
    finally:
        tk._gguf_hf_tokenizer.cache_clear()


def test_gguf_tokenizer_from_the_disk_cache_equals_the_conversion(smollm2_path, tmp_path, monkeypatch):
    """The second process loads the saved conversion: same ids, text, special tokens and chat prompt
    as the conversion (the first, which converted and saved it)."""
    converted = _fresh_gguf_tokenizer(smollm2_path, monkeypatch, str(tmp_path))  # converts and saves
    entries = list((tmp_path / "tokenizers").iterdir())
    assert len(entries) == 1 and (entries[0] / "tokenizer.json").is_file()
    cached = _fresh_gguf_tokenizer(smollm2_path, monkeypatch, str(tmp_path))  # from the cache
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    tok = cached
    assert tok.vocab_size == converted.vocab_size and tok.bos_token_id == converted.bos_token_id
    assert tok.chat_template == converted.chat_template
    assert tok.apply_chat_template(messages) == converted.apply_chat_template(messages)
    for text in _TEXTS:
        ids = converted.encode(text)
        assert tok.encode(text) == ids and tok.encode(text, add_special_tokens=False) == converted.encode(
            text, add_special_tokens=False)
        assert tok.decode(ids) == converted.decode(ids)
        assert tok.decode(ids, skip_special_tokens=False) == converted.decode(ids, skip_special_tokens=False)
    assert [tok.token_to_str(i) for i in range(0, converted.vocab_size, 997)] == [
        converted.token_to_str(i) for i in range(0, converted.vocab_size, 997)]
    assert tok.byte_table == converted.byte_table


def test_a_damaged_cache_entry_is_converted_again(smollm2_path, tmp_path, monkeypatch, caplog):
    good = _fresh_gguf_tokenizer(smollm2_path, monkeypatch, str(tmp_path))
    (entry,) = (tmp_path / "tokenizers").iterdir()
    (entry / "tokenizer.json").write_text("{not json")
    with caplog.at_level("WARNING", logger="pdserve.tokenizer"):
        again = _fresh_gguf_tokenizer(smollm2_path, monkeypatch, str(tmp_path))
    assert "unreadable" in caplog.text
    assert again.encode(_TEXTS[2]) == good.encode(_TEXTS[2])
    assert (entry / "tokenizer.json").read_text().startswith("{\n")  # replaced by a whole one


def test_no_cache_when_its_folder_cannot_be_written(smollm2_path, tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache folder would go")
    tok = _fresh_gguf_tokenizer(smollm2_path, monkeypatch, str(blocked))
    assert tok.encode(_TEXTS[0]) and blocked.is_file()


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    from pdserve.tokenizer import cache_root

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    assert cache_root() == str(tmp_path)
    monkeypatch.setenv("PDSERVE_CACHE_DIR", "")
    assert cache_root() is None
    monkeypatch.delenv("PDSERVE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == str(tmp_path / "xdg" / "pdserve")


def test_the_kernels_name_clash_with_transformers_names_the_fix():
    """transformers >= 5.25 imports the Hugging Face `kernels` package, whose name this project's
    kernels/ takes: the tokenizer's error says what to do."""
    from pdserve.tokenizer import _one_line

    clash = ImportError("cannot import name 'CUDAProperties' from 'kernels' (/somewhere/kernels/__init__.py)")
    assert "pip install 'transformers<5.25'" in _one_line(clash)
    assert _one_line(ImportError("No module named 'jinja2'")) == "No module named 'jinja2'"
