"""Every Triton kernel in gpu.kernels against its torch reference (interpreter on CPU, or CUDA)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    # Must precede the first import of triton kernels: @triton.jit picks the interpreter then.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gpu import kernels
from gpu.kernels import launch, reference

# The package re-exports the function under the module's name, so fetch the module itself.
paged_attention_module = sys.modules["gpu.kernels.paged_attention"]

DEVICE = "cpu" if launch.interpreting() else "cuda"
# (atol, rtol) against the float32 reference, per input dtype. Beyond bf16's coarse mantissa,
# Triton's interpreter truncates float32 -> bf16 where a GPU rounds to nearest: up to 1 ulp.
TOLERANCE = {
    torch.float32: (2e-5, 1e-5),
    torch.float16: (4e-3, 2e-3),
    torch.bfloat16: (3e-2, 1.6e-2),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
needs_cuda_compiler = pytest.mark.skipif(
    not torch.cuda.is_available() or launch.interpreting(),
    reason="needs a CUDA device and TRITON_INTERPRET unset",
)


@dataclass(slots=True, frozen=True)
class PagedBatch:
    q: torch.Tensor  # [T, H, D]
    k_new: torch.Tensor  # [T, KVH, D]
    v_new: torch.Tensor  # [T, KVH, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, KVH, D], cached tokens written, rest NaN
    v_cache: torch.Tensor  # [num_blocks, block_size, KVH, D]
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    context_lens: torch.Tensor  # [B] int32
    slot_mapping: torch.Tensor  # [T] int64, slots of the new tokens


def make_batch(
    q_lens: list[int],
    cached_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int = 16,
    seed: int = 0,
    device: str = DEVICE,
) -> PagedBatch:
    """A step whose sequences already hold `cached_lens` tokens and add `q_lens` new ones.

    Blocks are handed out in a random order, so block tables are not contiguous, and every
    cache slot no sequence owns holds NaN, so a kernel that reads past a context fails.
    """
    gen = torch.Generator().manual_seed(seed)
    context_lens = [c + q for c, q in zip(cached_lens, q_lens, strict=True)]
    blocks_per_seq = [-(-ctx // block_size) for ctx in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    free_blocks = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_seq) + 2
    block_tables = torch.zeros(len(q_lens), max_blocks, dtype=torch.int32)
    for seq, count in enumerate(blocks_per_seq):
        block_tables[seq, :count] = torch.tensor([free_blocks.pop() for _ in range(count)])

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    v_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    new_slots = []
    for seq, (cached, ctx) in enumerate(zip(cached_lens, context_lens, strict=True)):
        slots = [
            int(block_tables[seq, pos // block_size]) * block_size + pos % block_size
            for pos in range(ctx)
        ]
        old = torch.tensor(slots[:cached], dtype=torch.int64)
        reference.write_kv(
            randn(cached, num_kv_heads, head_dim),
            randn(cached, num_kv_heads, head_dim),
            k_cache,
            v_cache,
            old,
        )
        new_slots += slots[cached:]
    num_tokens = sum(q_lens)
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return PagedBatch(
        q=randn(num_tokens, num_heads, head_dim).to(device),
        k_new=randn(num_tokens, num_kv_heads, head_dim).to(device),
        v_new=randn(num_tokens, num_kv_heads, head_dim).to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        block_tables=block_tables.to(device),
        query_start_loc=query_start_loc.to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(new_slots, dtype=torch.int64, device=device),
    )


# (q_lens, cached_lens): what the scheduler mixes into one step.
SCENARIOS = {
    "decode_only": ([1, 1, 1, 1], [0, 15, 16, 70]),
    "prefill_only": ([9, 40], [0, 0]),
    "chunked_prefill_with_cache": ([33, 5], [31, 64]),
    "mixed": ([1, 20, 1, 35, 3], [30, 13, 0, 50, 0]),
}


def written(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the batch's caches with its new K/V written by the kernel."""
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    kernels.write_kv(batch.k_new, batch.v_new, k_cache, v_cache, batch.slot_mapping)
    return k_cache, v_cache


