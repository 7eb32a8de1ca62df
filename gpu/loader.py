"""Weights from a GGUF file or a Hugging Face safetensors directory, under Hugging Face names.

GGUF tensors are dequantized with the `gguf` package; the Q/K rows that llama.cpp's converter
permuted for its interleaved RoPE are put back in Hugging Face order (rotate-half RoPE).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog
import torch

from stages.text.checkpoint import ModelConfig, UnsupportedModelError, open_gguf

log = structlog.get_logger(__name__)

SUPPORTED_GGUF_TYPES = frozenset(
    {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"}
)
# llama.cpp's converter permutes Q/K only for these; Qwen2 files keep Hugging Face order.
_PERMUTED_ARCHITECTURES = frozenset({"llama", "mistral"})
_PROGRESS_EVERY_FRACTION = 0.1

_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
}
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclass(slots=True, frozen=True)
class GgufRawTensor:
    """A quantized GGUF tensor's blocks as stored, rows in Hugging Face order.

    `blocks` is [out_features, bytes_per_row] uint8: each row holds in_features / block_weights
    consecutive blocks along the input dimension (Q4_1: 32 weights in 20 bytes, fp16 d then fp16 m
    then 16 bytes of nibbles, w = d * q + m).
    """

    blocks: np.ndarray  # [out_features, bytes_per_row] uint8
    shape: tuple[int, int]  # (out_features, in_features)
    ggml_type: str


def gguf_to_hf_name(name: str) -> str:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    match = _GGUF_LAYER_RE.match(name)
    if match is None or match.group(2) not in _GGUF_LAYER_NAMES:
        raise UnsupportedModelError(f"GGUF tensor {name!r} is not part of a supported architecture")
    return f"model.layers.{match.group(1)}.{_GGUF_LAYER_NAMES[match.group(2)]}"


def _unpermute_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's `reshape(n_head, 2, dim // n_head // 2, ...).swapaxes(1, 2)` on rows.

    Works on dequantized weights [out, in], biases [out] and raw block rows [out, bytes].
    """
    half = rows.shape[0] // num_heads // 2
    permuted = rows.reshape(num_heads, half, 2, *rows.shape[1:])
    return permuted.swapaxes(1, 2).reshape(rows.shape)


def _rows_permuted_heads(name: str, config: ModelConfig) -> int | None:
    """The head count to un-permute `name` with, or None when it is not permuted."""
    if config.architecture not in _PERMUTED_ARCHITECTURES:
        return None
    if ".attn_q." in name:
        return config.num_heads
    if ".attn_k." in name:
        return config.num_kv_heads
    return None


def _check_type(tensor: Any) -> str:
    type_name = tensor.tensor_type.name
    if type_name not in SUPPORTED_GGUF_TYPES:
        raise UnsupportedModelError(
            f"GGUF tensor {tensor.name!r} has type {type_name}, which is not supported; "
            f"supported: {', '.join(sorted(SUPPORTED_GGUF_TYPES))}"
        )
    return type_name


def _iter_gguf(reader: Any, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize

    for tensor in reader.tensors:
        _check_type(tensor)
    for tensor in reader.tensors:
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        heads = _rows_permuted_heads(tensor.name, config)
        if heads is not None:
            values = _unpermute_rows(values, heads)
        if not values.flags.writeable or not values.flags.c_contiguous:
            values = np.array(values, dtype=np.float32, order="C")  # F32 tensors are file mmaps
        yield gguf_to_hf_name(tensor.name), torch.from_numpy(values)


def _raw_tensor(tensor: Any, config: ModelConfig) -> GgufRawTensor:
    type_name = _check_type(tensor)
    blocks = np.asarray(tensor.data)
    if blocks.ndim != 2 or blocks.dtype != np.uint8:
        raise UnsupportedModelError(
            f"GGUF tensor {tensor.name!r} ({type_name}) is not a block-quantized matrix"
        )
    heads = _rows_permuted_heads(tensor.name, config)
    if heads is not None:
        blocks = _unpermute_rows(blocks, heads)
    return GgufRawTensor(
        blocks=np.ascontiguousarray(blocks),
        shape=(blocks.shape[0], int(tensor.shape[0])),
        ggml_type=type_name,
    )


def read_gguf_raw_tensor(path: str, tensor_name: str, config: ModelConfig) -> GgufRawTensor:
    """The raw blocks of one GGUF tensor (`blk.0.attn_q.weight`), Q/K rows un-permuted.

    Un-permuting reorders whole output rows, and blocks run along the input dimension, so the
    blocks stay intact.
    """
    reader = open_gguf(path)
    tensor = next((t for t in reader.tensors if t.name == tensor_name), None)
    if tensor is None:
        raise KeyError(f"no tensor {tensor_name!r} in {path!r}")
    return _raw_tensor(tensor, config)


def read_gguf_raw_tensors(
    path: str, config: ModelConfig, ggml_type: str
) -> dict[str, GgufRawTensor]:
    """Every matrix of `ggml_type` (e.g. "Q4_1") in the file, by Hugging Face name."""
    reader = open_gguf(path)
    return {
        gguf_to_hf_name(t.name): _raw_tensor(t, config)
        for t in reader.tensors
        if t.tensor_type.name == ggml_type and len(t.shape) == 2
    }


def _iter_safetensors(directory: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    index_path = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(directory, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise UnsupportedModelError(
            f"{directory!r} has no model.safetensors or model.safetensors.index.json"
        )
    for file_name in files:
        with safe_open(os.path.join(directory, file_name), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def _count_safetensors(model_path: str) -> int:
    index_path = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            return len(json.load(f)["weight_map"])
    from safetensors import safe_open

    with safe_open(os.path.join(model_path, "model.safetensors"), framework="pt") as f:
        return len(list(f.keys()))


def iter_weights(
    model_path: str, config: ModelConfig, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor in `dtype`) for every weight, logging progress as it goes.

    `rope_freqs` (GGUF Llama 3 RoPE frequency divisors) stays float32.
    """
    if os.path.isfile(model_path) and model_path.endswith(".gguf"):
        reader = open_gguf(model_path)
        total = len(reader.tensors)
        source = _iter_gguf(reader, config)
    else:
        total = _count_safetensors(model_path)
        source = _iter_safetensors(model_path)
    every = max(1, int(total * _PROGRESS_EVERY_FRACTION))
    for done, (name, tensor) in enumerate(source, start=1):
        yield name, tensor if name == "rope_freqs" else tensor.to(dtype)
        if done % every == 0 or done == total:
            log.info(
                "loading weights",
                model=model_path,
                tensors_done=done,
                tensors_total=total,
                percent=round(100 * done / total),
            )
