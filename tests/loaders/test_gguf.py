"""GGUF: tiny files written here with gguf.GGUFWriter, and the real SmolLM2 GGUF against transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.config import RopeScaling
from pdserve.loaders import load_model_source
from pdserve.loaders.gguf_loader import llama3_rope_divisors, unpermute_qk

from .conftest import CHATML_TEMPLATE, SPECIAL_TOKENS, byte_level_vocab

HIDDEN, FF, HEADS, KV_HEADS, LAYERS = 64, 96, 4, 2, 2
HEAD_DIM = HIDDEN // HEADS
Q8_TENSOR = "model.layers.1.mlp.down_proj.weight"

GGUF_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def llamacpp_permute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """The row order llama.cpp's converter writes for q/k of arch llama (from its definition):
    per head, view rows as (2, d/2) and store them transposed as (d/2, 2)."""
    return weight.reshape(n_head, 2, weight.shape[0] // n_head // 2,
                          *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{GGUF_BLOCK[rest]}"


def hf_tensors(vocab: int, bias: bool, tied: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    out = {"model.embed_tokens.weight": torch.randn(vocab, HIDDEN, generator=g)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes = {"input_layernorm.weight": (HIDDEN,), "self_attn.q_proj.weight": (q, HIDDEN),
                  "self_attn.k_proj.weight": (kv, HIDDEN), "self_attn.v_proj.weight": (kv, HIDDEN),
                  "self_attn.o_proj.weight": (HIDDEN, q), "post_attention_layernorm.weight": (HIDDEN,),
                  "mlp.gate_proj.weight": (FF, HIDDEN), "mlp.up_proj.weight": (FF, HIDDEN),
                  "mlp.down_proj.weight": (HIDDEN, FF)}
        if bias:
            shapes |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
        for name, shape in shapes.items():
            out[p + name] = torch.randn(*shape, generator=g)
    out["model.norm.weight"] = torch.randn(HIDDEN, generator=g)
    if not tied:
        out["lm_head.weight"] = torch.randn(vocab, HIDDEN, generator=g)
    return out


def write_tiny_gguf(path, arch="llama", *, bias=False, tied=False, q8=True, name="tiny test model",
                    rope_freqs: torch.Tensor | None = None, rope_theta=10000.0, extra=None, drop=()):
    """Writes a tiny GGUF as llama.cpp's converter would; returns the HF tensors it encodes."""
    import gguf

    tokens, merges = byte_level_vocab()
    vocab = len(tokens) + 5  # the model's vocab may exceed the tokenizer's
    tensors = hf_tensors(vocab, bias, tied)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FF)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(SPECIAL_TOKENS.index("<|im_start|>"))
    writer.add_eos_token_id(SPECIAL_TOKENS.index("<|im_end|>"))
    writer.add_chat_template(CHATML_TEMPLATE)
    for key, value in (extra or {}).items():
        writer.add_uint32(key, value)
    for hf, tensor in tensors.items():
        if hf in drop:
            continue
        stored = tensor
        if arch == "llama" and ".q_proj." in hf:
            stored = llamacpp_permute(tensor, HEADS)
        elif arch == "llama" and ".k_proj." in hf:
            stored = llamacpp_permute(tensor, KV_HEADS)
        array = stored.numpy().astype(np.float32)
        if q8 and hf == Q8_TENSOR:
            writer.add_tensor(gguf_name(hf), gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name(hf), array)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


def test_permutation_round_trip():
    w = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    assert not torch.equal(llamacpp_permute(w, 2), w)
    assert torch.equal(unpermute_qk(llamacpp_permute(w, 2), 2), w)
    b = torch.arange(8.0)
    assert torch.equal(unpermute_qk(llamacpp_permute(b, 2), 2), b)


def test_tiny_llama_gguf_exact(tmp_path):
    path = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(path)
    source = load_model_source(str(path))
    c = source.config
    assert (c.architecture, c.hidden_size, c.intermediate_size, c.num_layers) == ("llama", HIDDEN, FF, LAYERS)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.max_position_embeddings) == (HEADS, KV_HEADS, HEAD_DIM, 512)
    assert c.vocab_size == expected["model.embed_tokens.weight"].shape[0]
    assert not c.tie_word_embeddings and not c.attention_bias and c.rope_scaling is None
    assert c.rms_norm_eps == pytest.approx(1e-5) and c.rope_theta == 10000.0
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)
    assert "Q8_0" in source.description and "F32" in source.description
    loaded = dict(source.iter_weights())
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        assert loaded[name].shape == tensor.shape, name
        if name == Q8_TENSOR:
            assert torch.allclose(loaded[name].float(), tensor, atol=tensor.abs().max().item() / 100), name
            assert not torch.equal(loaded[name].float(), tensor)
        else:
            assert torch.equal(loaded[name].float(), tensor), name


