"""The model's shape and numerics, from a GGUF file's metadata or a Hugging Face config.json."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")

_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


class UnsupportedModelError(ValueError):
    """The checkpoint is of an architecture, tensor type or layout this server does not run."""


@dataclass(slots=True, frozen=True)
class RopeScaling:
    """Llama 3 frequency-dependent RoPE scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(slots=True, frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def open_gguf(path: str) -> Any:
    """A `gguf.GGUFReader` of the file, parsed once per process while the file is unchanged.

    Parsing SmolLM2's metadata (a 49k-token vocabulary and its merges) takes ~3 s, and loading
    asks for the config, the weights and two sets of raw blocks.
    """
    stat = os.stat(path)
    return _open_gguf(os.path.abspath(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _open_gguf(path: str, mtime_ns: int, size: int) -> Any:
    import gguf

    return gguf.GGUFReader(path)


def load_model_config(model_path: str) -> ModelConfig:
    """The config of a Hugging Face model directory or of a `.gguf` file."""
    if os.path.isfile(model_path) and model_path.endswith(".gguf"):
        return config_from_gguf(open_gguf(model_path))
    config_path = os.path.join(model_path, "config.json")
    if not os.path.isfile(config_path):
        raise UnsupportedModelError(
            f"{model_path!r} is neither a .gguf file nor a directory with config.json"
        )
    with open(config_path, encoding="utf-8") as f:
        return config_from_hf(json.load(f))


def _rope_scaling(params: dict[str, Any] | None) -> RopeScaling | None:
    if not params:
        return None
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise UnsupportedModelError(
            f"RoPE scaling type {rope_type!r} is not supported (only 'llama3')"
        )
    return RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    """From a config.json dict, in either the transformers 4 (`rope_theta`, `rope_scaling`) or the
    transformers 5 (`rope_parameters`) spelling."""
    names = raw.get("architectures") or []
    architecture = next((_HF_ARCHITECTURES[n] for n in names if n in _HF_ARCHITECTURES), None)
    if architecture is None:
        architecture = raw.get("model_type")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {names or raw.get('model_type')!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    rope_parameters = raw.get("rope_parameters") or {}
    rope_theta = rope_parameters.get("rope_theta", raw.get("rope_theta", 10000.0))
    scaling_source = rope_parameters if rope_parameters else raw.get("rope_scaling")
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    sliding_window = raw.get("sliding_window")
    if architecture == "qwen2" and not raw.get("use_sliding_window", False):
        sliding_window = None
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        rope_scaling=_rope_scaling(scaling_source),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=architecture == "qwen2" or bool(raw.get("attention_bias", False)),
        sliding_window=None if sliding_window is None else int(sliding_window),
    )


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def config_from_gguf(reader: Any) -> ModelConfig:
    """From an open `gguf.GGUFReader`."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    tensor_names = {t.name for t in reader.tensors}
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    hidden = int(meta("embedding_length"))
    num_heads = int(meta("attention.head_count"))
    num_kv_heads = int(meta("attention.head_count_kv", num_heads))
    head_dim = int(meta("attention.key_length", meta("rope.dimension_count", hidden // num_heads)))
    vocab_size = int(meta("vocab_size", int(embedding.shape[-1])))
    scaling_type = meta("rope.scaling.type")
    rope_scaling = None
    if scaling_type not in (None, "none") and "rope_freqs.weight" not in tensor_names:
        raise UnsupportedModelError(f"GGUF RoPE scaling type {scaling_type!r} is not supported")
    sliding_window = meta("attention.sliding_window")
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=int(meta("block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(meta("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        sliding_window=None if sliding_window is None else int(sliding_window),
    )


@dataclass(slots=True, frozen=True)
class ShardShape:
    """What one tensor-parallel rank holds of a model (Megatron-style): a run of whole GQA
    groups (KV heads and the query heads that attend with them), or with fewer KV heads than
    ranks its share of one group's query heads and that KV head, replicated; and a run of the
    MLP's columns. The vocabulary stays whole here (its shards are padded in gpu/)."""

    config: ModelConfig  # this rank's heads, KV heads and MLP columns
    first_head: int
    first_kv_head: int
    first_column: int


def shard_shape(config: ModelConfig, world_size: int, rank: int) -> ShardShape:
    """Rank `rank` of `world_size`'s share. Groups and columns are spread as evenly as they
    divide (SmolLM2's 3 KV heads on 2 ranks: 1 and 2). UnsupportedModelError when the KV heads
    are fewer than the ranks and do not divide them, or the query heads do not divide either."""
    heads, kv_heads, columns = config.num_heads, config.num_kv_heads, config.intermediate_size
    group = heads // kv_heads
    if kv_heads >= world_size:
        first_kv, end_kv = rank * kv_heads // world_size, (rank + 1) * kv_heads // world_size
        first_head, local_heads, local_kv = (
            first_kv * group,
            (end_kv - first_kv) * group,
            end_kv - first_kv,
        )
    elif world_size % kv_heads == 0 and heads % world_size == 0:
        local_heads, local_kv = heads // world_size, 1
        first_head, first_kv = rank * local_heads, rank * kv_heads // world_size
    else:
        raise UnsupportedModelError(
            f"--tensor-parallel-size {world_size} with {kv_heads} KV heads and {heads} attention "
            f"heads: with fewer KV heads than ranks, both head counts must divide the ranks"
        )
    first_column = rank * columns // world_size
    local = dataclasses.replace(
        config,
        num_heads=local_heads,
        num_kv_heads=local_kv,
        intermediate_size=(rank + 1) * columns // world_size - first_column,
    )
    return ShardShape(local, first_head, first_kv, first_column)


QUANT_BLOCK_WEIGHTS = 32  # GGUF's Q4_1 and Q8_0 blocks (and the int4/int8 groups), along inputs


def quantized_shard_problem(config: ModelConfig, world_size: int) -> str | None:
    """Why the ranks cannot hold quantized weights, or None: a row-parallel projection (o_proj,
    down_proj) is cut along its inputs, which must fall on whole quantization blocks, so that
    every rank's partial sums are the whole model's blocks."""
    d = config.head_dim
    for rank in range(world_size):
        shard = shard_shape(config, world_size, rank)
        heads = (shard.first_head * d, (shard.first_head + shard.config.num_heads) * d)
        columns = (shard.first_column, shard.first_column + shard.config.intermediate_size)
        for name, (start, stop) in (("o_proj", heads), ("down_proj", columns)):
            if start % QUANT_BLOCK_WEIGHTS or stop % QUANT_BLOCK_WEIGHTS:
                return (
                    f"--tensor-parallel-size {world_size}: rank {rank} takes inputs "
                    f"{start}-{stop} of {name}, which do not fall on its quantization blocks "
                    f"of {QUANT_BLOCK_WEIGHTS} weights"
                )
    return None


def cache_shape(config: ModelConfig, world_size: int) -> ModelConfig:
    """The shape KV blocks are sized by: the most KV heads a rank holds. Every rank has as many
    blocks (the scheduler hands out one set), as many as that rank's budget holds."""
    most = max(shard_shape(config, world_size, r).config.num_kv_heads for r in range(world_size))
    return dataclasses.replace(config, num_kv_heads=most)


def kv_block_bytes_for(config: ModelConfig, block_size: int, element_bytes: int) -> int:
    """Bytes one KV block takes across all layers, K and V together (torch-free: the scheduler
    sizes the cache with it too)."""
    return (
        2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element_bytes
    )


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "fp8", "fp8_e4m3")
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")  # vLLM's names for float8 e4m3 with per-tensor scales


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: str, quantization: str | None) -> str:
    """The KV cache's element type. "auto": bfloat16 when the weights are quantized (llama.cpp
    keeps a 16-bit cache as well; it halves what decode attention reads), else the model dtype.
    Attention accumulates in float32 either way. fp8 / fp8_e4m3 (CUDA only): float8_e4m3fn, one byte an
    element, with per-tensor scales. Torch-free: the scheduler sizes the cache with it."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype!r} is not supported; use one of {KV_CACHE_DTYPES}"
        )
    if kv_cache_dtype == "auto":
        return "bfloat16" if quantization is not None else dtype
    if kv_cache_dtype in FP8_KV_CACHE_DTYPES:
        return "float8_e4m3fn"
    return kv_cache_dtype


# What a checkpoint recommends to sample with, named as in generation_config.json; a GGUF file
# carries the same values (when its converter wrote them) under llama.cpp's general.sampling.*.
GENERATION_CONFIG_FILE = "generation_config.json"
_GGUF_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def load_generation_config(path: str) -> dict[str, Any]:
    """The generation config of a Hugging Face directory (its generation_config.json; {} when it
    has none) or of a `.gguf` file (its general.sampling.* metadata, under the HF names)."""
    if os.path.isfile(path) and path.endswith(".gguf"):
        reader = open_gguf(path)
        return {
            name: _field(reader, key)
            for key, name in _GGUF_SAMPLING_KEYS.items()
            if reader.fields.get(key) is not None
        }
    config_path = os.path.join(path, GENERATION_CONFIG_FILE)
    if not os.path.isfile(config_path):
        return {}
    with open(config_path, encoding="utf-8") as f:
        raw = json.load(f)
    if not isinstance(raw, dict):
        raise UnsupportedModelError(f"{config_path} does not hold a JSON object")
    return raw
