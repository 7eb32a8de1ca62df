"""Triton kernels for the GPU path: paged KV cache writes, paged attention, norms, RoPE, SwiGLU.

`gpu.kernels.reference` holds the torch reference of every op. Every kernel runs on CUDA tensors,
and on CPU tensors under TRITON_INTERPRET=1 (how CI tests them).
"""

from __future__ import annotations

from gpu.kernels.activation import silu_mul
from gpu.kernels.kv_cache import write_kv
from gpu.kernels.norm import fused_add_rms_norm, rms_norm
from gpu.kernels.paged_attention import paged_attention
from gpu.kernels.rotary import rotary, rotary_cos_sin_cache

__all__ = [
    "fused_add_rms_norm",
    "paged_attention",
    "rms_norm",
    "rotary",
    "rotary_cos_sin_cache",
    "silu_mul",
    "write_kv",
]
