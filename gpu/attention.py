"""Paged attention over a mixed batch of prefill chunks and decodes: the torch reference path.

The layout of a step (`StepLayout`) is worked out once per forward; the Triton kernels in
`gpu/kernels/` take the step's arrays directly (`gpu.kernels.reference` is their reference). Query i of sequence b sits at position context_lens[b] - q_len_b + i and sees keys 0..that
position. Math runs in float32 whatever the cache dtype, and repeated KV heads are never
materialised: query heads are grouped per KV head (head h uses KV head h // group).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


def write_kv(
    k: torch.Tensor,  # k: [T, KVH, D]
    v: torch.Tensor,  # v: [T, KVH, D]
    k_cache: torch.Tensor,  # k_cache: [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,  # v_cache: [num_blocks, block_size, KVH, D]
    slot_mapping: torch.Tensor,  # slot_mapping: [T] int64, block * block_size + offset; < 0 = skip
    all_valid: bool | None = None,  # known to have no negative slot (saves a check and a sync)
) -> None:
    if not all_valid and bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    k_cache.view(num_slots, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(num_slots, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


@dataclass(slots=True, frozen=True)
class AttentionInputs:
    """One step's batch layout, shared by every layer."""

    query_start_loc: torch.Tensor  # [B + 1] int32
    context_lens: torch.Tensor  # [B] int32, cached + new
    block_tables: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64


@dataclass(slots=True, frozen=True)
class StepLayout:
    """What the CPU attention paths need to know of one step, worked out once, not per layer.

    Decodes (one new token) are attended all at once; prefill chunks one by one.
    """

    inputs: AttentionInputs
    decode_rows: torch.Tensor  # [S] int64: the token row of each decoding sequence
    decode_block_tables: torch.Tensor  # [S, max_blocks] int32, contiguous
    decode_context_lens: torch.Tensor  # [S] int32
    prefills: tuple[tuple[int, int, int, int], ...]  # (sequence, first row, end row, context)
    all_slots_valid: bool  # no token of the step skips the KV write (slot < 0)

    @classmethod
    def of(cls, inputs: AttentionInputs) -> StepLayout:
        starts = inputs.query_start_loc.cpu().numpy().astype(np.int64)
        lens = inputs.context_lens.cpu().numpy()
        q_lens = np.diff(starts)
        decodes = np.flatnonzero(q_lens == 1)
        index = torch.from_numpy(decodes)
        prefills = tuple(
            (int(b), int(starts[b]), int(starts[b + 1]), int(lens[b]))
            for b in np.flatnonzero(q_lens > 1)
        )
        return cls(
            inputs=inputs,
            decode_rows=torch.from_numpy(starts[decodes]).to(inputs.query_start_loc.device),
            decode_block_tables=inputs.block_tables[index].contiguous(),
            decode_context_lens=inputs.context_lens[index].contiguous(),
            prefills=prefills,
            all_slots_valid=bool((inputs.slot_mapping >= 0).all()),
        )


