"""One Llama-family decoder (Llama 1/2/3, SmolLM2, Mistral, Qwen2) over the paged KV cache.

Module names follow Hugging Face's, except that Q/K/V and gate/up are fused into `qkv_proj`
([q; k; v] rows) and `gate_up_proj` ([gate; up] rows), one matmul each.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gpu import attention as torch_attention
from gpu import native
from gpu.attention import AttentionInputs, StepLayout
from gpu.loader import GgufRawTensor
from gpu.quant import (
    Int4Linear,
    Int8Linear,
    NativeQ4Linear,
    NativeQ8Linear,
    ThinThickLinear,
)
from stages.text.checkpoint import ModelConfig, RopeScaling, UnsupportedModelError

QUANTIZATION_MODES = ("int8", "int4")


@dataclass(slots=True, frozen=True)
class Rope:
    """One step's rotary angles, computed once for every layer."""

    cos: torch.Tensor  # [T, D // 2] float32
    sin: torch.Tensor  # [T, D // 2] float32


@dataclass(slots=True, frozen=True)
class Kernels:
    """What a decoder layer runs besides its linears, one implementation per device kind:
    the torch reference path, the native CPU kernels (gpu/native) or the Triton GPU kernels.

    `prepare` runs once per forward and its result is handed to every layer's
    `rotary_write_kv` (rotates q and k of the fused qkv rows, stores k and v in the paged cache,
    returns q as [T, H, D]) and `paged_attention` (-> [T, H, D]).
    `add_rms_norm(x, residual, w, eps)` returns (rms_norm(x + residual) * w, x + residual) and
    may reuse `residual`'s storage for the sum.
    """

    prepare: Callable[[AttentionInputs], Any]
    rotary_write_kv: Callable[
        [torch.Tensor, Rope, int, int, tuple[torch.Tensor, torch.Tensor], Any], torch.Tensor
    ]
    paged_attention: Callable[
        [torch.Tensor, tuple[torch.Tensor, torch.Tensor], Any, float, int | None], torch.Tensor
    ]
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
    ]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama RMSNorm: normalise in float32, round to x's dtype, then scale."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _torch_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return torch_rms_norm(summed, weight, eps), summed


def _torch_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _split_rotate(
    qkv: torch.Tensor, rope: Rope, num_heads: int, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [T, H, D], k and v [T, KVH, D]
    head_dim = rope.cos.shape[1] * 2
    tokens = qkv.shape[0]
    q, k, v = qkv.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1
    )
    cos, sin = rope.cos.unsqueeze(1), rope.sin.unsqueeze(1)
    q = apply_rotary(q.view(tokens, num_heads, head_dim), cos, sin)
    k = apply_rotary(k.view(tokens, num_kv_heads, head_dim), cos, sin)
    return q, k, v.view(tokens, num_kv_heads, head_dim)


def _torch_rotary_write_kv(
    qkv: torch.Tensor,
    rope: Rope,
    num_heads: int,
    num_kv_heads: int,
    kv: tuple[torch.Tensor, torch.Tensor],
    layout: StepLayout,
) -> torch.Tensor:
    q, k, v = _split_rotate(qkv, rope, num_heads, num_kv_heads)
    slots = layout.inputs.slot_mapping
    torch_attention.write_kv(k, v, *kv, slots, layout.all_slots_valid)
    return q


