"""One Llama-family decoder (Llama 1/2/3, SmolLM2, Mistral, Qwen2) over the paged KV cache.

Module names follow Hugging Face's, except that Q/K/V and gate/up are fused into `qkv_proj`
([q; k; v] rows) and `gate_up_proj` ([gate; up] rows), one matmul each.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gpu.attention import AttentionInputs
from gpu.backends import TORCH_KERNELS, Kernels, Rope, rope_angles, torch_rms_norm
from stages.text.checkpoint import ModelConfig, RopeScaling, UnsupportedModelError

if TYPE_CHECKING:
    from gpu.fused import FusedLayers
    from gpu.lora import LoraSlots


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
        self.angle_table: torch.Tensor | None  # [positions, head_dim] float32: cos | sin
        self.register_buffer("angle_table", None, persistent=False)
        self.fused_layers: FusedLayers | None = None  # set by quantize_linears where it fits
        self.lora: LoraSlots | None = None  # set by gpu.lora.install_lora (--enable-lora)

    def forward(
        self,
        input_ids: torch.Tensor,  # input_ids: [T] int64
        positions: torch.Tensor,  # positions: [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        inputs: AttentionInputs,
        logits_indices: torch.Tensor,  # logits_indices: [S] int64, rows of T that need logits
    ) -> torch.Tensor:  # -> [S, vocab] float32
        rope = Rope.at(positions, self.inv_freq, self.angle_table)
        layout = self.kernels.prepare(inputs)
        x = self.model.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        fused = self.fused_layers
        lora = self.lora.step if self.lora is not None else None
        # A step with adapter rows stays on the fused C layers when they hold the adapters.
        takes_lora = lora is None or (fused is not None and fused.lora is not None)
        if fused is not None and takes_lora and fused.applies(x, layout, kv_caches):
            x, residual = fused.run(x, rope, kv_caches, layout, lora)
        else:
            for layer, kv in zip(self.model.layers, kv_caches, strict=True):
                x, residual = layer(x, residual, rope, kv, layout)
        if residual is not None:
            x = x[logits_indices] + residual[logits_indices]
        else:
            x = x[logits_indices]
        return self.lm_head(self.model.norm(x)).float()

    def set_angle_table(self, max_positions: int) -> None:
        """Every position's rotary angles below `max_positions` as one table (vLLM's
        cos_sin_cache), for kernels that read angles by position (the Triton rotary): a step
        then computes none. Each row has the bits a step's own angles would have."""
        positions = torch.arange(max_positions, device=self.inv_freq.device)
        self.angle_table = torch.cat(rope_angles(positions, self.inv_freq), dim=1)

    @torch.no_grad()
    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], shape: ModelConfig | None = None
    ) -> None:
        """Copy Hugging Face-named tensors into the (fused) parameters; every one must be filled.
        `shape`: the heads and MLP columns the fused parameters hold, when not the config's (a
        tensor-parallel rank's, its tensors cut by gpu/tensor_parallel.py:shard_weights)."""
        c = shape or self.config
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
                device = self.inv_freq.device
                self.inv_freq = rope_inv_freq(c).to(device) / tensor.float().to(device)
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
