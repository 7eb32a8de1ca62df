"""Triton kernel that scatters this step's new K/V tokens into their paged cache slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu.kernels.launch import check_launchable

FP8_MAX = tl.constexpr(448.0)  # float8 e4m3's largest finite value
FP8_DTYPE = torch.float8_e4m3fn


def check_kv_scales(cache: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None) -> bool:
    """Whether the cache is fp8: then it needs its scales, [1] float32 each; other caches none."""
    if cache.dtype != FP8_DTYPE:
        if scales is not None:
            raise ValueError(f"a {cache.dtype} KV cache has no scales")
        return False
    if scales is None or any(s.shape != (1,) or s.dtype != torch.float32 for s in scales):
        raise ValueError("an fp8 KV cache needs its k and v scales, [1] float32 each")
    return True


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return  # a padding token: nothing to cache
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)

    k = tl.load(
        k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
        mask=mask,
    )
    v = tl.load(
        v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
        mask=mask,
    )
    if FP8:
        # What is stored times the scale is the value; saturated at e4m3's largest finite.
        k = tl.clamp(k.to(tl.float32) / tl.load(k_scale_ptr), -FP8_MAX, FP8_MAX)
        v = tl.clamp(v.to(tl.float32) / tl.load(v_scale_ptr), -FP8_MAX, FP8_MAX)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs
    tl.store(
        k_dst + offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd,
        k.to(k_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        v_dst + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd,
        v.to(v_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def write_kv(
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D], written in place
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D], written in place
    slot_mapping: torch.Tensor,  # [T] int64, block * block_size + offset; negative = skip
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # an fp8 cache's: [1] float32 each
) -> None:
    """Write token t's K/V into cache slot slot_mapping[t]; a negative slot writes nothing.

    An fp8 (e4m3) cache stores k / k_scale and v / v_scale, saturated at +-448 (vLLM's per-tensor
    scales: what is stored times the scale is the value)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape or k_cache.shape[2:] != k.shape[1:] or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k {tuple(k.shape)}, v {tuple(v.shape)} and caches {tuple(k_cache.shape)}/"
            f"{tuple(v_cache.shape)} disagree"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} needs one slot per token")
    fp8 = check_kv_scales(k_cache, scales)
    check_launchable(k, v, k_cache, v_cache, slot_mapping)
    if num_tokens == 0:
        return
    k_scale, v_scale = scales if scales is not None else (slot_mapping, slot_mapping)
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale,
        v_scale,
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        FP8=fp8,
    )
