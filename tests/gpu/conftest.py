"""Tiny random Hugging Face checkpoints, built on the fly, and the paths of the real default model."""

from __future__ import annotations

from pathlib import Path

import pytest

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)


def _hf_config(arch: str):
    import transformers

    if arch == "llama":
        return transformers.LlamaConfig(
            **TINY,
            rope_theta=10000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            tie_word_embeddings=False,
        )
    if arch == "llama_tied":
        return transformers.LlamaConfig(**TINY, rope_theta=100000.0, tie_word_embeddings=True)
    if arch == "llama_one_kv":  # GQA down to one KV head; a vocabulary no rank count divides
        return transformers.LlamaConfig(
            **(TINY | {"num_key_value_heads": 1, "vocab_size": 131}), tie_word_embeddings=False
        )
    if arch == "llama_three_kv":  # SmolLM2's 3 KV heads, which 2 ranks split 1 + 2; odd MLP
        shape = {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3}
        return transformers.LlamaConfig(**(TINY | shape | {"intermediate_size": 101}))
    if arch == "llama_wide":  # heads of 32 and 128 MLP columns: two ranks cut whole Q4 blocks
        shape = {"hidden_size": 128, "intermediate_size": 128}
        return transformers.LlamaConfig(**(TINY | shape), tie_word_embeddings=True)
    if arch == "qwen2":
        return transformers.Qwen2Config(**TINY, rope_theta=1000000.0, tie_word_embeddings=True)
    if arch == "mistral":
        return transformers.MistralConfig(
            **TINY, head_dim=16, rope_theta=10000.0, sliding_window=None
        )
    if arch == "mistral_swa":
        return transformers.MistralConfig(**TINY, head_dim=16, rope_theta=10000.0, sliding_window=6)
    raise ValueError(arch)


def build_tiny_model(arch: str, directory: Path, seed: int = 0) -> Path:
    """Save a random tiny `arch` model (fp32 safetensors) in `directory`."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = _hf_config(arch)
    classes = {
        "llama": transformers.LlamaForCausalLM,
        "llama_tied": transformers.LlamaForCausalLM,
        "llama_one_kv": transformers.LlamaForCausalLM,
        "llama_three_kv": transformers.LlamaForCausalLM,
        "llama_wide": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "mistral": transformers.MistralForCausalLM,
        "mistral_swa": transformers.MistralForCausalLM,
    }
    model = classes[arch](config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)  # qkv bias must matter in the comparison
    model.save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {
        arch: build_tiny_model(arch, root / arch)
        for arch in ("llama", "llama_tied", "qwen2", "mistral", "mistral_swa")
    }
