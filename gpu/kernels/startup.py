"""Every Triton kernel variant a model's forward can meet, compiled before the first request.

A variant is fixed by a kernel's constexprs (the model's head counts and sizes, the activation
and cache dtypes, tile sizes chosen from those) and by Triton's specialisation of its integer
arguments. The arguments that change from step to step are `do_not_specialize` in the kernels;
the rest are strides that the model's layout fixes (a fused QKV row, a cache block, a hidden
row), whatever the step's batch, lengths or contexts. So one launch of each kernel, on small
tensors laid out as a forward lays them out, compiles the whole set: a server compiles nothing
while serving (`pipeline-bench kernels` and tests/gpu/test_kernel_check.py show a mixed run of
steps meets nothing outside it).
"""

from __future__ import annotations

import torch

from gpu.kernels.activation import silu_mul
from gpu.kernels.kv_cache import write_kv
from gpu.kernels.norm import fused_add_rms_norm, rms_norm
from gpu.kernels.paged_attention import DecodeSplits, paged_attention, paged_decode
from gpu.kernels.rotary import rotary


def compile_kernels(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    hidden_size: int,
    intermediate_size: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    block_size: int,
    device: torch.device,
) -> None:
    """Launch each kernel once for this shape (one rank's, under tensor parallelism) on `device`,
    so that Triton compiles (or loads from its cache) every variant a forward can meet."""

    def zeros(*size: int, dtype: torch.dtype = dtype) -> torch.Tensor:
        return torch.zeros(*size, dtype=dtype, device=device)

    # A step of two sequences: one prefilling two tokens, one decoding.
    tokens, h, kvh, d = 3, num_heads, num_kv_heads, head_dim
    x, residual, weight = zeros(tokens, hidden_size), zeros(tokens, hidden_size), zeros(hidden_size)
    rms_norm(x, weight, 1e-5)
    fused_add_rms_norm(x, residual, weight, 1e-5)
    qkv = zeros(tokens, (h + 2 * kvh) * d)
    q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    q, k, v = q.view(tokens, h, d), k.view(tokens, kvh, d), v.view(tokens, kvh, d)
    rotary(q, k, zeros(tokens, dtype=torch.int64), zeros(tokens, d, dtype=torch.float32))
    k_cache = zeros(2, block_size, kvh, d, dtype=cache_dtype)
    v_cache = zeros(2, block_size, kvh, d, dtype=cache_dtype)
    scales = None
    if cache_dtype == torch.float8_e4m3fn:
        scales = (zeros(1, dtype=torch.float32), zeros(1, dtype=torch.float32))
    slots = torch.full((tokens,), -1, dtype=torch.int64, device=device)
    write_kv(k, v, k_cache, v_cache, slots, scales)
    block_tables = torch.tensor([[0], [1]], dtype=torch.int32, device=device)
    context_lens = torch.tensor([2, 1], dtype=torch.int32, device=device)
    query_start_loc = torch.tensor([0, 2, 3], dtype=torch.int32, device=device)
    paged_attention(
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, d**-0.5, None, scales
    )
    # A decode step (one query per sequence, rows of the same fused QKV), unsplit and split: the
    # split adds the reduce.
    for splits in (DecodeSplits(1, 64), DecodeSplits(2, 64)):
        paged_decode(
            q[:2], k_cache, v_cache, block_tables, context_lens, d**-0.5, None, splits, scales
        )
    silu_mul(zeros(tokens, 2 * intermediate_size))