def attend(
    batch: PagedBatch,
    caches: tuple[torch.Tensor, torch.Tensor],
    sliding_window: int | None = None,
) -> torch.Tensor:
    return kernels.paged_attention(
        batch.q,
        *caches,
        batch.block_tables,
        batch.query_start_loc,
        batch.context_lens,
        batch.q.shape[-1] ** -0.5,
        sliding_window,
    )


def run_attention(batch: PagedBatch, sliding_window: int | None = None) -> torch.Tensor:
    """The kernels' step: write the new K/V (into copies of the caches), then attend."""
    return attend(batch, written(batch), sliding_window)


def reference_attention(batch: PagedBatch, sliding_window: int | None = None) -> torch.Tensor:
    """The same step in the torch reference, on CPU and in float32."""
    k_cache, v_cache = batch.k_cache.cpu().clone(), batch.v_cache.cpu().clone()
    reference.write_kv(
        batch.k_new.cpu(), batch.v_new.cpu(), k_cache, v_cache, batch.slot_mapping.cpu()
    )
    return reference.paged_attention(
        batch.q.cpu().float(),
        k_cache.float(),
        v_cache.float(),
        batch.block_tables.cpu(),
        batch.query_start_loc.cpu(),
        batch.context_lens.cpu(),
        batch.q.shape[-1] ** -0.5,
        sliding_window,
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.cpu().float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (6, 2)], ids=["mha", "gqa3"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_paged_attention_matches_reference(
    scenario: str, num_heads: int, num_kv_heads: int, dtype: torch.dtype
) -> None:
    q_lens, cached_lens = SCENARIOS[scenario]
    batch = make_batch(q_lens, cached_lens, num_heads, num_kv_heads, 32, dtype)
    assert_close(run_attention(batch), reference_attention(batch), dtype)


@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 16), (24, 8), (16, 32)])
def test_paged_attention_head_dims_and_block_sizes(head_dim: int, block_size: int) -> None:
    batch = make_batch([1, 17, 1], [40, 9, 3], 3, 1, head_dim, torch.float32, block_size)
    assert_close(run_attention(batch), reference_attention(batch), torch.float32)


@pytest.mark.parametrize("scenario", ["decode_only", "mixed"])
def test_paged_attention_sliding_window(scenario: str) -> None:
    q_lens, cached_lens = SCENARIOS[scenario]
    batch = make_batch(q_lens, cached_lens, 4, 2, 32, torch.float32, seed=1)
    expected = reference_attention(batch, sliding_window=7)
    assert_close(run_attention(batch, sliding_window=7), expected, torch.float32)
    # A window this short must change the answer, or the test would not be testing it.
    assert not torch.allclose(expected, reference_attention(batch), atol=1e-3)


def test_paged_attention_reads_strided_queries() -> None:
    batch = make_batch([1, 12], [20, 4], 2, 2, 32, torch.float32)
    qkv = torch.cat([batch.q, batch.q], dim=1)  # [T, 2H, D]: q is a strided view into it
    strided = replace(batch, q=qkv[:, :2])
    assert not strided.q.is_contiguous()
    assert_close(run_attention(strided), reference_attention(batch), torch.float32)


@pytest.mark.parametrize("scenario", ["decode_only", "mixed"])
def test_paged_attention_with_a_float32_cache_and_float16_queries(scenario: str) -> None:
    q_lens, cached_lens = SCENARIOS[scenario]
    batch = make_batch(q_lens, cached_lens, 6, 2, 32, torch.float32, seed=2)
    half = replace(batch, q=batch.q.half(), k_new=batch.k_new.half(), v_new=batch.v_new.half())
    assert_close(run_attention(half), reference_attention(half), torch.float16)