def paged_attention(
    q: torch.Tensor,  # q: [T, H, D]
    k_cache: torch.Tensor,  # k_cache: [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    layout: StepLayout,
    scale: float,
    sliding_window: int | None,
    decode: Callable[..., None] | None = None,
    prefill: Callable[..., None] | None = None,
) -> torch.Tensor:  # -> [T, H, D] in q's dtype
    """Causal attention of each sequence's new queries over its cached keys and values; with
    `sliding_window` w a query at position p sees keys p - w + 1 .. p.

    `decode`, when given, attends the decodes in place (the native CPU kernel: `decode(q,
    k_cache, v_cache, rows, tables, lens, scale, window, out)`), and `prefill` each prefill chunk
    (`prefill(q, k_cache, v_cache, start, end, context_len, table, scale, window, out)`);
    otherwise they take the torch paths."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    rows = layout.decode_rows
    if len(rows):
        if decode is not None:
            decode(
                q,
                k_cache,
                v_cache,
                rows,
                layout.decode_block_tables,
                layout.decode_context_lens,
                scale,
                sliding_window,
                out,
            )
        else:
            out[rows] = _decode_attention(
                q[rows],
                k_cache,
                v_cache,
                layout.decode_block_tables,
                layout.decode_context_lens,
                scale,
                sliding_window,
            ).to(q.dtype)
    block_size = k_cache.shape[1]
    for b, start, end, context_len in layout.prefills:
        if prefill is not None:
            table = layout.inputs.block_tables[b]
            prefill(q, k_cache, v_cache, start, end, context_len, table, scale, sliding_window, out)
            continue
        num_blocks = -(-context_len // block_size)
        blocks = layout.inputs.block_tables[b, :num_blocks].long()
        keys = k_cache[blocks].flatten(0, 1)[:context_len]  # [L, KVH, D]
        values = v_cache[blocks].flatten(0, 1)[:context_len]
        out[start:end] = _prefill_attention(q[start:end], keys, values, scale, sliding_window).to(
            q.dtype
        )
    return out


def _prefill_attention(
    q: torch.Tensor,  # q: [Q, H, D]
    keys: torch.Tensor,  # keys: [L, KVH, D]
    values: torch.Tensor,  # values: [L, KVH, D]
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:  # -> [Q, H, D] float32
    num_queries, num_heads, head_dim = q.shape
    context_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    # [Q, KVH, G, D] -> [KVH, G * Q, D]: each KV head's query group as one matrix.
    grouped = q.float().view(num_queries, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    grouped = grouped.reshape(num_kv_heads, group * num_queries, head_dim)
    k = keys.float().permute(1, 2, 0)  # [KVH, D, L]
    v = values.float().permute(1, 0, 2)  # [KVH, L, D]
    scores = torch.bmm(grouped, k).mul_(scale).view(num_kv_heads, group, num_queries, context_len)
    query_pos = torch.arange(context_len - num_queries, context_len, device=q.device).unsqueeze(
        1
    )  # [Q, 1]
    key_pos = torch.arange(context_len, device=q.device).unsqueeze(0)  # [1, L]
    hidden = key_pos > query_pos
    if sliding_window is not None:
        hidden |= key_pos <= query_pos - sliding_window
    scores.masked_fill_(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(num_kv_heads, group * num_queries, context_len)
    out = torch.bmm(probs, v).view(num_kv_heads, group, num_queries, head_dim)
    return out.permute(2, 0, 1, 3).reshape(num_queries, num_heads, head_dim)


def _decode_attention(
    q: torch.Tensor,  # q: [B, H, D], one query per sequence
    k_cache: torch.Tensor,  # k_cache: [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,  # v_cache: [num_blocks, block_size, KVH, D]
    block_tables: torch.Tensor,  # block_tables: [B, max_blocks] int32
    context_lens: torch.Tensor,  # context_lens: [B] int32
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:  # -> [B, H, D] float32
    """All decodes at once: one gather of each sequence's blocks, padded to the longest.

    The gather takes whole blocks (contiguous [block_size, KVH, D] pieces), the fastest copy there
    is; the keys then stay as [B, L * KVH, D], with every KV head of a position side by side. One
    bmm scores each query head against all KV heads (KVH times the FLOPs of the head it needs: tiny
    next to the bytes moved), and the scores of its own KV head are picked out, so no transpose of
    the gathered cache is ever copied. Probabilities go back to the same [L * KVH] layout, zero for
    the other heads, for the second bmm.
    """
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    max_len = int(context_lens.max())
    num_blocks = -(-max_len // block_size)
    length = num_blocks * block_size
    flat_blocks = block_tables[:, :num_blocks].long().flatten()
    keys = k_cache.index_select(0, flat_blocks).view(batch, length * num_kv_heads, head_dim)
    values = v_cache.index_select(0, flat_blocks).view(batch, length * num_kv_heads, head_dim)
    scores = torch.bmm(q.float(), keys.float().transpose(1, 2))  # [B, H, L * KVH]
    scores = scores.view(batch, num_kv_heads, group, length, num_kv_heads)
    own = torch.diagonal(scores, dim1=1, dim2=4).permute(0, 3, 1, 2)  # [B, KVH, G, L]
    own = own.mul(scale)
    key_pos = torch.arange(length, device=q.device).unsqueeze(0)  # [1, L]
    lens = context_lens.long().unsqueeze(1)  # [B, 1]
    hidden = key_pos >= lens  # [B, L]
    if sliding_window is not None:
        hidden |= key_pos <= lens - 1 - sliding_window
    own.masked_fill_(hidden[:, None, None, :], float("-inf"))
    probs = torch.softmax(own, dim=-1)  # [B, KVH, G, L]
    spread = torch.zeros(batch, num_kv_heads, group, length, num_kv_heads, device=q.device)
    torch.diagonal(spread, dim1=1, dim2=4).copy_(probs.permute(0, 2, 3, 1))
    out = torch.bmm(spread.view(batch, num_heads, length * num_kv_heads), values.float())
    return out  # [B, H, D]
