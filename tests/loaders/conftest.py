"""Shared fixtures: the real SmolLM2 GGUF (loaded once per session) and tiny tokenizers."""

from __future__ import annotations

import os

import pytest

from pdserve.loaders import ModelSource, default_model_path, load_model_source

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    try:
        return default_model_path()
    except ValueError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def smollm2_source(smollm2_path: str) -> ModelSource:
    return load_model_source("smollm2")


def byte_level_vocab(extra_words: tuple[str, ...] = ("hello", "world")) -> tuple[list[str], list[str]]:
    """Special tokens, the 256 byte-level symbols and a few merged words, plus their merges."""
    from tokenizers import pre_tokenizers

    tokens = list(SPECIAL_TOKENS) + sorted(pre_tokenizers.ByteLevel.alphabet())
    merges: list[str] = []
    for word in extra_words:
        piece = word[0]
        for ch in word[1:]:
            merges.append(f"{piece} {ch}")
            piece += ch
            if piece not in tokens:
                tokens.append(piece)
    return tokens, merges


def save_tiny_hf_tokenizer(directory: str, chat_template: str | None = CHATML_TEMPLATE) -> int:
    """Writes a byte-level BPE tokenizer (tokenizer.json + tokenizer_config.json); returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens, merges = byte_level_vocab()
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token=None
    )
    hf.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    if chat_template is not None:
        hf.chat_template = chat_template
    os.makedirs(directory, exist_ok=True)
    hf.save_pretrained(directory)
    return len(hf)