# Contexts that end inside, on and past 64-position partition edges, a long one spread over every
# split and a one-token one: ragged, with splits left empty. Sliding windows leave the first
# tiles of long contexts unseen.
SPLIT_DECODE_CACHED = [0, 14, 63, 64, 199, 129, 400]
FOUR_SPLITS = paged_attention_module.DecodeSplits(count=4, min_partition=64)


def decode(
    batch: PagedBatch,
    caches: tuple[torch.Tensor, torch.Tensor],
    sliding_window: int | None,
    splits: paged_attention_module.DecodeSplits | None = FOUR_SPLITS,
) -> torch.Tensor:
    return paged_attention_module.paged_decode(
        batch.q,
        *caches,
        batch.block_tables,
        batch.context_lens,
        batch.q.shape[-1] ** -0.5,
        sliding_window,
        splits,
    )


def split_decode(
    batch: PagedBatch,
    sliding_window: int | None,
    splits: paged_attention_module.DecodeSplits | None = FOUR_SPLITS,
) -> torch.Tensor:
    return decode(batch, written(batch), sliding_window, splits)


@pytest.mark.parametrize("sliding_window", [None, 7, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group", [1, 3, 4, 5, 8])
def test_split_decode_matches_reference(
    group: int, dtype: torch.dtype, sliding_window: int | None
) -> None:
    batch = make_batch([1] * 7, SPLIT_DECODE_CACHED, 2 * group, 2, 32, dtype, seed=3 + group)
    expected = reference_attention(batch, sliding_window)
    assert_close(split_decode(batch, sliding_window), expected, dtype)
    assert_close(split_decode(batch, sliding_window, None), expected, dtype)


def test_split_decode_merges_more_partitions_than_one_reduce_pass_holds() -> None:
    # 40 partitions of 64: the reduce merges them 16 at a time.
    batch = make_batch([1, 1], [40 * 64 - 1, 900], 4, 1, 32, torch.float32, seed=8)
    splits = paged_attention_module.DecodeSplits(count=40, min_partition=64)
    assert_close(split_decode(batch, None, splits), reference_attention(batch), torch.float32)


def loads_per_element(
    monkeypatch: pytest.MonkeyPatch, caches: dict[str, torch.Tensor]
) -> dict[str, np.ndarray]:
    """Count, per element of each cache, how often the interpreter's masked loads read it."""
    from triton.runtime import interpreter

    counts = {name: np.zeros(cache.numel(), dtype=np.int64) for name, cache in caches.items()}
    load = interpreter.InterpreterBuilder.create_masked_load

    def counting_load(self, ptrs, mask, other, cache_policy, is_volatile):  # type: ignore[no-untyped-def]
        addresses = ptrs.data[mask.data].astype(np.int64).ravel()
        for name, cache in caches.items():
            index = (addresses - cache.data_ptr()) // cache.element_size()
            inside = (index >= 0) & (index < cache.numel())
            np.add.at(counts[name], index[inside], 1)
        return load(self, ptrs, mask, other, cache_policy, is_volatile)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", counting_load)
    return counts


@pytest.mark.skipif(not launch.interpreting(), reason="counts the interpreter's loads")
@pytest.mark.parametrize("sliding_window", [None, 100])
def test_split_decode_reads_each_kv_element_once_per_kv_head(
    monkeypatch: pytest.MonkeyPatch, sliding_window: int | None
) -> None:
    # Four query heads share each KV head: a kernel per query head would read everything 4x.
    batch = make_batch([1] * 7, SPLIT_DECODE_CACHED, 8, 2, 32, torch.float32, seed=5)
    k_cache, v_cache = written(batch)
    counts = loads_per_element(monkeypatch, {"k": k_cache, "v": v_cache})
    decode(batch, (k_cache, v_cache), sliding_window)
    # Expected: every element of every position a query sees, once; nothing else.
    expected = torch.zeros(k_cache.shape, dtype=torch.int64)
    block_size = k_cache.shape[1]
    for seq, context in enumerate(batch.context_lens.tolist()):
        first = 0 if sliding_window is None else max(context - sliding_window, 0)
        for pos in range(first, context):
            block = int(batch.block_tables[seq, pos // block_size])
            expected[block, pos % block_size] = 1
    for name in ("k", "v"):
        assert np.array_equal(counts[name], expected.flatten().numpy()), name


@pytest.mark.skipif(not launch.interpreting(), reason="counts the interpreter's loads")
def test_prefill_gathers_each_kv_tile_once_per_query_tile_for_the_whole_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One 40-token prompt, 4 query heads a KV head: tiles of 16 queries (64 rows). Position p
    # is read by the tiles at or after its own, 3 - p // 16 of them, for all 4 heads at once.
    batch = make_batch([40], [0], 8, 2, 32, torch.bfloat16, seed=2)
    k_cache, v_cache = written(batch)
    counts = loads_per_element(monkeypatch, {"k": k_cache, "v": v_cache})
    attend(batch, (k_cache, v_cache))
    expected = torch.zeros(k_cache.shape, dtype=torch.int64)
    for pos in range(40):
        block = int(batch.block_tables[0, pos // k_cache.shape[1]])
        expected[block, pos % k_cache.shape[1]] = 3 - pos // 16
    for name in ("k", "v"):
        assert np.array_equal(counts[name], expected.flatten().numpy()), name


def test_decode_split_bounds_follow_the_batch_and_the_context_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(paged_attention_module, "multiprocessor_count", lambda device: 132)
    choose = paged_attention_module.decode_splits
    splits = paged_attention_module.DecodeSplits
    cuda = torch.device("cuda")
    short, long = (
        paged_attention_module.DECODE_PARTITION_SIZE,
        paged_attention_module.LONG_PARTITION,
    )
    # One sequence, 8 KV heads: cut down to 512 positions to fill 132 SMs twice.
    assert choose(1, 8, 4096, cuda) == splits(8, short)
    assert choose(4, 8, 131072, cuda) == splits(9, short)  # cdiv(264, 32) programs a context
    # 64 x 8 programs fill the GPU: only contexts past 4096 are cut, into at most 32 here, and
    # never more than 64 (so the reduce is bounded) even at a 1M-token bound.
    assert choose(64, 8, 2048, cuda) == splits(1, long)
    assert choose(64, 8, 131072, cuda) == splits(32, long)
    assert choose(256, 8, 1 << 20, cuda) == splits(paged_attention_module.MAX_DECODE_SPLITS, long)
    assert choose(1, 8, 256, cuda).count == 1  # one partition anyway
    assert choose(1, 8, 4096, torch.device("cpu")).count == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group", [1, 3, 4, 5, 8])
def test_prefill_holds_a_kv_heads_whole_group_in_its_rows(group: int, dtype: torch.dtype) -> None:
    # Rows are (query, head) pairs of one KV head's group: 64 // group queries a tile (3 and 5
    # leave rows unused), chunks that start mid-sequence and end mid-tile, with sliding windows.
    batch = make_batch([33, 5, 1, 70], [31, 64, 9, 0], 2 * group, 2, 32, dtype, seed=group)
    for window in (None, 20):
        expected = reference_attention(batch, window)
        assert_close(run_attention(batch, window), expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prefill_finds_its_sequence_among_more_than_one_search_block(dtype: torch.dtype) -> None:
    # 37 sequences: each prefill program searches for its own 16 at a time (one variant for any
    # batch), so the later ones are found in the third block.
    gen = torch.Generator().manual_seed(4)
    q_lens = [int(n) for n in torch.randint(1, 12, (37,), generator=gen)]
    cached = [int(n) for n in torch.randint(0, 30, (37,), generator=gen)]
    batch = make_batch(q_lens, cached, 2, 1, 16, dtype, seed=9)
    assert_close(run_attention(batch), reference_attention(batch), dtype)


FP8 = torch.float8_e4m3fn


def fp8_representable(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return ((t.float() / scale).clamp(-448, 448).to(FP8).float() * scale).to(t.dtype)


def fp8_step(batch: PagedBatch, scales: tuple[torch.Tensor, torch.Tensor]) -> PagedBatch:
    """The batch with its new K/V made exact in e4m3 under these scales, and its cached tokens
    stored in an fp8 cache (slots no sequence owns stay NaN).

    Exact values, because Triton's interpreter rounds float32 to fp8 wrongly where rounding up
    carries into the exponent (127.2 -> 64, not 128): on a GPU the conversion is the hardware's
    cvt.rn.satfinite, so the test checks what is scaled and stored, not the interpreter's
    rounding."""
    k_cache = (batch.k_cache.float() / scales[0]).clamp(-448, 448).to(FP8)
    v_cache = (batch.v_cache.float() / scales[1]).clamp(-448, 448).to(FP8)
    assert torch.isnan(k_cache.float()).any()
    return replace(
        batch,
        k_new=fp8_representable(batch.k_new, scales[0]),
        v_new=fp8_representable(batch.v_new, scales[1]),
        k_cache=k_cache,
        v_cache=v_cache,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scenario", ["decode_only", "mixed"])
def test_fp8_kv_cache_writes_scaled_e4m3_and_attends_to_its_values(
    scenario: str, dtype: torch.dtype
) -> None:
    # Keys scaled by 5: with scale 1 some would saturate at 448, with 1/32 none does.
    q_lens, cached_lens = SCENARIOS[scenario]
    batch = make_batch(q_lens, cached_lens, 6, 2, 32, dtype, seed=6)
    batch = replace(batch, k_new=batch.k_new * 5, k_cache=batch.k_cache * 5)
    scales = (torch.tensor([1 / 32]), torch.tensor([0.5]))
    step = fp8_step(batch, scales)
    k_cache, v_cache = step.k_cache.clone(), step.v_cache.clone()
    kernels.write_kv(step.k_new, step.v_new, k_cache, v_cache, step.slot_mapping, scales)
    ref_k, ref_v = step.k_cache.clone(), step.v_cache.clone()
    reference.write_kv(step.k_new, step.v_new, ref_k, ref_v, step.slot_mapping, scales)
    # The bytes stored are torch's e4m3 rounding of value / scale.
    assert torch.equal(k_cache.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), ref_v.view(torch.uint8))
    out = kernels.paged_attention(
        step.q,
        k_cache,
        v_cache,
        step.block_tables,
        step.query_start_loc,
        step.context_lens,
        32**-0.5,
        kv_scales=scales,
    )
    expected = reference.paged_attention(
        step.q.float(),
        reference.dequantize(ref_k, scales[0]),
        reference.dequantize(ref_v, scales[1]),
        step.block_tables,
        step.query_start_loc,
        step.context_lens,
        32**-0.5,
    )
    assert_close(out, expected, dtype)


def test_fp8_kv_cache_saturates_instead_of_overflowing() -> None:
    batch = make_batch([1], [0], 2, 1, 16, torch.float32)
    k = torch.full_like(batch.k_new, 1e4)
    scales = (torch.tensor([1.0]), torch.tensor([1.0]))
    cache = torch.zeros(batch.k_cache.shape, dtype=FP8)
    kernels.write_kv(k, -k, cache, cache.clone(), batch.slot_mapping, scales)
    slot = int(batch.slot_mapping[0])
    stored = cache.view(-1, 1, 16)[slot].float()
    assert torch.equal(stored, torch.full_like(stored, 448.0))


def test_an_fp8_cache_needs_its_scales_and_another_none() -> None:
    batch = make_batch([1], [3], 2, 1, 16, torch.float32)
    fp8 = torch.zeros(batch.k_cache.shape, dtype=FP8)
    with pytest.raises(ValueError, match="needs its k and v scales"):
        kernels.write_kv(batch.k_new, batch.v_new, fp8, fp8.clone(), batch.slot_mapping)
    with pytest.raises(ValueError, match="has no scales"):
        kernels.write_kv(
            batch.k_new,
            batch.v_new,
            batch.k_cache,
            batch.v_cache,
            batch.slot_mapping,
            (torch.ones(1), torch.ones(1)),
        )


def test_decode_of_an_empty_padding_sequence_writes_zeros() -> None:
    batch = make_batch([1, 1, 1], [5, 20, 3], 4, 2, 16, torch.float32)
    expected = reference_attention(batch)
    padded = replace(batch, context_lens=torch.tensor([5 + 1, 0, 3 + 1], dtype=torch.int32))
    out = run_attention(padded).cpu()
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert_close(out[[0, 2]], expected[[0, 2]], torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_kv_fills_exactly_the_mapped_slots(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    num_blocks, block_size, num_kv_heads, head_dim = 5, 16, 3, 24
    k = torch.randn(7, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(7, num_kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.tensor([17, 3, -1, 79, 40, -1, 64], dtype=torch.int64)  # -1: padding
    caches = [
        torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
        for _ in range(2)
    ]
    expected = [c.clone() for c in caches]
    reference.write_kv(k, v, *expected, slots)
    actual = [c.clone().to(DEVICE) for c in caches]
    kernels.write_kv(k.to(DEVICE), v.to(DEVICE), *actual, slots.to(DEVICE))
    for got, want in zip(actual, expected, strict=True):
        assert torch.equal(got.cpu(), want)
    assert not torch.equal(expected[0], caches[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_matches_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, 576, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(576, generator=gen)).to(dtype)
    out = kernels.rms_norm(x.to(DEVICE), weight.to(DEVICE), 1e-5)
    assert_close(out, reference.rms_norm(x, weight, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_add_rms_norm_matches_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    x, residual = (torch.randn(4, 200, generator=gen).to(dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(200, generator=gen)).to(dtype)
    inputs = (x.clone().to(DEVICE), residual.clone().to(DEVICE))
    normed, summed = kernels.fused_add_rms_norm(*inputs, weight.to(DEVICE), 1e-6)
    want_normed, want_summed = reference.fused_add_rms_norm(x, residual, weight, 1e-6)
    if dtype == torch.bfloat16 and launch.interpreting():
        assert_close(summed, want_summed, dtype)  # truncating bf16 rounding, see TOLERANCE
    else:
        assert torch.equal(summed.cpu(), want_summed)
    assert_close(normed, want_normed, dtype)
    assert torch.equal(inputs[1].cpu(), residual)  # the residual input is left alone


def rope_inv_freq(head_dim: int, base: float) -> torch.Tensor:  # [D / 2], as HF Llama builds it
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_matches_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(6)
    num_tokens, num_heads, num_kv_heads, head_dim = 6, 3, 1, 64
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    positions = torch.tensor([0, 1, 2, 37, 500, 2047])
    inv_freq = rope_inv_freq(head_dim, 100000.0)
    cache = kernels.rotary_cos_sin_cache(inv_freq.to(DEVICE), 2048)
    q_dev, k_dev = q.clone().to(DEVICE), k.clone().to(DEVICE)
    q_out, k_out = kernels.rotary(q_dev, k_dev, positions.to(DEVICE), cache)
    assert q_out is q_dev and k_out is k_dev  # rotated in place
    want_q, want_k = reference.rotary(q, k, positions, inv_freq)
    assert_close(q_out, want_q, dtype)
    assert_close(k_out, want_k, dtype)


def test_rotary_reference_is_transformers_llama() -> None:
    modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(5, 2, 16, generator=gen)
    k = torch.randn(5, 1, 16, generator=gen)
    positions = torch.tensor([3, 0, 9, 100, 41])
    inv_freq = rope_inv_freq(16, 10000.0)
    emb = torch.cat([positions[:, None] * inv_freq] * 2, dim=-1)
    # HF takes [batch, heads, seq, D] with cos/sin [batch, seq, D].
    hf_q, hf_k = modeling_llama.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], emb.cos()[None], emb.sin()[None]
    )
    want_q, want_k = reference.rotary(q, k, positions, inv_freq)
    torch.testing.assert_close(want_q, hf_q[0].transpose(0, 1), atol=1e-5, rtol=0)
    torch.testing.assert_close(want_k, hf_k[0].transpose(0, 1), atol=1e-5, rtol=0)


def test_rotary_rotates_strided_views_of_qkv() -> None:
    gen = torch.Generator().manual_seed(8)
    qkv = torch.randn(4, 2 + 1 + 1, 32, generator=gen)  # [T, H + 2 * KVH, D]
    q_before, k_before = qkv[:, :2].clone(), qkv[:, 2:3].clone()
    v_before = qkv[:, 3:].clone()
    positions = torch.tensor([5, 6, 7, 8])
    # Any frequencies work, such as Llama 3's rescaled ones: the cache is built from them.
    inv_freq = rope_inv_freq(32, 10000.0) * torch.linspace(1.0, 0.125, 16)
    fused = qkv.to(DEVICE)
    cache = kernels.rotary_cos_sin_cache(inv_freq.to(DEVICE), 16)
    kernels.rotary(fused[:, :2], fused[:, 2:3], positions.to(DEVICE), cache)
    want_q, want_k = reference.rotary(q_before, k_before, positions, inv_freq)
    torch.testing.assert_close(fused[:, :2].cpu(), want_q, atol=2e-5, rtol=0)
    torch.testing.assert_close(fused[:, 2:3].cpu(), want_k, atol=2e-5, rtol=0)
    assert torch.equal(fused[:, 3:].cpu(), v_before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_matches_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(9)
    gate_up = (3 * torch.randn(3, 2 * 1536, generator=gen)).to(dtype)
    assert_close(kernels.silu_mul(gate_up.to(DEVICE)), reference.silu_mul(gate_up), dtype)


def test_cpu_tensors_without_interpreter_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        kernels.silu_mul(torch.zeros(2, 8))


def test_empty_step_launches_nothing() -> None:
    cache = torch.zeros(2, 16, 1, 16, device=DEVICE)
    q = torch.zeros(0, 2, 16, device=DEVICE)
    out = kernels.paged_attention(
        q,
        cache,
        cache,
        torch.zeros(0, 1, dtype=torch.int32, device=DEVICE),
        torch.zeros(1, dtype=torch.int32, device=DEVICE),
        torch.zeros(0, dtype=torch.int32, device=DEVICE),
        0.25,
    )
    assert out.shape == (0, 2, 16)


def test_attention_rejects_mismatched_heads() -> None:
    batch = make_batch([1, 1], [3, 4], 5, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="evenly"):
        run_attention(batch)


@pytest.mark.cuda
@needs_cuda_compiler
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_paged_attention_cuda_realistic_shapes(dtype: torch.dtype) -> None:
    # SmolLM2 attention shape (9 query heads, 3 KV heads, D = 64) at a serving-sized batch.
    q_lens = [1] * 24 + [300, 77, 512]
    gen = torch.Generator().manual_seed(10)
    cached_lens = [*torch.randint(1, 2000, (24,), generator=gen).tolist(), 0, 900, 1500]
    batch = make_batch(q_lens, cached_lens, 9, 3, 64, dtype, device="cuda")
    assert_close(run_attention(batch), reference_attention(batch), dtype)
    decodes = make_batch(
        [1] * 64, cached_lens[:24] * 2 + [4000] * 16, 9, 3, 64, dtype, device="cuda"
    )
    assert_close(run_attention(decodes), reference_attention(decodes), dtype)
    # One long sequence cannot fill the GPU: the split (flash-decoding) path.
    single = make_batch([1], [6000], 9, 3, 64, dtype, device="cuda")
    max_context = single.block_tables.shape[1] * single.k_cache.shape[1]
    assert paged_attention_module.decode_splits(1, 3, max_context, single.q.device).count > 1
    assert_close(run_attention(single), reference_attention(single), dtype)
