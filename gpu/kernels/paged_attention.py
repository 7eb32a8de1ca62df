"""Triton paged attention over the block-table KV cache: a decode kernel and a varlen prefill kernel.

Both walk the KV of a sequence in tiles of `BLOCK_N` positions, gathering each position's cache
block from the block table, and keep a flash-attention online softmax in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gpu.kernels.kv_cache import check_kv_scales
from gpu.kernels.launch import check_launchable, dot_in_fp32, multiprocessor_count, targets_gpu

LOG2_E = 1.4426950408889634
NO_WINDOW = 2**30  # larger than any context, small enough that position - window fits int32
DECODE_BLOCK_N = 64  # KV positions per decode-kernel iteration
DECODE_PARTITION_SIZE = 512  # the shortest partition of a decode context split to fill the GPU
LONG_PARTITION = 4096  # the shortest partition when the batch alone fills the GPU
MAX_DECODE_SPLITS = 64  # partitions of one context at most, whatever its length
REDUCE_BLOCK_S = 16  # partitions the reduce merges at a time
DOT_MIN = 16  # tl.dot's smallest M, N and K
PREFILL_BLOCK_B = 16  # sequences the prefill kernel's search for its own reads at a time
# The kernels' integer arguments that change from step to step (window only per model, but
# cheap) are `do_not_specialize`: Triton would otherwise compile a variant for each of them that
# is 1 or a multiple of 16, while serving. The other integers are strides fixed by the model and
# its cache, and constexprs depend only on the dtypes and shapes: gpu/kernels/startup.py
# compiles the whole set before the first request.


@triton.jit
def _load_kv_tile(
    cache_ptr,
    block_table_row_ptr,
    kv_pos,  # [BLOCK_N] absolute KV positions
    kv_valid,  # [BLOCK_N]
    kv_head,
    offs_d,  # [BLOCK_D]
    mask_d,  # [BLOCK_D]
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    stride_bt_j,
    BLOCK_SIZE: tl.constexpr,
):
    block = tl.load(
        block_table_row_ptr + (kv_pos // BLOCK_SIZE) * stride_bt_j, mask=kv_valid, other=0
    )
    row_offsets = block.to(tl.int64) * stride_cb + (kv_pos % BLOCK_SIZE) * stride_cs
    ptrs = cache_ptr + row_offsets[:, None] + kv_head * stride_ch + offs_d[None, :] * stride_cd
    # Masked so that stale NaNs in unused cache slots never reach the accumulator (0 * NaN).
    return tl.load(ptrs, mask=kv_valid[:, None] & mask_d[None, :], other=0.0)


@triton.jit
def _dequantize(tile, scale_ptr, FP8: tl.constexpr):
    # An fp8 cache holds value / scale (gpu/kernels/kv_cache.py): widen, then scale back.
    if FP8:
        tile = tile.to(tl.float32) * tl.load(scale_ptr)
    return tile


@triton.jit
def _decode_partition(context_len, window, num_splits, min_partition, BLOCK_N: tl.constexpr):
    # A sequence's KV range, from the first whole tile its window reaches, is cut into at most
    # num_splits partitions of whole tiles, each at least min_partition long: a long context is
    # spread over every split, a short one takes one. -> (first position seen, base, partition
    # length, partitions used).
    kv_lo = tl.maximum(context_len - window, 0)
    base = kv_lo // BLOCK_N * BLOCK_N
    span = context_len - base
    partition = tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N
    partition = tl.maximum(partition, min_partition)
    return kv_lo, base, partition, tl.cdiv(span, partition)


@triton.jit(do_not_specialize=["window", "num_splits", "min_partition", "stride_bt_b"])
def _paged_decode_kernel(
    out_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    k_scale_ptr,
    v_scale_ptr,
    qk_scale_log2,
    window,
    num_splits,
    min_partition,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_bt_b,
    stride_bt_j,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_G: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,
):
    # Program (sequence, KV head, split): the KV head's group of query heads (sequence b's one
    # query is token b), as the rows of a [BLOCK_G, BLOCK_D] tile padded to tl.dot's minimum, so
    # that each K/V tile is read once for the whole group. A sequence whose context takes one
    # partition writes its output; one spread over several leaves each partition's running max,
    # sum and unnormalised output for _paged_decode_reduce_kernel.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    kv_lo, base, partition, used = _decode_partition(
        context_len, window, num_splits, min_partition, BLOCK_N
    )
    if split >= tl.maximum(used, 1):  # an empty context (a padding row) still writes zeros
        return
    block_table_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_b

    offs_g = tl.arange(0, BLOCK_G)
    mask_g = offs_g < QUERIES_PER_KV
    heads = kv_head * QUERIES_PER_KV + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(
        q_ptr
        + seq.to(tl.int64) * stride_qt
        + heads[:, None] * stride_qh
        + offs_d[None, :] * stride_qd,
        mask=mask_g[:, None] & mask_d[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)  # K, V and P follow q's dtype

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    # The query sits at context_len - 1 and sees positions kv_lo .. context_len - 1; every
    # partition used holds at least one of them, so no row's max stays -inf.
    first = base + split * partition
    last = tl.minimum(context_len, first + partition)
    for start in range(first, last, BLOCK_N):
        kv_pos = start + offs_n
        kv_valid = (kv_pos >= kv_lo) & (kv_pos < last)
        k = _load_kv_tile(
            k_cache_ptr,
            block_table_row_ptr,
            kv_pos,
            kv_valid,
            kv_head,
            offs_d,
            mask_d,
            stride_kb,
            stride_ks,
            stride_kh,
            stride_kd,
            stride_bt_j,
            BLOCK_SIZE,
        )
        k = _dequantize(k, k_scale_ptr, FP8).to(q.dtype)  # the cache may hold another dtype
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2
        scores = tl.where(kv_valid[None, :], scores, float("-inf"))  # [BLOCK_G, BLOCK_N], log2
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _load_kv_tile(
            v_cache_ptr,
            block_table_row_ptr,
            kv_pos,
            kv_valid,
            kv_head,
            offs_d,
            mask_d,
            stride_vb,
            stride_vs,
            stride_vh,
            stride_vd,
            stride_bt_j,
            BLOCK_SIZE,
        )
        v = _dequantize(v, v_scale_ptr, FP8).to(q.dtype)
        # P enters the product in the activations' dtype, as a GPU's tensor cores take it; the
        # float32 emulation rounds it the same way.
        p_dot = p.to(q_ptr.dtype.element_ty).to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(p_dot, v, input_precision=DOT_PRECISION)
        m_i = m_new

    rows = mask_g[:, None] & mask_d[None, :]
    if used <= 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr
            + seq.to(tl.int64) * stride_ot
            + heads[:, None] * stride_oh
            + offs_d[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=rows,
        )
    else:
        partial = (
            seq.to(tl.int64) * (tl.num_programs(1) * QUERIES_PER_KV) + heads
        ) * num_splits + split
        tl.store(partial_max_ptr + partial, m_i, mask=mask_g)
        tl.store(partial_sum_ptr + partial, l_i, mask=mask_g)
        tl.store(partial_out_ptr + partial[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=rows)


@triton.jit(do_not_specialize=["window", "num_splits", "min_partition"])
def _paged_decode_reduce_kernel(
    out_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    context_lens_ptr,
    window,
    num_splits,
    min_partition,
    stride_ot,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    # Program (sequence, query head): merge the partitions' softmax states into the output,
    # BLOCK_S partitions at a time, so that registers stay bounded at any context length. A
    # sequence that took one partition was written by the decode kernel.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    _kv_lo, _base, _partition, used = _decode_partition(
        context_len, window, num_splits, min_partition, BLOCK_N
    )
    if used <= 1:
        return
    first = (seq.to(tl.int64) * tl.num_programs(1) + head) * num_splits
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    m_i = tl.full([], float("-inf"), tl.float32)
    l_i = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for chunk in range(0, used, BLOCK_S):
        offs_s = chunk + tl.arange(0, BLOCK_S)
        mask_s = offs_s < used
        maxes = tl.load(partial_max_ptr + first + offs_s, mask=mask_s, other=float("-inf"))
        sums = tl.load(partial_sum_ptr + first + offs_s, mask=mask_s, other=0.0)
        partial_out = tl.load(
            partial_out_ptr + (first + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
            mask=mask_s[:, None] & mask_d[None, :],
            other=0.0,
        )
        m_new = tl.maximum(m_i, tl.max(maxes, axis=0))  # finite: the first chunk has partitions
        alpha = tl.exp2(m_i - m_new)
        weights = tl.exp2(maxes - m_new)  # 0 for the masked partitions
        l_i = l_i * alpha + tl.sum(weights * sums, axis=0)
        acc = acc * alpha + tl.sum(weights[:, None] * partial_out, axis=0)
        m_i = m_new
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + offs_d * stride_od,
        (acc / l_i).to(out_ptr.dtype.element_ty),
        mask=mask_d,
    )


@triton.jit(do_not_specialize=["window", "num_seqs", "stride_bt_b"])
def _paged_prefill_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    context_lens_ptr,
    k_scale_ptr,
    v_scale_ptr,
    qk_scale_log2,
    window,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_bt_b,
    stride_bt_j,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,
):
    # Program (tile, KV head) owns BLOCK_Q queries of one sequence for each of the KV head's
    # QUERIES_PER_KV query heads: the BLOCK_M rows of its tiles are (query, head) pairs, row r
    # query r // QUERIES_PER_KV and head r % QUERIES_PER_KV, so each K/V tile is gathered once
    # for the whole group. Sequence b's tiles start at global tile query_start_loc[b] // BLOCK_Q
    # + b, which bounds the grid by T // BLOCK_Q + B without reading the longest query length
    # back to the host.
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)

    # Which sequence: the count of sequences whose first tile is at or before this one, BLOCK_B
    # at a time, so that one variant serves any number of sequences.
    seq = -1
    for chunk in range(0, num_seqs, BLOCK_B):
        offs_b = chunk + tl.arange(0, BLOCK_B)
        in_step = offs_b < num_seqs
        seq_starts = tl.load(query_start_loc_ptr + offs_b, mask=in_step, other=0)
        first_tiles = seq_starts // BLOCK_Q + offs_b
        seq += tl.sum(((first_tiles <= tile) & in_step).to(tl.int32), axis=0)

    seq_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - seq_start
    q_tile = tile - (seq_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:
        return

    context_len = tl.load(context_lens_ptr + seq)
    block_table_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_b
    rows = tl.arange(0, BLOCK_M)
    offs_m = q_tile * BLOCK_Q + rows // QUERIES_PER_KV  # query index within the sequence
    heads = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    mask_m = (rows < BLOCK_Q * QUERIES_PER_KV) & (offs_m < q_len)
    q_pos = context_len - q_len + offs_m
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)

    token = (seq_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr
        + token[:, None] * stride_qt
        + heads[:, None] * stride_qh
        + offs_d[None, :] * stride_qd,
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)  # K and V follow q's dtype

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Causal: the last query of this tile sees KV positions up to and including its own; with a
    # sliding window, query p sees only positions > p - window, so early tiles may be skipped.
    kv_end = context_len - q_len + tl.minimum(q_len, (q_tile + 1) * BLOCK_Q)
    kv_first = tl.maximum(context_len - q_len + q_tile * BLOCK_Q - window + 1, 0)
    for start in range(kv_first // BLOCK_N * BLOCK_N, kv_end, BLOCK_N):
        kv_pos = start + offs_n
        kv_valid = (kv_pos < kv_end) & (kv_pos >= kv_first)
        k = _load_kv_tile(
            k_cache_ptr,
            block_table_row_ptr,
            kv_pos,
            kv_valid,
            kv_head,
            offs_d,
            mask_d,
            stride_kb,
            stride_ks,
            stride_kh,
            stride_kd,
            stride_bt_j,
            BLOCK_SIZE,
        )
        k = _dequantize(k, k_scale_ptr, FP8).to(q.dtype)  # the cache may hold another dtype
        scores = (
            tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2
        )  # [BLOCK_M, BLOCK_N], log2 domain
        visible = (kv_pos[None, :] <= q_pos[:, None]) & (kv_pos[None, :] > q_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # A row that has seen nothing yet (sliding window) keeps m = -inf; subtracting 0 instead
        # of -inf keeps exp2 at 0 rather than NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(scores - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _load_kv_tile(
            v_cache_ptr,
            block_table_row_ptr,
            kv_pos,
            kv_valid,
            kv_head,
            offs_d,
            mask_d,
            stride_vb,
            stride_vs,
            stride_vh,
            stride_vd,
            stride_bt_j,
            BLOCK_SIZE,
        )
        v = _dequantize(v, v_scale_ptr, FP8).to(q.dtype)
        # P in the activations' dtype, as the tensor cores take it (rounded so when emulated).
        p_dot = p.to(q_ptr.dtype.element_ty).to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(p_dot, v, input_precision=DOT_PRECISION)
        m_i = m_new

    # Padding rows past q_len may have seen nothing under a sliding window; they are not stored.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr
        + token[:, None] * stride_ot
        + heads[:, None] * stride_oh
        + offs_d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32, padded
    query_start_loc: torch.Tensor,  # [B + 1] int32, cumulative query lengths
    context_lens: torch.Tensor,  # [B] int32, KV length after this step (cached + new)
    scale: float,
    sliding_window: int | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # an fp8 cache's (write_kv)
) -> torch.Tensor:  # [T, H, D], dtype of q
    """Causal attention of a flattened mixed batch over the paged cache (new K/V already written).

    With `sliding_window` w, a query at position p sees keys at positions p - w + 1 .. p.
    Every sequence must have at least one query. When every sequence has exactly one (T == B)
    the decode kernel runs, split over the context when the batch alone cannot fill the GPU;
    otherwise the varlen prefill kernel, which also handles decodes. Nothing is read back to
    the host, so a step can be captured in a CUDA graph.
    """
    num_seqs = context_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError("query_start_loc must have B + 1 entries")
    if q.shape[0] == num_seqs:
        return paged_decode(
            q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, None, kv_scales
        )
    window = _check_attention_args(q, k_cache, v_cache, block_tables, context_lens, sliding_window)
    fp8 = check_kv_scales(k_cache, kv_scales)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    layout = _layout(q, out, k_cache, v_cache, block_tables)
    group = layout["QUERIES_PER_KV"]
    tile = _prefill_tile(q.dtype, group)
    block_q = tile["BLOCK_M"] // group
    _paged_prefill_kernel[(q.shape[0] // block_q + num_seqs, k_cache.shape[2])](
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        context_lens,
        *(kv_scales or (context_lens, context_lens)),  # unread unless FP8
        scale * LOG2_E,
        window,
        num_seqs,
        BLOCK_Q=block_q,
        BLOCK_N=_block_n(q.dtype, k_cache.dtype, 32),
        BLOCK_B=PREFILL_BLOCK_B,
        FP8=fp8,
        **(_dot_settings(q.dtype) | tile),
        **layout,
    )
    return out


def paged_decode(
    q: torch.Tensor,  # [B, H, D], one query per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32, padded
    context_lens: torch.Tensor,  # [B] int32, KV length including this token
    scale: float,
    sliding_window: int | None = None,
    splits: DecodeSplits | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # an fp8 cache's (write_kv)
) -> torch.Tensor:  # [B, H, D], dtype of q
    """Decode attention, one program per (sequence, KV head, partition of its context).

    `splits` (default: `decode_splits` for this batch) bounds how many partitions a context is
    cut into and how short one may be; each sequence's own context length decides, on the GPU,
    how many it takes. A context in more than one is merged by a second kernel (flash-decoding).
    """
    window = _check_attention_args(q, k_cache, v_cache, block_tables, context_lens, sliding_window)
    fp8 = check_kv_scales(k_cache, kv_scales)
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_seqs == 0:
        return out
    max_context = block_tables.shape[1] * k_cache.shape[1]
    if splits is None:
        splits = decode_splits(num_seqs, num_kv_heads, max_context, q.device)
    if splits.min_partition % DECODE_BLOCK_N != 0:
        raise ValueError(
            f"min_partition {splits.min_partition} is not a multiple of {DECODE_BLOCK_N}"
        )
    layout = _layout(q, out, k_cache, v_cache, block_tables)
    group = layout["QUERIES_PER_KV"]
    partial_out, partial_max, partial_sum = _partials(q, splits.count)
    _paged_decode_kernel[(num_seqs, num_kv_heads, splits.count)](
        out,
        partial_out,
        partial_max,
        partial_sum,
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        *(kv_scales or (context_lens, context_lens)),  # unread unless FP8
        scale * LOG2_E,
        window,
        splits.count,
        splits.min_partition,
        BLOCK_N=_block_n(q.dtype, k_cache.dtype, DECODE_BLOCK_N),
        BLOCK_G=max(DOT_MIN, triton.next_power_of_2(group)),
        FP8=fp8,
        **_dot_settings(q.dtype),
        **layout,
    )
    if splits.count > 1:
        _paged_decode_reduce_kernel[(num_seqs, num_heads)](
            out,
            partial_out,
            partial_max,
            partial_sum,
            context_lens,
            window,
            splits.count,
            splits.min_partition,
            out.stride(0),
            out.stride(1),
            out.stride(2),
            HEAD_DIM=head_dim,
            BLOCK_D=layout["BLOCK_D"],
            BLOCK_N=_block_n(q.dtype, k_cache.dtype, DECODE_BLOCK_N),
            BLOCK_S=REDUCE_BLOCK_S,
        )
    return out


def _partials(q: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split decode's float32 partials (output, max, sum) of each (sequence, head,
    partition); unsplit, never written, but float32 like the real ones: one kernel variant."""
    num_seqs, num_heads, head_dim = q.shape
    if count == 1:
        unused = torch.empty(1, device=q.device)
        return unused, unused, unused
    partial_out = torch.empty(
        num_seqs, num_heads, count, head_dim, dtype=torch.float32, device=q.device
    )
    partial_max = torch.empty(num_seqs, num_heads, count, device=q.device)
    return partial_out, partial_max, torch.empty_like(partial_max)


