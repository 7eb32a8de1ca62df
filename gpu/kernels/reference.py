"""Naive, readable torch versions of every op in `gpu.kernels`; the tests hold the kernels to these.

Speed does not matter here: loops over sequences, gathered blocks and `repeat_interleave`.
"""

from __future__ import annotations

import torch


def write_kv(
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D], written in place
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D], written in place
    slot_mapping: torch.Tensor,  # [T] int64, block * block_size + offset; negative = skip
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # an fp8 cache's, [1] float32
) -> None:
    if scales is not None:  # stored: value / scale, saturated at fp8 e4m3's +-448
        k = (k.float() / scales[0]).clamp(-448.0, 448.0)
        v = (v.float() / scales[1]).clamp(-448.0, 448.0)
    block_size = k_cache.shape[1]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // block_size, slot % block_size] = k[token].to(k_cache.dtype)
        v_cache[slot // block_size, slot % block_size] = v[token].to(v_cache.dtype)


def dequantize(cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """A cache's values in float32: an fp8 cache's stored values times its scale."""
    return cache.float() if scale is None else cache.float() * scale


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    block_table: torch.Tensor,  # [max_blocks] int32, padded
    context_len: int,
) -> torch.Tensor:  # [context_len, KVH, D]
    block_size = cache.shape[1]
    num_blocks = (context_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]
    return blocks.reshape(-1, *cache.shape[2:])[:context_len]


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    context_lens: torch.Tensor,  # [B] int32, cached + new tokens
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [T, H, D], dtype of q
    num_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for seq, context_len in enumerate(context_lens.tolist()):
        q_seq = q[starts[seq] : starts[seq + 1]].float()  # [q_len, H, D]
        q_len = q_seq.shape[0]
        keys = gather_kv(k_cache, block_tables[seq], context_len).float()
        values = gather_kv(v_cache, block_tables[seq], context_len).float()
        keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [ctx, H, D]
        values = values.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q_seq, keys) * scale
        q_pos = torch.arange(context_len - q_len, context_len).unsqueeze(1)
        kv_pos = torch.arange(context_len).unsqueeze(0)
        hidden = kv_pos > q_pos
        if sliding_window is not None:
            hidden |= kv_pos <= q_pos - sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[starts[seq] : starts[seq + 1]] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out


def rms_norm(
    x: torch.Tensor,  # [N, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:  # [N, hidden], dtype of x
    x_f32 = x.float()
    normed = x_f32 * torch.rsqrt(x_f32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return normed.to(x.dtype) * weight.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor,  # [N, hidden]
    residual: torch.Tensor,  # [N, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed, x + residual), both [N, hidden]
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def rotary(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    positions: torch.Tensor,  # [T] int64
    inv_freq: torch.Tensor,  # [D / 2]
) -> tuple[torch.Tensor, torch.Tensor]:  # new (q, k)
    """HF Llama's apply_rotary_pos_emb, with cos/sin computed from the frequencies directly."""
    angles = positions.double()[:, None] * inv_freq.double()[None, :]  # [T, D/2]
    emb = torch.cat([angles, angles], dim=-1)[:, None, :]  # [T, 1, D]
    cos, sin = emb.cos().float(), emb.sin().float()
    q_f32, k_f32 = q.float(), k.float()
    q_out = q_f32 * cos + rotate_half(q_f32) * sin
    k_out = k_f32 * cos + rotate_half(k_f32) * sin
    return q_out.to(q.dtype), k_out.to(k.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [N, 2I] -> [N, I]
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)