def test_tiny_gguf_tokenizer(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, q8=False)
    tokenizer = load_model_source(str(path)).tokenizer
    ids = tokenizer.encode("hello world")
    assert ids == [tokenizer.encode("hello")[0], *tokenizer.encode(" world")]
    assert tokenizer.decode(ids) == "hello world"
    assert tokenizer.eos_token_ids == (2,)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_qwen2_gguf_biases_not_permuted(tmp_path):
    path = tmp_path / "qwen.gguf"
    expected = write_tiny_gguf(path, arch="qwen2", bias=True, q8=False)
    source = load_model_source(str(path))
    assert source.config.architecture == "qwen2" and source.config.attention_bias
    loaded = dict(source.iter_weights())
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name].float(), tensor), name


def test_tied_and_mistral_name(tmp_path):
    path = tmp_path / "mistral.gguf"
    expected = write_tiny_gguf(path, tied=True, q8=False, name="Mistral 7B Instruct")
    source = load_model_source(str(path))
    assert source.config.architecture == "mistral" and source.config.tie_word_embeddings
    loaded = dict(source.iter_weights())
    assert "lm_head.weight" not in loaded and set(loaded) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name].float(), tensor), name


def test_llama3_rope_freqs(tmp_path):
    """rope_freqs as transformers computes llama3 scaling: divisors = default inv_freq / llama3 inv_freq."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf_config = LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, rope_parameters=rope,
                            max_position_embeddings=131072)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    default = 1.0 / 500000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)
    divisors = default / scaled
    path = tmp_path / "llama3.gguf"
    write_tiny_gguf(path, q8=False, rope_freqs=divisors, rope_theta=500000.0)
    config = load_model_source(str(path)).config
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                              original_max_position_embeddings=8192)
    assert torch.allclose(llama3_rope_divisors(HEAD_DIM, 500000.0, config.rope_scaling), divisors.double(),
                          rtol=1e-5)


def test_smollm2_config(smollm2_source):
    c = smollm2_source.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert (c.vocab_size, c.head_dim, c.intermediate_size, c.max_position_embeddings) == (49152, 64, 1536, 8192)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)
    assert "Q4_1" in smollm2_source.description


def test_smollm2_weights_match_transformers(smollm2_source, smollm2_path):
    """transformers' own GGUF loading (dequantize + its reverse permutation) gives the same tensors."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    c = smollm2_source.config
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
            tie_word_embeddings=True))
    reference = load_gguf_checkpoint(smollm2_path, return_tensors=True, model_to_load=model)["tensors"]
    wanted = {"model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.q_proj.weight",
              "model.layers.0.self_attn.k_proj.weight", "model.layers.7.self_attn.k_proj.weight",
              "model.layers.29.self_attn.q_proj.weight", "model.layers.3.self_attn.v_proj.weight",
              "model.layers.5.mlp.down_proj.weight", "model.layers.11.input_layernorm.weight"}
    seen = set()
    names = set()
    for name, tensor in smollm2_source.iter_weights():
        names.add(name)
        if name in wanted:
            ref = reference[name].float()
            assert tensor.shape == ref.shape, name
            assert torch.equal(tensor.float(), ref), name
            seen.add(name)
    assert seen == wanted
    assert names == set(reference) - {"lm_head.weight"}


def test_the_plain_reader_reads_what_the_library_reader_reads(smollm2_path):
    """pdserve opens GGUF files through a faster reader (a plain ndarray view of the memory map):
    every field's type and contents and every tensor's name, type, shape, dtype and bytes equal
    gguf.GGUFReader's."""
    import numpy as np
    from gguf import GGUFReader

    from pdserve.loaders.gguf_loader import _open_reader, _plain_reader_class

    lib, plain = GGUFReader(smollm2_path), _open_reader(smollm2_path)
    assert isinstance(plain, _plain_reader_class().__mro__[1]) and type(plain).__name__ == "PlainGGUFReader"
    assert list(lib.fields) == list(plain.fields)
    for key, field in lib.fields.items():
        other = plain.fields[key]
        assert (field.types, field.data, field.offset) == (other.types, other.data, other.offset), key
        want, got = field.contents(), other.contents()
        assert np.array_equal(want, got) if isinstance(want, np.ndarray) else want == got, key
    assert len(lib.tensors) == len(plain.tensors)
    for a, b in zip(lib.tensors, plain.tensors):
        assert (a.name, a.tensor_type, a.data.shape, a.data.dtype, a.data_offset) == (
            b.name, b.tensor_type, b.data.shape, b.data.dtype, b.data_offset)
        assert np.array_equal(a.data, b.data) and not b.data.flags.writeable