@dataclass(frozen=True, slots=True)
class DecodeSplits:
    """How decode attention may cut a context: into at most `count` partitions, none shorter
    than `min_partition` positions (a multiple of DECODE_BLOCK_N)."""

    count: int
    min_partition: int


def decode_splits(
    num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device
) -> DecodeSplits:
    """The split bounds of a decode step on this device (one partition off the GPU)."""
    if not targets_gpu(device):
        return DecodeSplits(1, DECODE_PARTITION_SIZE)
    return split_bounds(num_seqs, num_kv_heads, max_context, multiprocessor_count(device))


def split_bounds(
    num_seqs: int, num_kv_heads: int, max_context: int, multiprocessors: int
) -> DecodeSplits:
    """The split bounds of a decode step, from what the host knows without reading the GPU.

    When sequences x KV heads cannot fill the SMs twice over, contexts are cut as finely as
    DECODE_PARTITION_SIZE to fill them; when they can, only a context longer than
    LONG_PARTITION is cut, so that one long sequence does not hold up a full batch. The count
    covers the longest context the block tables can hold (so a CUDA graph's, captured at
    max_model_len, covers every step it replays) and never exceeds MAX_DECODE_SPLITS.
    """
    if max_context <= DECODE_PARTITION_SIZE:
        return DecodeSplits(1, DECODE_PARTITION_SIZE)
    fill = triton.cdiv(2 * multiprocessors, num_seqs * num_kv_heads)
    if fill > 1:
        count = min(fill, triton.cdiv(max_context, DECODE_PARTITION_SIZE))
        return DecodeSplits(min(count, MAX_DECODE_SPLITS), DECODE_PARTITION_SIZE)
    count = triton.cdiv(max_context, LONG_PARTITION)
    return DecodeSplits(min(count, MAX_DECODE_SPLITS), LONG_PARTITION)


