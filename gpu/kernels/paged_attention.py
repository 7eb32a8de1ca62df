"""Triton paged attention over the block-table KV cache: a decode kernel and a varlen prefill kernel.

Both walk the KV of a sequence in tiles of `BLOCK_N` positions, gathering each position's cache
block from the block table, and keep a flash-attention online softmax in float32.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from gpu.kernels.launch import check_launchable, dot_in_fp32

LOG2_E = 1.4426950408889634
NO_WINDOW = 2**30  # larger than any context, small enough that position - window fits int32
DECODE_BLOCK_N = 64  # KV positions per decode-kernel iteration
DECODE_PARTITION_SIZE = 512  # KV positions per program when decode is split over the context


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
    qk_scale_log2,
    window,
    num_splits,
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
    PARTITION_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,
):
    # Program (sequence, query head, split); sequence b's single query is token b. With SPLIT,
    # each of num_splits programs covers PARTITION_SIZE KV positions and leaves its running max,
    # sum and unnormalised output in the partial buffers for _paged_decode_reduce_kernel.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = head // QUERIES_PER_KV
    context_len = tl.load(context_lens_ptr + seq)
    block_table_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_b

    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_qt + head * stride_qh + offs_d * stride_qd,
        mask=mask_d,
        other=0.0,
    ).to(tl.float32)

    m_i = tl.full([], float("-inf"), tl.float32)
    l_i = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    # The query sits at context_len - 1 and sees positions > context_len - 1 - window.
    partition_start = split * PARTITION_SIZE
    kv_lo = tl.maximum(tl.maximum(context_len - window, 0), partition_start)
    kv_hi = tl.minimum(context_len, partition_start + PARTITION_SIZE)
    for start in range(kv_lo // BLOCK_N * BLOCK_N, kv_hi, BLOCK_N):
        kv_pos = start + offs_n
        kv_valid = (kv_pos >= kv_lo) & (kv_pos < kv_hi)
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
        ).to(tl.float32)
        scores = tl.sum(q[None, :] * k, axis=1) * qk_scale_log2  # [BLOCK_N], log2 domain
        scores = tl.where(kv_valid, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
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
        ).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new

    if not SPLIT:
        # l_i is 0 only for a padding sequence with an empty context: write zeros, not NaN.
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)
        tl.store(
            out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + offs_d * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=mask_d,
        )
    else:
        # A split past the context (or before the window) leaves max -inf, sum 0, output 0.
        partial = (seq.to(tl.int64) * tl.num_programs(1) + head) * num_splits + split
        tl.store(partial_max_ptr + partial, m_i)
        tl.store(partial_sum_ptr + partial, l_i)
        tl.store(partial_out_ptr + partial * HEAD_DIM + offs_d, acc, mask=mask_d)


@triton.jit
def _paged_decode_reduce_kernel(
    out_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    num_splits,
    stride_ot,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    # Program (sequence, query head): merge the splits' softmax states into the output.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    first = (seq.to(tl.int64) * tl.num_programs(1) + head) * num_splits
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    maxes = tl.load(partial_max_ptr + first + offs_s, mask=mask_s, other=float("-inf"))
    sums = tl.load(partial_sum_ptr + first + offs_s, mask=mask_s, other=0.0)
    partial_out = tl.load(
        partial_out_ptr + (first + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    overall_max = tl.max(maxes, axis=0)
    overall_max = tl.where(overall_max == float("-inf"), 0.0, overall_max)
    weights = tl.exp2(maxes - overall_max)  # 0 for empty splits
    total = tl.sum(weights * sums, axis=0)
    out = tl.sum(weights[:, None] * partial_out, axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + offs_d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=mask_d,
    )


@triton.jit
def _paged_prefill_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    context_lens_ptr,
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
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Program (tile, head) owns BLOCK_M queries of one sequence. Sequence b's tiles start at
    # global tile query_start_loc[b] // BLOCK_M + b, which bounds the grid by T // BLOCK_M + B
    # without reading the longest query length back to the host.
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // QUERIES_PER_KV

    offs_b = tl.arange(0, BLOCK_B)
    seq_starts = tl.load(query_start_loc_ptr + offs_b, mask=offs_b < num_seqs, other=0)
    first_tiles = seq_starts // BLOCK_M + offs_b
    seq = tl.sum(((first_tiles <= tile) & (offs_b < num_seqs)).to(tl.int32), axis=0) - 1

    seq_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - seq_start
    q_tile = tile - (seq_start // BLOCK_M + seq)
    if q_tile * BLOCK_M >= q_len:
        return

    context_len = tl.load(context_lens_ptr + seq)
    block_table_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_b
    offs_m = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the sequence
    mask_m = offs_m < q_len
    q_pos = context_len - q_len + offs_m
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)

    token = (seq_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd,
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
    kv_end = context_len - q_len + tl.minimum(q_len, (q_tile + 1) * BLOCK_M)
    kv_first = tl.maximum(context_len - q_len + q_tile * BLOCK_M - window + 1, 0)
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
        ).to(q.dtype)  # the cache may be stored in another dtype
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
        ).to(q.dtype)  # the cache may be stored in another dtype
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # Padding rows past q_len may have seen nothing under a sliding window; they are not stored.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_ot + head * stride_oh + offs_d[None, :] * stride_od,
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
        max_context = block_tables.shape[1] * k_cache.shape[1]
        partition = decode_partition_size(num_seqs, q.shape[1], max_context, q.device)
        return paged_decode(
            q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, partition
        )
    window = _check_attention_args(q, k_cache, v_cache, block_tables, context_lens, sliding_window)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    block_m = 32
    _paged_prefill_kernel[(q.shape[0] // block_m + num_seqs, q.shape[1])](
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        context_lens,
        scale * LOG2_E,
        window,
        num_seqs,
        BLOCK_M=block_m,
        BLOCK_N=32,
        BLOCK_B=max(16, triton.next_power_of_2(num_seqs)),
        DOT_FP32=dot_in_fp32(q.dtype),
        # float32 attention is a correctness mode: no TF32 rounding (16-bit types ignore this).
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        **_layout(q, out, k_cache, v_cache, block_tables),
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
    partition_size: int | None = None,
) -> torch.Tensor:  # [B, H, D], dtype of q
    """Decode attention; with `partition_size` (a multiple of 64), one program per partition of
    each context and a second kernel that merges them (flash-decoding), else one per head."""
    window = _check_attention_args(q, k_cache, v_cache, block_tables, context_lens, sliding_window)
    num_seqs, num_heads, head_dim = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_seqs == 0:
        return out
    if partition_size is not None and partition_size % DECODE_BLOCK_N != 0:
        raise ValueError(f"partition_size {partition_size} is not a multiple of {DECODE_BLOCK_N}")
    max_context = block_tables.shape[1] * k_cache.shape[1]
    num_splits = 1 if partition_size is None else triton.cdiv(max_context, partition_size)
    layout = _layout(q, out, k_cache, v_cache, block_tables)
    if num_splits == 1:
        partial_out = partial_max = partial_sum = out  # unused by the one-pass kernel
    else:
        partial_out = torch.empty(
            num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        partial_max = torch.empty(num_seqs, num_heads, num_splits, device=q.device)
        partial_sum = torch.empty_like(partial_max)
    _paged_decode_kernel[(num_seqs, num_heads, num_splits)](
        out,
        partial_out,
        partial_max,
        partial_sum,
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        scale * LOG2_E,
        window,
        num_splits,
        BLOCK_N=DECODE_BLOCK_N,
        PARTITION_SIZE=NO_WINDOW if num_splits == 1 else partition_size,
        SPLIT=num_splits > 1,
        **layout,
    )
    if num_splits > 1:
        _paged_decode_reduce_kernel[(num_seqs, num_heads)](
            out,
            partial_out,
            partial_max,
            partial_sum,
            num_splits,
            out.stride(0),
            out.stride(1),
            out.stride(2),
            HEAD_DIM=head_dim,
            BLOCK_D=layout["BLOCK_D"],
            BLOCK_S=triton.next_power_of_2(num_splits),
        )
    return out


def decode_partition_size(
    num_seqs: int, num_heads: int, max_context: int, device: torch.device
) -> int | None:
    """Split decode over the context only when sequences x heads cannot fill the GPU's SMs."""
    if device.type != "cuda" or max_context <= DECODE_PARTITION_SIZE:
        return None
    if num_seqs * num_heads >= 2 * _multiprocessor_count(device):
        return None
    return DECODE_PARTITION_SIZE


@functools.cache
def _multiprocessor_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


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
