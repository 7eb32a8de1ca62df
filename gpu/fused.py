"""Whole decoder layers as one or two C calls (gpu/native) for CPU steps of GGUF Q4_1 weights."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gpu import native
from gpu.attention import StepLayout
from gpu.backends import Rope
from gpu.quant import (
    NativeQ4Linear,
    ThinThickLinear,
    WithBias,
)

if TYPE_CHECKING:
    from gpu.lora import LoraSlots, LoraStep
    from gpu.model import CausalLM


def _native_q4(module: nn.Module) -> tuple[NativeQ4Linear, torch.Tensor | None] | None:
    """The NativeQ4Linear (and bias) behind a quantized layer's wrappers, if that is what it is."""
    bias = None
    if isinstance(module, WithBias):
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

    With adapters (`attach_lora`), each projection adds its rows' low-rank updates in the same
    call, so a step mixing adapters and the base stays on this path.

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
        self.lora: LoraSlots | None = None

    def attach_lora(self, slots: LoraSlots) -> bool:
        """Point every layer at its projections' adapter slots (float32, filled in place by
        LoraSlots, so the pointers stay valid); False where the C layers cannot take them."""
        from gpu.lora import PROJECTIONS

        tensors = [*slots.a.values(), *slots.b.values()]
        if (
            any(
                t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous()
                for t in tensors
            )
            or max(a.shape[1] for a in slots.a.values()) > native.LORA_MAX_WIDTH
        ):
            return False
        for index, layer in enumerate(self.layers):
            for fused, name in zip(PROJECTIONS, ("qkv", "o", "gate_up", "down"), strict=True):
                a, b = slots.a[(index, fused)], slots.b[(index, fused)]
                setattr(layer, f"{name}_la", a.data_ptr())
                setattr(layer, f"{name}_lb", b.data_ptr())
                setattr(layer, f"{name}_lw", a.shape[1])
        self._keep.extend(tensors)
        self.lora = slots
        return True

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
        lora: LoraStep | None = None,  # the step's adapter rows; attach_lora must have run
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
        if lora is None:
            step.lora_n_tiles = 0
        else:
            if self.lora is None:
                raise RuntimeError("a step with adapter rows on fused layers without adapters")
            step.lora_rows = lora.adapter_rows.data_ptr()
            step.lora_slots = lora.adapter_slots.data_ptr()
            step.lora_n_tiles = len(lora.adapter_tiles) - 1
            step.lora_tiles = lora.adapter_tiles.data_ptr()
        decodes_only = not layout.prefills and len(rows) == tokens
        for index, (layer, kv) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if decodes_only:
                native.q4_decode_layer(layer, step, *kv, x, residual, index == 0, qkv, attn)
                continue
            native.q4_layer_attn_in(layer, step, *kv, x, residual, index == 0, qkv)
            q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
            out = self.attention(q, kv, layout, scale, window)
            native.q4_layer_attn_out(layer, step, out.view(tokens, -1), x, residual)
        return x, residual