def partitions_used(context_len: int, splits: DecodeSplits, block_n: int = DECODE_BLOCK_N) -> int:
    """How many partitions the decode kernel cuts a context into (its _decode_partition, with
    no sliding window): what `pipeline-bench roofline` counts the partials of."""
    if context_len == 0:
        return 0
    partition = triton.cdiv(triton.cdiv(context_len, splits.count), block_n) * block_n
    return triton.cdiv(context_len, max(partition, splits.min_partition))


def _block_n(q_dtype: torch.dtype, cache_dtype: torch.dtype, tensor_core_tile: int) -> int:
    """KV positions per attention tile. float32 queries are dotted without tensor cores (ieee),
    in twice the registers, and converting a 16-bit cache's tiles up takes as many again: ptxas
    spills (pipeline-bench kernels) unless the tiles shrink. Each divides the 16-bit tile."""
    if q_dtype.itemsize == 2:
        return tensor_core_tile
    return tensor_core_tile // 2 if cache_dtype == torch.float32 else DOT_MIN


def _prefill_tile(dtype: torch.dtype, group: int) -> dict[str, int]:
    """The prefill kernel's rows (queries x the group's heads, a power of two) and warps. On
    tensor cores 64 rows (16 queries of Llama-3's groups of 4) in 8 warps; float32's ieee dots
    keep 16 rows (see _block_n). Checked for spills by pipeline-bench kernels."""
    if dtype.itemsize == 2:
        return dict(BLOCK_M=max(64, triton.next_power_of_2(group)), num_warps=8)
    return dict(BLOCK_M=max(DOT_MIN, triton.next_power_of_2(group)), num_warps=8)


