"""Triton rotary position embedding in HF Llama's rotate_half (GPT-NeoX) convention.

The cos/sin cache is `[max_positions, head_dim]` float32: row p holds cos(p * inv_freq) in its
first head_dim/2 columns and sin(p * inv_freq) in the last head_dim/2, inv_freq being the model's
RoPE frequencies (base ** (-2i / head_dim), or a scaled variant such as Llama 3's).
Dimension i pairs with dimension i + head_dim/2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu.kernels.launch import check_launchable


def rotary_cos_sin_cache(
    inv_freq: torch.Tensor,  # [head_dim / 2]
    max_positions: int,
) -> torch.Tensor:  # [max_positions, head_dim] float32 on inv_freq's device: cos | sin
    """Build the cache `rotary` reads (angles in float64, stored as float32)."""
    positions = torch.arange(max_positions, dtype=torch.float64, device=inv_freq.device)
    angles = positions[:, None] * inv_freq.double()[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


@triton.jit
def _rotate_heads(
    x_ptr,
    token,
    cos,  # [1, BLOCK_HALF] float32
    sin,  # [1, BLOCK_HALF] float32
    stride_t,
    stride_h,
    stride_d,
    NUM_HEADS: tl.constexpr,
    HALF_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HALF_DIM)
    first_ptrs = x_ptr + token * stride_t + offs_h[:, None] * stride_h + offs_d[None, :] * stride_d
    second_ptrs = first_ptrs + HALF_DIM * stride_d
    first = tl.load(first_ptrs, mask=mask, other=0.0)
    second = tl.load(second_ptrs, mask=mask, other=0.0)
    first_f32 = first.to(tl.float32)
    second_f32 = second.to(tl.float32)
    tl.store(first_ptrs, (first_f32 * cos - second_f32 * sin).to(first.dtype), mask=mask)
    tl.store(second_ptrs, (second_f32 * cos + first_f32 * sin).to(first.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    cos_sin_ptr,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_cos_sin,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KVH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF_DIM
    row_ptr = cos_sin_ptr + position * stride_cos_sin
    cos = tl.load(row_ptr + offs_d, mask=mask_d, other=0.0)[None, :]
    sin = tl.load(row_ptr + HALF_DIM + offs_d, mask=mask_d, other=0.0)[None, :]
    _rotate_heads(
        q_ptr,
        token,
        cos,
        sin,
        stride_qt,
        stride_qh,
        stride_qd,
        NUM_HEADS,
        HALF_DIM,
        BLOCK_H,
        BLOCK_HALF,
    )
    _rotate_heads(
        k_ptr,
        token,
        cos,
        sin,
        stride_kt,
        stride_kh,
        stride_kd,
        NUM_KV_HEADS,
        HALF_DIM,
        BLOCK_KVH,
        BLOCK_HALF,
    )


def rotary(
    q: torch.Tensor,  # [T, H, D], rotated in place
    k: torch.Tensor,  # [T, KVH, D], rotated in place
    positions: torch.Tensor,  # [T] int64
    cos_sin_cache: torch.Tensor,  # [max_positions, D] float32, from rotary_cos_sin_cache
) -> tuple[torch.Tensor, torch.Tensor]:  # (q, k), the same tensors
    """Rotate q and k in place by each token's position and return them.

    q and k may be strided views (for example slices of a fused QKV output).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or head_dim % 2 != 0:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree or D is odd")
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions {tuple(positions.shape)} needs one position per token")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(f"cos_sin_cache {tuple(cos_sin_cache.shape)} is not [max_pos, {head_dim}]")
    if cos_sin_cache.stride(1) != 1:
        raise ValueError("cos_sin_cache rows must be contiguous")
    check_launchable(q, k, positions, cos_sin_cache)
    if num_tokens == 0:
        return q, k
    half_dim = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        q,
        k,
        positions,
        cos_sin_cache,
        *q.stride(),
        *k.stride(),
        cos_sin_cache.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF_DIM=half_dim,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_KVH=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half_dim),
    )
    return q, k
