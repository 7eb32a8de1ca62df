"""Rewrites a loaded model's linears in place as weight-only quantized ones (GGUF's own blocks
where they are the format asked for), and installs the fused native decoder layers where they fit."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from gpu import native
from gpu.backends import NATIVE_KERNELS
from gpu.fused import FusedLayers
from gpu.loader import GgufRawTensor
from gpu.model import CausalLM
from gpu.quant import (
    Int4Linear,
    Int8Linear,
    NativeQ4Linear,
    NativeQ8Linear,
    ThinThickLinear,
    WithBias,
)
from gpu.tensor_parallel import RowParallel, VocabParallelLMHead

QUANTIZATION_MODES = ("int8", "int4")


def quantize_linears(
    model: CausalLM,
    mode: str,
    raw_blocks: Mapping[str, GgufRawTensor] | None = None,
    compute_dtype: torch.dtype = torch.bfloat16,
    max_thin_rows: int | None = 8,
    use_native: bool | None = None,
) -> None:
    """Replace every decoder-layer linear with a weight-only quantized one, in place.

    "int8": 8-bit, "int4": 4-bit weights. GGUF blocks in `raw_blocks` (by Hugging Face name)
    are taken unchanged where their format is the one asked for (Q4_1 for int4, Q8_0 for int8
    and the LM head), which is lossless; other weights are quantized here. A tensor-parallel
    rank's shard (shard_model) is quantized the same way, given its cut of the blocks
    (shard_raw_blocks): RowParallel keeps its all-reduce around the quantized slice, and the
    vocab-parallel LM head scores its rows with the 8-bit copy.
    With the native CPU kernels (`use_native`, default: where they build) the formats are GGUF's
    own (NativeQ4Linear, NativeQ8Linear); otherwise torch's packed int4/int8 kernels compute in
    `compute_dtype` (their float32 paths are 10-100x slower than bfloat16).
    With `max_thin_rows`, inputs of more rows go through a dense copy instead
    (ThinThickLinear), and the LM head gets an 8-bit copy for thin inputs; the embedding table
    stays in float.
    """
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization {mode!r} is not supported; use one of {QUANTIZATION_MODES}")
    blocks = raw_blocks or {}
    if use_native is None:
        use_native = native.available()
    for index, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{index}"
        targets = (
            (
                layer.self_attn,
                "qkv_proj",
                ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            ),
            (layer.self_attn, "o_proj", ("self_attn.o_proj",)),
            (layer.mlp, "gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
            (layer.mlp, "down_proj", ("mlp.down_proj",)),
        )
        for parent, attr, parts in targets:
            module = getattr(parent, attr)
            if isinstance(module, RowParallel):  # a rank's input slice, before its all-reduce
                parent, attr, module = module, "linear", module.linear
            linear: nn.Linear = module
            raw = [blocks.get(f"{prefix}.{part}.weight") for part in parts]
            quantized = _quantized(linear.weight.detach(), mode, raw, compute_dtype, use_native)
            if max_thin_rows is not None:
                quantized = ThinThickLinear(quantized, linear.weight, max_thin_rows)
            if linear.bias is not None:
                quantized = WithBias(quantized, linear.bias)
            setattr(parent, attr, quantized)
    if max_thin_rows is not None:
        head = model.lm_head.weight.detach()
        tied = model.config.tie_word_embeddings
        raw_head = blocks.get("model.embed_tokens.weight" if tied else "lm_head.weight")
        thin = _quantized(head, "int8", [raw_head], compute_dtype, use_native)
        if isinstance(model.lm_head, VocabParallelLMHead):  # the rank's slice, still gathered
            model.lm_head.local = ThinThickLinear(thin, head, max_thin_rows)
        else:
            model.lm_head = ThinThickLinear(thin, head, max_thin_rows)
        if model.kernels is NATIVE_KERNELS:
            model.fused_layers = FusedLayers.of(model, max_thin_rows)


def _quantized(
    weight: torch.Tensor,  # [N, K]
    mode: str,
    raw: list[GgufRawTensor | None],  # the GGUF parts stacked into this weight, if any
    compute_dtype: torch.dtype,
    use_native: bool,
) -> nn.Module:
    out_features, in_features = weight.shape
    wanted = "Q4_1" if mode == "int4" else "Q8_0"
    whole = all(r is not None and r.ggml_type == wanted for r in raw)
    stacked = np.concatenate([r.blocks for r in raw if r is not None], axis=0) if whole else None
    if use_native:
        if mode == "int4":
            if stacked is not None:
                return NativeQ4Linear.from_q4_1(stacked, out_features, in_features)
            return NativeQ4Linear.from_float(weight)
        if stacked is not None:
            return NativeQ8Linear.from_q8_0(stacked, out_features, in_features)
        return NativeQ8Linear.from_float(weight)
    if mode == "int8":
        return Int8Linear.from_float(weight, compute_dtype)
    if stacked is not None:
        return Int4Linear.from_q4_1(stacked, out_features, in_features, compute_dtype)
    return Int4Linear.from_float(weight, 32, compute_dtype)