def _dot_settings(dtype: torch.dtype) -> dict[str, object]:
    return dict(
        # float32's ieee dots hold their tiles in registers: eight warps share them.
        num_warps=4 if dtype.itemsize == 2 else 8,
        DOT_FP32=dot_in_fp32(dtype),
        # float32 attention is a correctness mode: no TF32 rounding (16-bit types ignore this).
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
    )


def _check_attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    sliding_window: int | None,
) -> int:  # the window the kernels use
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"q {tuple(q.shape)} and caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} disagree"
        )
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads do not share {num_kv_heads} KV heads evenly")
    if block_tables.shape[0] != context_lens.shape[0]:
        raise ValueError("block_tables must have one row per sequence")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
    check_launchable(q, k_cache, v_cache, block_tables, context_lens)
    # "No window" is a window longer than any context, so the kernels run one code path.
    return NO_WINDOW if sliding_window is None else sliding_window


def _layout(
    q: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
) -> dict[str, int]:
    """Strides and shape constants that both attention kernels take."""
    head_dim = q.shape[2]
    return dict(
        stride_qt=q.stride(0),
        stride_qh=q.stride(1),
        stride_qd=q.stride(2),
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        stride_od=out.stride(2),
        stride_kb=k_cache.stride(0),
        stride_ks=k_cache.stride(1),
        stride_kh=k_cache.stride(2),
        stride_kd=k_cache.stride(3),
        stride_vb=v_cache.stride(0),
        stride_vs=v_cache.stride(1),
        stride_vh=v_cache.stride(2),
        stride_vd=v_cache.stride(3),
        stride_bt_b=block_tables.stride(0),
        stride_bt_j=block_tables.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=k_cache.shape[1],
        QUERIES_PER_KV=q.shape[1] // k_cache.shape[2],
    )
