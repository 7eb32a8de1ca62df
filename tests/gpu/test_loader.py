"""Configs and weights from GGUF files (written here with gguf.GGUFWriter) and safetensors dirs."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file

from gpu.loader import iter_weights, read_gguf_raw_tensor
from stages.text.checkpoint import UnsupportedModelError, load_model_config
from tests.gpu.conftest import build_tiny_model
from tests.gpu.paged import BlockPool, PagedSequence, build_step
from tests.gpu.test_model import load_ours, reference_logits, run_step

Q = gguf.GGMLQuantizationType

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_LAYER_NAMES[rest]}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Llama Q/K rows."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def hf_order(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of `llama_cpp_permute`."""
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(hf_dir, path, arch: str, types: dict[str, Q] | None = None) -> str:
    raw = json.loads((hf_dir / "config.json").read_text())
    heads, kv_heads = raw["num_attention_heads"], raw["num_key_value_heads"]
    head_dim = raw["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(raw["num_hidden_layers"])
    writer.add_context_length(raw["max_position_embeddings"])
    writer.add_embedding_length(raw["hidden_size"])
    writer.add_feed_forward_length(raw["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(raw["rms_norm_eps"])
    writer.add_rope_freq_base(raw.get("rope_theta") or raw["rope_parameters"]["rope_theta"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(raw["vocab_size"])
    for hf_name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        if hf_name == "lm_head.weight" and raw.get("tie_word_embeddings"):
            continue
        name = gguf_name(hf_name)
        values = tensor.float().numpy()
        if arch == "llama" and ".attn_q." in name:
            values = llama_cpp_permute(values, heads)
        if arch == "llama" and ".attn_k." in name:
            values = llama_cpp_permute(values, kv_heads)
        qtype = (types or {}).get(name, Q.F32)
        if qtype == Q.F32:
            writer.add_tensor(name, np.ascontiguousarray(values))
        elif qtype == Q.F16:
            writer.add_tensor(name, values.astype(np.float16))
        else:
            writer.add_tensor(name, quantize(values, qtype), raw_dtype=qtype)
    rope = raw.get("rope_parameters") or {}
    if rope.get("rope_type") == "llama3":
        from transformers import LlamaConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig.from_pretrained(hf_dir))
        base = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
        writer.add_tensor("rope_freqs.weight", (base / scaled).numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def prefill_logits(model, token_ids: list[int]) -> torch.Tensor:
    from gpu.kv_cache import KVCache

    pool = BlockPool(num_blocks=16, block_size=4, seed=1)
    cache = KVCache(model.config, num_blocks=16, block_size=4)
    seq = PagedSequence(token_ids)
    logits = run_step(model, cache, build_step(pool, [(seq, 12)]))
    return torch.cat(
        [logits, run_step(model, cache, build_step(pool, [(seq, len(token_ids) - 12)]))]
    )


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_f32_gguf_matches_transformers(tiny_models, tmp_path, arch):
    """Llama: Q/K un-permuted and Llama 3 RoPE from rope_freqs; Qwen2: qkv bias, tied, not permuted."""
    path = write_gguf(tiny_models[arch], tmp_path / "tiny.gguf", arch)
    config = load_model_config(path)
    assert config.architecture == arch
    assert config.attention_bias == (arch == "qwen2")
    assert config.tie_word_embeddings == (arch == "qwen2")
    token_ids = np.random.default_rng(0).integers(0, 128, 30).tolist()
    expected = reference_logits(tiny_models[arch], token_ids)
    ours = prefill_logits(load_ours(path), token_ids)
    assert (ours - expected).abs().max().item() < 1e-4 * max(1.0, expected.abs().max().item())


def test_quantized_gguf_tensors_load_as_gguf_dequantizes_them(tiny_models, tmp_path):
    types = {
        "token_embd.weight": Q.F16,
        "blk.0.attn_q.weight": Q.Q8_0,
        "blk.0.attn_k.weight": Q.Q4_0,
        "blk.0.attn_v.weight": Q.BF16,
        "blk.0.ffn_gate.weight": Q.Q4_1,
        "blk.0.ffn_up.weight": Q.Q5_0,
        "blk.0.ffn_down.weight": Q.Q5_1,
        "blk.1.attn_q.weight": Q.Q4_1,
    }
    path = write_gguf(tiny_models["llama"], tmp_path / "quant.gguf", "llama", types)
    config = load_model_config(path)
    ours = dict(iter_weights(path, config, torch.float32))
    original = load_file(str(tiny_models["llama"] / "model.safetensors"))
    reader = gguf.GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}
    for hf_name, weight in original.items():
        name = gguf_name(hf_name)
        if name not in types:
            assert torch.equal(ours[hf_name], weight), hf_name
            continue
        assert by_name[name].tensor_type == types[name]
        # The file's blocks, dequantized by gguf, then put back in HF row order.
        expected = dequantize(by_name[name].data, by_name[name].tensor_type)
        if ".attn_q." in name:
            expected = hf_order(expected, 4)
        if ".attn_k." in name:
            expected = hf_order(expected, 2)
        assert torch.equal(ours[hf_name], torch.from_numpy(np.ascontiguousarray(expected))), hf_name
        error = (ours[hf_name] - weight).abs().max().item()
        assert 0 < error < 0.2 * weight.abs().max().item(), hf_name


def test_raw_q4_1_blocks_come_back_unpermuted(tiny_models, tmp_path):
    path = write_gguf(
        tiny_models["llama"],
        tmp_path / "q41.gguf",
        "llama",
        {"blk.1.attn_q.weight": Q.Q4_1, "blk.1.attn_k.weight": Q.Q4_1},
    )
    config = load_model_config(path)
    ours = dict(iter_weights(path, config, torch.float32))
    for name, hf_name, rows in (
        ("blk.1.attn_q.weight", "model.layers.1.self_attn.q_proj.weight", 64),
        ("blk.1.attn_k.weight", "model.layers.1.self_attn.k_proj.weight", 32),
    ):
        raw = read_gguf_raw_tensor(path, name, config)
        assert raw.ggml_type == "Q4_1"
        assert raw.shape == (rows, 64)
        assert raw.blocks.dtype == np.uint8 and raw.blocks.shape == (rows, 2 * 20)
        assert np.array_equal(dequantize(raw.blocks, Q.Q4_1), ours[hf_name].numpy())


def test_unsupported_architecture_and_tensor_type_are_named(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="'gpt2'"):
        load_model_config(str(tmp_path / "gpt2.gguf"))

    writer = gguf.GGUFWriter(str(tmp_path / "q2k.gguf"), "llama")
    for key, value in (
        ("block_count", 1),
        ("embedding_length", 256),
        ("feed_forward_length", 256),
        ("attention.head_count", 2),
        ("context_length", 64),
    ):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((4, 256), np.float32))
    writer.add_tensor("blk.0.ffn_up.weight", np.zeros((1, 84), np.uint8), raw_dtype=Q.Q2_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path = str(tmp_path / "q2k.gguf")
    with pytest.raises(UnsupportedModelError, match=r"blk\.0\.ffn_up\.weight.*Q2_K"):
        list(iter_weights(path, load_model_config(path), torch.float32))


def test_unsupported_hf_architecture(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_model_config(str(tmp_path))


def test_sharded_safetensors_load_like_a_single_file(tmp_path):
    import transformers

    single = build_tiny_model("qwen2", tmp_path / "single", seed=5)
    model = transformers.AutoModelForCausalLM.from_pretrained(single)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    config = load_model_config(str(tmp_path / "sharded"))
    a = dict(iter_weights(str(single), config, torch.float32))
    b = dict(iter_weights(str(tmp_path / "sharded"), config, torch.float32))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_smollm2_gguf_config(smollm2_gguf):
    config = load_model_config(smollm2_gguf)
    assert (config.architecture, config.num_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert config.intermediate_size == 1536
    assert config.vocab_size == 49152
    assert config.tie_word_embeddings is True
    assert config.attention_bias is False
    assert config.rope_theta == 100000.0
    assert config.rope_scaling is None
    assert config.max_position_embeddings == 8192


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_k_quant_tensors_load_as_gguf_dequantizes_them(tmp_path, qtype):
    """gguf cannot quantize to K-quants, so the file holds random blocks with finite fp16 scales."""
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, in_features = 8, 2 * block_weights
    rng = np.random.default_rng(0)
    # Bytes below 0x3C keep every fp16 field finite and small (no inf/NaN exponents).
    blocks = rng.integers(0, 0x3C, (rows, 2 * block_bytes), dtype=np.uint8)
    path = str(tmp_path / "k.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in (
        ("block_count", 1),
        ("embedding_length", in_features),
        ("feed_forward_length", rows),
        ("attention.head_count", 4),
        ("context_length", 64),
    ):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((4, in_features), np.float32))
    writer.add_tensor("blk.0.ffn_gate.weight", blocks, raw_dtype=qtype)
    writer.add_tensor("blk.0.attn_q.weight", blocks, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    weights = dict(iter_weights(path, load_model_config(path), torch.float32))
    expected = dequantize(blocks, qtype)
    assert expected.shape == (rows, in_features) and np.isfinite(expected).all()
    assert np.array_equal(weights["model.layers.0.mlp.gate_proj.weight"].numpy(), expected)
    assert np.array_equal(
        weights["model.layers.0.self_attn.q_proj.weight"].numpy(), hf_order(expected, 4)
    )
