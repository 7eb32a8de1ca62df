"""One Llama-family decoder (Llama 1/2/3, SmolLM2, Mistral, Qwen2) over the paged KV cache.

Module names follow Hugging Face's, except that Q/K/V and gate/up are fused into `qkv_proj`
([q; k; v] rows) and `gate_up_proj` ([gate; up] rows), one matmul each.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gpu import attention as torch_attention
from gpu.config import ModelConfig, RopeScaling, UnsupportedModelError
from gpu.loader import GgufRawTensor
from gpu.quant import Int4Linear, Int8Linear, ThinThickLinear

QUANTIZATION_MODES = ("int8", "int4")

WriteKV = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
PagedAttention = Callable[..., torch.Tensor]


@dataclass(slots=True, frozen=True)
class AttentionBackend:
    """The two attention functions; the torch reference or the Triton kernels, same signatures."""

    write_kv: WriteKV
    paged_attention: PagedAttention


TORCH_ATTENTION = AttentionBackend(torch_attention.write_kv, torch_attention.paged_attention)


@dataclass(slots=True, frozen=True)
class AttentionInputs:
    """One step's batch layout, shared by every layer."""

    query_start_loc: torch.Tensor  # [B + 1] int32
    context_lens: torch.Tensor  # [B] int32, cached + new
    block_tables: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:  # -> [head_dim // 2] float32
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if config.rope_scaling is not None:
        inv_freq = _llama3_scaled(inv_freq, config.rope_scaling)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1 RoPE: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between."""
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, hidden]
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def apply_rotary(
    x: torch.Tensor,  # x: [T, heads, D]
    cos: torch.Tensor,  # cos: [T, 1, D // 2] float32
    sin: torch.Tensor,  # sin: [T, 1, D // 2] float32
) -> torch.Tensor:
    """Rotate-half RoPE (Hugging Face layout: pairs are (i, i + D/2)), in float32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        self.qkv_proj = nn.Linear(
            config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=False)
        self.scale = config.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,  # x: [T, hidden]
        cos: torch.Tensor,  # cos: [T, 1, D // 2]
        sin: torch.Tensor,  # sin: [T, 1, D // 2]
        kv: tuple[torch.Tensor, torch.Tensor],  # ([num_blocks, block_size, KVH, D]) * 2
        inputs: AttentionInputs,
    ) -> torch.Tensor:  # -> [T, hidden]
        c = self.config
        q, k, v = self.qkv_proj(x).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = apply_rotary(q.view(-1, c.num_heads, c.head_dim), cos, sin)
        k = apply_rotary(k.view(-1, c.num_kv_heads, c.head_dim), cos, sin)
        v = v.view(-1, c.num_kv_heads, c.head_dim)
        k_cache, v_cache = kv
        self.backend.write_kv(k, v, k_cache, v_cache, inputs.slot_mapping)
        out = self.backend.paged_attention(
            q,
            k_cache,
            v_cache,
            inputs.block_tables,
            inputs.query_start_loc,
            inputs.context_lens,
            self.scale,
            c.sliding_window,
        )
        return self.o_proj(out.reshape(-1, c.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, hidden]
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,  # x: [T, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        inputs: AttentionInputs,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, inputs)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, backend) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend = TORCH_ATTENTION) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config, backend)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.inv_freq: torch.Tensor  # [head_dim // 2] float32, RoPE angular frequencies
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # input_ids: [T] int64
        positions: torch.Tensor,  # positions: [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        inputs: AttentionInputs,
        logits_indices: torch.Tensor,  # logits_indices: [S] int64, rows of T that need logits
    ) -> torch.Tensor:  # -> [S, vocab] float32
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)  # [T, D/2]
        cos, sin = freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)
        x = self.model.embed_tokens(input_ids)
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv, inputs)
        x = self.model.norm(x[logits_indices])
        return self.lm_head(x).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the (fused) parameters; every one must be filled."""
        c = self.config
        params = dict(self.named_parameters(remove_duplicate=False))
        fused = {
            "q_proj": ("qkv_proj", 0, c.q_size),
            "k_proj": ("qkv_proj", c.q_size, c.kv_size),
            "v_proj": ("qkv_proj", c.q_size + c.kv_size, c.kv_size),
            "gate_proj": ("gate_up_proj", 0, c.intermediate_size),
            "up_proj": ("gate_up_proj", c.intermediate_size, c.intermediate_size),
        }
        expected = {hf for n in params for hf in self._hf_names(n, fused)}
        if c.tie_word_embeddings:
            expected.discard("lm_head.weight")
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or (
                name == "lm_head.weight" and c.tie_word_embeddings
            ):
                continue
            if name == "rope_freqs":
                self.inv_freq = rope_inv_freq(c) / tensor.float().to(self.inv_freq.device)
                continue
            parts = name.split(".")
            target, offset, size = name, 0, None
            if len(parts) >= 2 and parts[-2] in fused:
                module, offset, size = fused[parts[-2]]
                target = ".".join([*parts[:-2], module, parts[-1]])
            if target not in params:
                raise UnsupportedModelError(
                    f"checkpoint tensor {name!r} has no place in a {c.architecture} model"
                )
            param = params[target]
            dest = param if size is None else param.narrow(0, offset, size)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise UnsupportedModelError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            loaded.add(name)
        missing = expected - loaded
        if missing:
            raise UnsupportedModelError(
                f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}"
            )

    @staticmethod
    def _hf_names(name: str, fused: dict[str, tuple[str, int, int]]) -> list[str]:
        """The checkpoint names that fill parameter `name`: its parts when it is fused."""
        parts = [
            name.replace(f".{module}.", f".{hf}.")
            for hf, (module, _, _) in fused.items()
            if f".{module}." in name
        ]
        return parts or [name]


class _WithBias(nn.Module):
    """A bias-free quantized linear plus the float bias of the layer it replaced (Qwen2 qkv)."""

    def __init__(self, linear: nn.Module, bias: torch.Tensor) -> None:
        super().__init__()
        self.linear = linear
        self.register_buffer("bias", bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, K]
        return self.linear(x) + self.bias


def quantize_linears(
    model: CausalLM,
    mode: str,
    q4_1_blocks: Mapping[str, GgufRawTensor] | None = None,
    compute_dtype: torch.dtype = torch.bfloat16,
    max_thin_rows: int | None = 8,
) -> None:
    """Replace every decoder-layer linear with a weight-only quantized one, in place.

    "int8": per-channel int8. "int4": group-32 int4; a layer whose GGUF parts are all Q4_1
    (`q4_1_blocks`, by Hugging Face name) takes their blocks unchanged, which is lossless.
    The quantized matmuls compute in `compute_dtype`: torch's int4/int8 CPU kernels are 10-100x
    slower in float32 than in bfloat16. With `max_thin_rows`, inputs of more rows go through a
    dense bf16 copy instead (ThinThickLinear), and the LM head gets an int8 copy for thin inputs;
    the embedding table stays in float.
    """
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization {mode!r} is not supported; use one of {QUANTIZATION_MODES}")
    blocks = q4_1_blocks or {}
    dtype = compute_dtype
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
            linear: nn.Linear = getattr(parent, attr)
            raw = [blocks.get(f"{prefix}.{part}.weight") for part in parts]
            quantized: nn.Module
            if mode == "int8":
                quantized = Int8Linear.from_float(linear.weight.detach(), dtype)
            elif all(r is not None and r.ggml_type == "Q4_1" for r in raw):
                stacked = np.concatenate([r.blocks for r in raw if r is not None], axis=0)
                quantized = Int4Linear.from_q4_1(
                    stacked, linear.out_features, linear.in_features, dtype
                )
            else:
                quantized = Int4Linear.from_float(linear.weight.detach(), 32, dtype)
            if max_thin_rows is not None:
                quantized = ThinThickLinear(quantized, linear.weight, max_thin_rows)
            if linear.bias is not None:
                quantized = _WithBias(quantized, linear.bias)
            setattr(parent, attr, quantized)
    if max_thin_rows is not None:
        head = model.lm_head.weight.detach()
        model.lm_head = ThinThickLinear(Int8Linear.from_float(head, dtype), head, max_thin_rows)