def _torch_paged_attention(
    q: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    layout: StepLayout,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    return torch_attention.paged_attention(q, kv[0], kv[1], layout, scale, sliding_window)


TORCH_KERNELS = Kernels(
    prepare=StepLayout.of,
    rotary_write_kv=_torch_rotary_write_kv,
    paged_attention=_torch_paged_attention,
    rms_norm=torch_rms_norm,
    add_rms_norm=_torch_add_rms_norm,
    silu_mul=_torch_silu_mul,
)


def _native_ready(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


def _native_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _native_ready(x, weight) and x.dim() == 2:
        return native.rms_norm(x, weight, eps)
    return torch_rms_norm(x, weight, eps)


def _native_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if _native_ready(x, residual, weight) and x.dim() == 2:
        return native.add_rms_norm(residual, x, weight, eps), residual
    return _torch_add_rms_norm(x, residual, weight, eps)


def _native_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if _native_ready(gate_up) and gate_up.dim() == 2:
        return native.silu_mul(gate_up)
    return _torch_silu_mul(gate_up)


def _native_rotary_write_kv(
    qkv: torch.Tensor,
    rope: Rope,
    num_heads: int,
    num_kv_heads: int,
    kv: tuple[torch.Tensor, torch.Tensor],
    layout: StepLayout,
) -> torch.Tensor:
    if not _native_ready(qkv) or kv[0].dtype not in (torch.float32, torch.bfloat16):
        return _torch_rotary_write_kv(qkv, rope, num_heads, num_kv_heads, kv, layout)
    native.rope_write_kv(
        qkv, rope.cos, rope.sin, num_heads, num_kv_heads, layout.inputs.slot_mapping, *kv
    )
    head_dim = rope.cos.shape[1] * 2
    return qkv[:, : num_heads * head_dim].view(qkv.shape[0], num_heads, head_dim)


def _native_paged_attention(
    q: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    layout: StepLayout,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    native_q = q.dtype == torch.float32
    decode = native.paged_decode_attention if native_q else None
    prefill = None
    if native_q and q.shape[2] % 32 == 0 and native.prefill_attention_available():
        prefill = native.paged_prefill_attention
    return torch_attention.paged_attention(
        q, kv[0], kv[1], layout, scale, sliding_window, decode, prefill
    )


NATIVE_KERNELS = Kernels(
    prepare=StepLayout.of,
    rotary_write_kv=_native_rotary_write_kv,
    paged_attention=_native_paged_attention,
    rms_norm=_native_rms_norm,
    add_rms_norm=_native_add_rms_norm,
    silu_mul=_native_silu_mul,
)


def triton_kernels() -> Kernels:
    """The Triton kernels (CUDA, or CPU tensors under TRITON_INTERPRET=1)."""
    from gpu import kernels

    def rotary_write_kv(
        qkv: torch.Tensor,
        rope: Rope,
        num_heads: int,
        num_kv_heads: int,
        kv: tuple[torch.Tensor, torch.Tensor],
        inputs: AttentionInputs,
    ) -> torch.Tensor:
        q, k, v = _split_rotate(qkv, rope, num_heads, num_kv_heads)
        kernels.write_kv(k, v, kv[0], kv[1], inputs.slot_mapping)
        return q

    def paged_attention(
        q: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        inputs: AttentionInputs,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        return kernels.paged_attention(
            q,
            kv[0],
            kv[1],
            inputs.block_tables,
            inputs.query_start_loc,
            inputs.context_lens,
            scale,
            sliding_window,
        )

    return Kernels(
        prepare=lambda inputs: inputs,
        rotary_write_kv=rotary_write_kv,
        paged_attention=paged_attention,
        rms_norm=kernels.rms_norm,
        add_rms_norm=kernels.fused_add_rms_norm,
        silu_mul=kernels.silu_mul,
    )


def kernels_for(device: str | torch.device, use_native: bool | None = None) -> Kernels:
    """Triton on CUDA; on CPU the native kernels where they build (unless `use_native` is
    False), else the torch path."""
    kind = torch.device(device).type
    if kind == "cuda":
        return triton_kernels()
    if kind == "cpu" and use_native is not False and native.available():
        return NATIVE_KERNELS
    return TORCH_KERNELS


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
        return torch_rms_norm(x, self.weight, self.eps)


def apply_rotary(
    x: torch.Tensor,  # x: [T, heads, D]
    cos: torch.Tensor,  # cos: [T, 1, D // 2] float32
    sin: torch.Tensor,  # sin: [T, 1, D // 2] float32
) -> torch.Tensor:
    """Rotate-half RoPE (Hugging Face layout: pairs are (i, i + D/2)), in float32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels) -> None:
        super().__init__()
        self.config = config
        self.kernels = kernels
        self.qkv_proj = nn.Linear(
            config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=False)
        self.scale = config.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,  # x: [T, hidden]
        rope: Rope,
        kv: tuple[torch.Tensor, torch.Tensor],  # ([num_blocks, block_size, KVH, D]) * 2
        layout: Any,  # what kernels.prepare made of the step's AttentionInputs
    ) -> torch.Tensor:  # -> [T, hidden]
        c, kernels = self.config, self.kernels
        q = kernels.rotary_write_kv(self.qkv_proj(x), rope, c.num_heads, c.num_kv_heads, kv, layout)
        out = kernels.paged_attention(q, kv, layout, self.scale, c.sliding_window)
        return self.o_proj(out.reshape(-1, c.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels) -> None:
        super().__init__()
        self.kernels = kernels
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, hidden]
        return self.down_proj(self.kernels.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels) -> None:
        super().__init__()
        self.kernels = kernels
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, kernels)

    def forward(
        self,
        x: torch.Tensor,  # x: [T, hidden], the previous layer's output (or the embeddings)
        residual: torch.Tensor | None,  # the residual stream before x is added; None: layer 0
        rope: Rope,
        kv: tuple[torch.Tensor, torch.Tensor],
        layout: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (this layer's output, the residual stream)
        """The residual add is fused into the next norm: the stream is x + residual."""
        kernels, norm = self.kernels, self.input_layernorm
        if residual is None:
            residual, h = x, kernels.rms_norm(x, norm.weight, norm.eps)
        else:
            h, residual = kernels.add_rms_norm(x, residual, norm.weight, norm.eps)
        h = self.self_attn(h, rope, kv, layout)
        norm = self.post_attention_layernorm
        h, residual = kernels.add_rms_norm(h, residual, norm.weight, norm.eps)
        return self.mlp(h), residual


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, kernels) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels = TORCH_KERNELS) -> None:
        super().__init__()
        self.config = config
        self.kernels = kernels
        self.model = Decoder(config, kernels)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.inv_freq: torch.Tensor  # [head_dim // 2] float32, RoPE angular frequencies
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self.fused_layers: FusedLayers | None = None  # set by quantize_linears where it fits

    def forward(
        self,
        input_ids: torch.Tensor,  # input_ids: [T] int64
        positions: torch.Tensor,  # positions: [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        inputs: AttentionInputs,
        logits_indices: torch.Tensor,  # logits_indices: [S] int64, rows of T that need logits
    ) -> torch.Tensor:  # -> [S, vocab] float32
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)  # [T, D/2]
        rope = Rope(freqs.cos(), freqs.sin())
        layout = self.kernels.prepare(inputs)
        x = self.model.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        fused = self.fused_layers
        if fused is not None and fused.applies(x, layout, kv_caches):
            x, residual = fused.run(x, rope, kv_caches, layout)
        else:
            for layer, kv in zip(self.model.layers, kv_caches, strict=True):
                x, residual = layer(x, residual, rope, kv, layout)
        if residual is not None:
            x = x[logits_indices] + residual[logits_indices]
        else:
            x = x[logits_indices]
        return self.lm_head(self.model.norm(x)).float()

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
    raw_blocks: Mapping[str, GgufRawTensor] | None = None,
    compute_dtype: torch.dtype = torch.bfloat16,
    max_thin_rows: int | None = 8,
    use_native: bool | None = None,
) -> None:
    """Replace every decoder-layer linear with a weight-only quantized one, in place.

    "int8": 8-bit, "int4": 4-bit weights. GGUF blocks in `raw_blocks` (by Hugging Face name)
    are taken unchanged where their format is the one asked for (Q4_1 for int4, Q8_0 for int8
    and the LM head), which is lossless; other weights are quantized here.
    With the native CPU kernels (`use_native`, default: where they build) the formats are GGUF's
    own (NativeQ4Linear, NativeQ8Linear); otherwise torch's packed int4/int8 kernels compute in
    `compute_dtype` (their float32 paths are 10-100x slower than bfloat16).
    With `max_thin_rows`, inputs of more rows go through a dense bf16 copy instead
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
            linear: nn.Linear = getattr(parent, attr)
            raw = [blocks.get(f"{prefix}.{part}.weight") for part in parts]
            quantized = _quantized(linear.weight.detach(), mode, raw, compute_dtype, use_native)
            if max_thin_rows is not None:
                quantized = ThinThickLinear(quantized, linear.weight, max_thin_rows)
            if linear.bias is not None:
                quantized = _WithBias(quantized, linear.bias)
            setattr(parent, attr, quantized)
    if max_thin_rows is not None:
        head = model.lm_head.weight.detach()
        tied = model.config.tie_word_embeddings
        raw_head = blocks.get("model.embed_tokens.weight" if tied else "lm_head.weight")
        thin = _quantized(head, "int8", [raw_head], compute_dtype, use_native)
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


def _native_q4(module: nn.Module) -> tuple[NativeQ4Linear, torch.Tensor | None] | None:
    """The NativeQ4Linear (and bias) behind a quantized layer's wrappers, if that is what it is."""
    bias = None
    if isinstance(module, _WithBias):
        module, bias = module.linear, module.bias
    if isinstance(module, ThinThickLinear):
        module = module.quantized
    return (module, bias) if isinstance(module, NativeQ4Linear) else None


class FusedLayers:
    """Steps of at most `max_rows` tokens through native calls per layer (cpu_ops.c's q4_layer_*),
    for models whose decoder linears are all NativeQ4Linear: one call per layer when the step is
    all decodes, else the part before attention, attention (decodes native, prefill chunks in
    torch) and the part after it. At batch 1 calling ~12 kernels per layer from Python cost more
    than their arithmetic; thicker steps take the per-op path with dense bf16 linears.

    The structs hold raw pointers into the model's buffers: build it after the model is in
    place (quantize_linears does) and do not move the model afterwards.
    """

    def __init__(
        self,
        layers: list[native.Q4Layer],
        keep: list[torch.Tensor],
        max_rows: int,
        attention: Callable[..., torch.Tensor],  # Kernels.paged_attention, for mixed steps
    ):
        self.layers = layers
        self._keep = keep  # the tensors the structs point into
        self.max_rows = max_rows
        self.attention = attention
        self.step = native.DecodeStep()

    @classmethod
    def of(cls, model: CausalLM, max_rows: int) -> FusedLayers | None:
        c = model.config
        layers, keep = [], []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            parts = [_native_q4(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj)]
            parts.append(_native_q4(mlp.down_proj))
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if any(p is None for p in parts) or any(n.dtype != torch.float32 for n in norms):
                return None
            if any(p[0].many_rows != native.gemm_available() for p in parts if p is not None):
                return None  # the C layer runs the build's own layout only
            (qkv, qkv_bias), (o, _), (gate_up, _), (down, _) = parts  # type: ignore[misc]
            struct = native.Q4Layer(
                hidden=c.hidden_size,
                heads=c.num_heads,
                kv_heads=c.num_kv_heads,
                head_dim=c.head_dim,
                inter=c.intermediate_size,
                eps_attn=layer.input_layernorm.eps,
                eps_mlp=layer.post_attention_layernorm.eps,
                scale=attn.scale,
                sliding_window=c.sliding_window or 0,
            )
            tensors: dict[str, torch.Tensor | None] = {
                "norm_attn": norms[0].detach(),
                "norm_mlp": norms[1].detach(),
                "qkv_bias": None if qkv_bias is None else qkv_bias.float().contiguous(),
            }
            for name, linear in (("qkv", qkv), ("o", o), ("gate_up", gate_up), ("down", down)):
                tensors[f"{name}_q"] = linear.codes
                tensors[f"{name}_d"] = linear.scales
                tensors[f"{name}_m"] = linear.minimums
            for name, tensor in tensors.items():
                if tensor is not None:
                    keep.append(tensor)
                    setattr(struct, name, tensor.data_ptr())
            layers.append(struct)
        return cls(layers, keep, max_rows, model.kernels.paged_attention)

    def applies(
        self, x: torch.Tensor, layout: Any, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> bool:
        return (
            isinstance(layout, StepLayout)
            and 0 < x.shape[0] <= self.max_rows
            and x.dtype == torch.float32
            and kv_caches[0][0].dtype in (torch.float32, torch.bfloat16)
        )

    def run(
        self,
        x: torch.Tensor,  # [T, hidden] float32, the embeddings
        rope: Rope,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        layout: StepLayout,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (last layer's output, residual stream)
        tokens = x.shape[0]
        x = x.contiguous()
        residual = torch.empty_like(x)
        cos, sin = rope.cos.contiguous(), rope.sin.contiguous()
        slots = layout.inputs.slot_mapping.contiguous()
        tables, lens = layout.decode_block_tables, layout.decode_context_lens
        rows = layout.decode_rows.contiguous()
        dims = self.layers[0]  # every layer has the same
        heads, head_dim, scale = dims.heads, dims.head_dim, dims.scale
        window = dims.sliding_window or None
        qkv = torch.empty(tokens, (heads + 2 * dims.kv_heads) * head_dim)
        attn = torch.empty(tokens, heads * head_dim)
        step = self.step
        step.tokens = tokens
        step.cos, step.sin = cos.data_ptr(), sin.data_ptr()
        step.slot_mapping, step.token_index = slots.data_ptr(), rows.data_ptr()
        step.block_tables, step.table_stride = tables.data_ptr(), tables.shape[1]
        step.context_lens = lens.data_ptr()
        step.block_size = kv_caches[0][0].shape[1]
        step.cache_bf16 = int(kv_caches[0][0].dtype == torch.bfloat16)
        decodes_only = not layout.prefills and len(rows) == tokens
        for index, (layer, kv) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if decodes_only:
                native.q4_decode_layer(layer, step, *kv, x, residual, index == 0, qkv, attn)
                continue
            native.q4_layer_attn_in(layer, step, *kv, x, residual, index == 0, qkv)
            q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
            out = self.attention(q, kv, layout, scale, window)
            native.q4_layer_attn_out(layer, out.view(tokens, -1), x, residual)
        return x, residual
