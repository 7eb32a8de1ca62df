"""The native CPU kernels (gpu/native) against the torch reference of each op, at every ISA level
this host runs (the `cpu_isa` fixture)."""

from __future__ import annotations

import ctypes
import itertools
import subprocess
import sys

import numpy as np
import pytest
import torch

from gpu import native
from gpu.backends import NATIVE_KERNELS, TORCH_KERNELS, Rope, _split_rotate, kernels_for
from gpu.kernels import reference
from gpu.quant import NativeQ4Linear, NativeQ8Linear
from tests.cpu_levels import NATIVE_LEVELS

# With a compiler on the machine the kernels must build: a build error fails here, not skips.
pytestmark = pytest.mark.skipif(
    not NATIVE_LEVELS, reason="needs a C compiler and PIPELINE_SERVE_NATIVE other than 0"
)


def test_rms_norm_and_the_fused_residual_add(cpu_isa):
    x, residual, weight = torch.randn(7, 96), torch.randn(7, 96), torch.randn(96)
    torch.testing.assert_close(
        native.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6)
    )
    expected_normed, expected_sum = reference.fused_add_rms_norm(x, residual, weight, 1e-6)
    stream = residual.clone()
    normed = native.add_rms_norm(stream, x, weight, 1e-6)
    torch.testing.assert_close(stream, expected_sum)  # summed in place
    torch.testing.assert_close(normed, expected_normed)


@pytest.mark.parametrize("rows", [1, 300])  # serial and OpenMP-parallel
def test_silu_mul(cpu_isa, rows):
    gate_up = torch.randn(rows, 2 * 75) * 6
    torch.testing.assert_close(native.silu_mul(gate_up), reference.silu_mul(gate_up))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_rope_rotates_in_place_and_writes_the_cache(cpu_isa, cache_dtype):
    heads, kv_heads, dim, tokens = 6, 2, 16, 9
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    positions = torch.tensor([0, 1, 2, 3, 4, 40, 41, 1000, 7])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    rope = Rope(freqs.cos(), freqs.sin())
    q_ref, k_ref, v_ref = _split_rotate(qkv.clone(), rope, heads, kv_heads)
    slots = torch.tensor([5, 0, 17, 3, -1, 8, 9, 30, 2])  # -1: not stored
    caches = [torch.zeros(4, 8, kv_heads, dim, dtype=cache_dtype) for _ in range(2)]
    native.rope_write_kv(qkv, rope.cos, rope.sin, heads, kv_heads, slots, *caches)
    torch.testing.assert_close(qkv[:, : heads * dim].view(tokens, heads, dim), q_ref)
    for cache, ref in zip(caches, (k_ref, v_ref), strict=True):
        flat = cache.view(-1, kv_heads, dim)
        keep = slots >= 0
        torch.testing.assert_close(flat[slots[keep]], ref[keep].to(cache_dtype))
        written = torch.zeros(flat.shape[0], dtype=torch.bool)
        written[slots[keep]] = True
        assert not flat[~written].any()


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "cache_dtype", "window"),
    [
        (9, 3, 64, torch.float32, None),  # SmolLM2's shape, the AVX-512 path
        (10, 2, 32, torch.bfloat16, None),  # group of 5: two register tiles
        (4, 4, 80, torch.float32, 7),  # no grouping, 5 chunks of 16, sliding window
        (6, 2, 24, torch.float32, None),  # head_dim not a multiple of 16: 8 lanes (AVX2)
        (8, 1, 128, torch.bfloat16, 20),
    ],
)
def test_paged_decode_attention_matches_the_reference(
    cpu_isa, heads, kv_heads, dim, cache_dtype, window
):
    block_size, num_blocks = 4, 40
    rng = np.random.default_rng(heads * dim)
    lens = [1, 5, 33, 70, 16]
    tables = torch.zeros(len(lens), 20, dtype=torch.int32)
    order = torch.from_numpy(rng.permutation(num_blocks).astype(np.int32))
    used = 0
    for b, n in enumerate(lens):
        need = -(-n // block_size)
        tables[b, :need] = order[used : used + need]
        used += need
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim).to(cache_dtype)
    # q rows are strided like the q part of fused qkv rows; the decodes sit at rows 2, 0, 4, ...
    qkv = torch.randn(len(lens) + 1, (heads + 2 * kv_heads) * dim)
    q = qkv[:, : heads * dim].view(-1, heads, dim)
    token_index = torch.tensor([2, 0, 4, 1, 5])
    out = torch.full((len(lens) + 1, heads, dim), float("nan"))
    context_lens = torch.tensor(lens, dtype=torch.int32)
    native.paged_decode_attention(
        q, k_cache, v_cache, token_index, tables, context_lens, 0.3, window, out
    )
    expected = reference.paged_attention(
        q[token_index].contiguous(),
        k_cache,
        v_cache,
        tables,
        torch.arange(len(lens) + 1, dtype=torch.int32),
        context_lens,
        0.3,
        window,
    )
    torch.testing.assert_close(out[token_index], expected, rtol=1e-4, atol=1e-5)
    assert out[3].isnan().all()  # rows that are not decodes are left alone


def _decoded_alone(
    q: torch.Tensor,  # [H, D] float32: one position's query
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,  # [max_blocks] int32
    context_len: int,
    scale: float,
    window: int | None,
) -> torch.Tensor:  # [H, D]: the position's attention as a decode step of one row gives it
    out = torch.empty(1, *q.shape)
    native.paged_decode_attention(
        q[None].contiguous(),
        k_cache,
        v_cache,
        torch.zeros(1, dtype=torch.int64),
        table[None].contiguous(),
        torch.tensor([context_len], dtype=torch.int32),
        scale,
        window,
        out,
    )
    return out[0]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "cache_dtype"),
    [
        (9, 3, 64, torch.bfloat16),  # SmolLM2's shape
        (10, 2, 32, torch.float32),
        (8, 1, 128, torch.bfloat16),  # a group of 8: 8 rows fill an item
    ],
)
def test_decode_rows_of_one_sequence_share_an_item_and_keep_their_bits(
    cpu_isa, heads, kv_heads, dim, cache_dtype
):
    """A sequence verifying drafts is attended as consecutive decode rows on one block table
    (gpu.runner._attention_rows). The kernel reads their keys once for all of them; each row must
    still get the bits it gets attended alone, or greedy speculation would not write plain
    decoding's text."""
    block_size, num_blocks = 4, 64
    rng = np.random.default_rng(dim)
    order = rng.permutation(num_blocks).astype(np.int32)
    spans = [(30, 6), (5, 1), (17, 11), (9, 2)]  # (first row's context, positions verified)
    tables, lens = [], []
    used = 0
    for context, verified in spans:
        need = -(-(context + verified - 1) // block_size)
        table = np.zeros(20, np.int32)
        table[:need] = order[used : used + need]
        used += need
        for j in range(verified):
            tables.append(table)
            lens.append(context + j)
    # a prefix-cached sequence: the first span's full blocks, then blocks of its own
    shared = tables[0].copy()
    shared[3:6] = order[used : used + 3]
    tables.append(shared)
    lens.append(21)
    tables.insert(7, tables[0])  # the first span's table after an unrelated row: its own item
    lens.insert(7, 34)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim).to(cache_dtype)
    rows = len(lens)
    block_tables = torch.from_numpy(np.stack(tables))
    context_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(rows, heads, dim)
    index = torch.arange(rows)
    out = torch.empty(rows, heads, dim)
    native.paged_decode_attention(
        q, k_cache, v_cache, index, block_tables, context_lens, 0.2, None, out
    )
    for r in range(rows):
        alone = _decoded_alone(q[r], k_cache, v_cache, block_tables[r], lens[r], 0.2, None)
        assert torch.equal(out[r], alone), f"row {r}"
    expected = reference.paged_attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        torch.arange(rows + 1, dtype=torch.int32),
        context_lens,
        0.2,
        None,
    )
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).abs().max() / expected.abs().max()).item()


def _weights_of(linear: torch.nn.Module) -> torch.Tensor:  # [N, K] as the kernel sees them
    """Identity rows quantize exactly (one 1.0 per row: scale 1/127, code 127), so
    linear(I) = W.T up to float32 rounding."""
    return linear(torch.eye(linear.in_features)).T


# The row layout at every level; the 16-channel layout of the many-row kernels where they exist.
LAYOUTS = [
    *(pytest.param(level, False, id=f"{level}-row-layout") for level in NATIVE_LEVELS),
    *(
        pytest.param(level, True, id=f"{level}-16-channel-layout")
        for level in NATIVE_LEVELS
        if level != "portable"
    ),
]
LEVEL_LAYOUT = ("cpu_isa", "many_rows")


@pytest.mark.parametrize(LEVEL_LAYOUT, LAYOUTS, indirect=["cpu_isa"])
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 33])
@pytest.mark.parametrize("in_features", [96, 160, 576, 608])  # quads, pairs and single blocks
def test_q4_1_matmul_against_the_dequantized_weights(cpu_isa, rows, in_features, many_rows):
    weight = torch.randn(70, in_features) * 0.05  # 70: the last group of 16 channels is partial
    linear = NativeQ4Linear.from_float(weight, many_rows)
    dequantized = _weights_of(linear)
    assert _relative_error(dequantized, weight) < 0.1  # 16 levels per 32 weights
    x = torch.randn(rows, in_features)
    # Activations are rounded to int8 per 32: about 1 / 254 of each block's largest value.
    assert _relative_error(linear(x), x @ dequantized.T) < 0.02


@pytest.mark.parametrize(LEVEL_LAYOUT, LAYOUTS, indirect=["cpu_isa"])
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
def test_q8_0_matmul_against_the_dequantized_weights(cpu_isa, rows, many_rows):
    weight = torch.randn(300, 160)
    linear = NativeQ8Linear.from_float(weight, many_rows)
    groups = weight.view(300, 5, 32)
    scales = (groups.abs().amax(-1) / 127).half().float()
    # times the reciprocal, as llama.cpp's quantize_row_q8_0 (dividing rounds a tie differently)
    codes = torch.round(groups * (1.0 / scales[..., None])).clamp(-127, 127)
    dequantized = (codes * scales[..., None]).view(300, 160)
    torch.testing.assert_close(_weights_of(linear), dequantized)
    assert _relative_error(dequantized, weight) < 0.01
    x = torch.randn(rows, 160)
    assert _relative_error(linear(x), x @ dequantized.T) < 0.02
    assert linear(x.view(rows, 1, 160)).shape == (rows, 1, 300)


@pytest.mark.parametrize(LEVEL_LAYOUT, LAYOUTS, indirect=["cpu_isa"])
@pytest.mark.parametrize("blocks", [1, 2, 3, 4, 7])
def test_q4_1_blocks_load_unchanged(cpu_isa, blocks, many_rows):
    """GGUF Q4_1 bytes (f16 d, f16 m, 16 bytes of nibbles) give w = d * q + m exactly."""
    rng = np.random.default_rng(blocks)
    d = rng.uniform(0.01, 0.02, (3, blocks)).astype(np.float16)
    m = rng.uniform(-0.1, 0.0, (3, blocks)).astype(np.float16)
    nibbles = rng.integers(0, 256, (3, blocks, 16), dtype=np.uint8)
    raw = np.concatenate(
        [
            d.view(np.uint8).reshape(3, blocks, 2),
            m.view(np.uint8).reshape(3, blocks, 2),
            nibbles,
        ],
        axis=-1,
    )
    linear = NativeQ4Linear.from_q4_1(raw.reshape(3, blocks * 20), 3, blocks * 32, many_rows)
    codes = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).astype(np.float32)
    expected = codes * d.astype(np.float32)[..., None] + m.astype(np.float32)[..., None]
    torch.testing.assert_close(
        _weights_of(linear), torch.from_numpy(expected.reshape(3, blocks * 32))
    )


GEMM_LEVELS = [level for level in NATIVE_LEVELS if level != "portable"]


@pytest.mark.skipif(len(GEMM_LEVELS) < 2, reason="needs two levels with the many-row kernels")
def test_the_many_row_kernels_give_the_same_bits_at_every_level():
    """Weights in the 16-channel layout give the same outputs to the bit at avx2 as at
    avx512_vnni (the same integer dots, the same float steps after them), so a model's tokens do
    not depend on which of a fleet's CPUs served them."""
    generator = torch.Generator().manual_seed(0)
    w4, x4 = (
        torch.randn(70, 608, generator=generator) * 0.05,
        torch.randn(9, 608, generator=generator),
    )
    w8, x8 = torch.randn(300, 160, generator=generator), torch.randn(9, 160, generator=generator)
    outputs = []
    for level in GEMM_LEVELS:
        with native.using_level(level):
            q4, q8 = NativeQ4Linear.from_float(w4, True), NativeQ8Linear.from_float(w8, True)
            outputs.append((level, q4(x4), q8(x8)))
    first, q4_first, q8_first = outputs[0]
    for level, q4_out, q8_out in outputs[1:]:
        assert torch.equal(q4_out, q4_first), f"Q4_1 at {level} differs from {first}"
        assert torch.equal(q8_out, q8_first), f"Q8_0 at {level} differs from {first}"


@pytest.mark.skipif(
    not {"avx2", "avx512_vnni"} <= set(NATIVE_LEVELS), reason="needs AVX-512 VNNI to stand in"
)
def test_the_256_bit_vnni_tiles_give_the_avx2_bits(tmp_path):
    """The avx2_vnni level's tiles (vpdpbusd on 256-bit vectors) in AVX-512 VNNI's VL encoding,
    the same instruction: a build with it and without AVX-512 BW (so without the 512-bit tiles)
    runs them on this host, and they give the avx2 level's outputs to the bit."""
    library = tmp_path / "vnni256.so"
    flags = ["-O3", "-fopenmp", "-fPIC", "-shared", "-march=x86-64-v3", "-mavx512vnni"]
    subprocess.run(
        ["gcc", *flags, "-mavx512vl", "-o", str(library), str(native.SOURCE), "-lm"], check=True
    )
    vnni256 = ctypes.CDLL(str(library))
    for name in ("q4_1_gemm", "q8_0_gemm"):
        getattr(vnni256, name).argtypes = native._SIGNATURES[name]
        getattr(vnni256, name).restype = ctypes.c_int
    generator = torch.Generator().manual_seed(1)
    w4, x4 = (
        torch.randn(70, 608, generator=generator) * 0.05,
        torch.randn(9, 608, generator=generator),
    )
    w8, x8 = torch.randn(300, 160, generator=generator), torch.randn(9, 160, generator=generator)
    with native.using_level("avx2"):
        q4, q8 = NativeQ4Linear.from_float(w4, True), NativeQ8Linear.from_float(w8, True)
        expected4, expected8 = q4(x4), q8(x8)
    got4, got8 = torch.empty_like(expected4), torch.empty_like(expected8)
    assert not vnni256.q4_1_gemm(
        x4.data_ptr(), 9, q4.codes.data_ptr(), q4.scales.data_ptr(), q4.minimums.data_ptr(),
        70, 608, got4.data_ptr(),
    )  # fmt: skip
    assert not vnni256.q8_0_gemm(
        x8.data_ptr(), 9, q8.codes.data_ptr(), q8.scales.data_ptr(), q8.corrections.data_ptr(),
        300, 160, got8.data_ptr(),
    )  # fmt: skip
    assert torch.equal(got4, expected4) and torch.equal(got8, expected8)


def test_kernel_choice():
    assert kernels_for("cpu") is NATIVE_KERNELS
    assert kernels_for("cpu", use_native=False) is TORCH_KERNELS


def test_switched_off_by_the_environment():
    code = "from gpu import native; print(native.load())"
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={"PIPELINE_SERVE_NATIVE": "0", "PATH": ""},
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.strip() == "None"


@pytest.mark.parametrize("arch", ["qwen2", "mistral_swa"])  # qkv bias; sliding window
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_fused_layers_equal_the_per_op_path(cpu_isa, tiny_models, arch, cache_dtype, monkeypatch):
    """Steps of up to max_thin_rows tokens run each layer as native calls: one for a step of
    decodes, two around attention when prefill chunks are in the step."""
    calls = {"whole": 0, "halves": 0}
    whole, first_half = native.q4_decode_layer, native.q4_layer_attn_in

    def count_whole(*args):
        calls["whole"] += 1
        return whole(*args)

    def count_halves(*args):
        calls["halves"] += 1
        return first_half(*args)

    monkeypatch.setattr(native, "q4_decode_layer", count_whole)
    monkeypatch.setattr(native, "q4_layer_attn_in", count_halves)
    from gpu.kv_cache import KVCache
    from gpu.loader import iter_weights
    from gpu.model import CausalLM
    from gpu.quantize import quantize_linears
    from stages.text.checkpoint import load_model_config
    from tests.gpu.paged import BlockPool, PagedSequence, build_step
    from tests.gpu.test_model import run_step

    path = str(tiny_models[arch])
    config = load_model_config(path)
    model = CausalLM(config, NATIVE_KERNELS).eval()
    model.load_weights(iter_weights(path, config, torch.float32))
    quantize_linears(model, "int4", max_thin_rows=48)
    fused = model.fused_layers
    assert fused is not None
    outputs = []
    for use_fused in (True, False):
        model.fused_layers = fused if use_fused else None
        rng = np.random.default_rng(7)
        seqs = [PagedSequence(rng.integers(0, 128, 100).tolist()) for _ in range(3)]
        pool = BlockPool(num_blocks=128, block_size=4, seed=1)
        cache = KVCache(config, num_blocks=128, block_size=4, dtype=cache_dtype)
        schedule = [
            [(0, 20), (1, 20)],  # prefill chunks only
            [(0, 1), (1, 1), (2, 30)],  # decodes beside a prefill chunk
            *[[(0, 1), (1, 1), (2, 1)]] * 6,  # decodes only
            [(2, 1), (0, 60)],  # 61 tokens: above max_thin_rows, the per-op path
        ]
        logits = [
            run_step(model, cache, build_step(pool, [(seqs[i], n) for i, n in step]))
            for step in schedule
        ]
        outputs.append(torch.cat(logits))
        layers = config.num_layers
        expected = {"whole": 6 * layers, "halves": 2 * layers} if use_fused else {}
        assert calls == {"whole": 0, "halves": 0, **expected}
        calls.update(whole=0, halves=0)
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "cache_dtype", "window", "chunk", "context"),
    [
        (9, 3, 64, torch.float32, None, 37, 37),  # a whole prompt, SmolLM2's heads
        (9, 3, 64, torch.bfloat16, None, 70, 101),  # a later chunk: 31 cached tokens before it
        (4, 1, 32, torch.float32, 9, 20, 50),  # sliding window
        (8, 2, 128, torch.float32, None, 3, 64),
    ],
)
def test_paged_prefill_attention_matches_the_reference(
    cpu_isa, heads, kv_heads, dim, cache_dtype, window, chunk, context
):
    block_size, num_blocks = 4, 64
    table = torch.from_numpy(np.random.default_rng(dim).permutation(num_blocks).astype(np.int32))
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim).to(cache_dtype)
    qkv = torch.randn(chunk + 2, (heads + 2 * kv_heads) * dim)  # the chunk is rows 1..chunk
    q = qkv[:, : heads * dim].view(-1, heads, dim)
    out = torch.full((chunk + 2, heads, dim), float("nan"))
    native.paged_prefill_attention(
        q, k_cache, v_cache, 1, chunk + 1, context, table, 0.2, window, out
    )
    expected = reference.paged_attention(
        q[1 : chunk + 1].contiguous(),
        k_cache,
        v_cache,
        table[None, :],
        torch.tensor([0, chunk], dtype=torch.int32),
        torch.tensor([context], dtype=torch.int32),
        0.2,
        window,
    )
    torch.testing.assert_close(out[1 : chunk + 1], expected, rtol=1e-4, atol=1e-5)
    assert out[0].isnan().all() and out[chunk + 1].isnan().all()


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "cache_dtype", "window"),
    [
        (9, 3, 64, torch.bfloat16, None),  # SmolLM2's shape
        (4, 1, 32, torch.float32, 9),  # sliding window
        (6, 2, 24, torch.float32, None),  # head_dim not a multiple of 16
    ],
)
def test_a_prefilled_token_has_the_bits_of_its_decode(
    cpu_isa, heads, kv_heads, dim, cache_dtype, window
):
    """A request's greedy text must not depend on how its tokens were attended: in a whole
    prompt, in chunks split anywhere (chunked prefill, a prefix-cache hit, the recomputation
    after a preemption or a restart), or one at a time as decodes."""
    block_size, num_blocks, context = 4, 16, 45
    table = torch.from_numpy(np.random.default_rng(dim).permutation(num_blocks).astype(np.int32))
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim).to(cache_dtype)
    q = torch.randn(context, heads, dim)

    def prefill(start: int, end: int) -> torch.Tensor:
        out = torch.empty(context, heads, dim)
        native.paged_prefill_attention(
            q, k_cache, v_cache, start, end, end, table, 0.2, window, out
        )
        return out[start:end]

    whole = prefill(0, context)
    for cuts in ([0, 13, 31, context], [0, 1, 2, 40, context]):
        chunks = [prefill(a, b) for a, b in itertools.pairwise(cuts)]
        assert torch.equal(torch.cat(chunks), whole), cuts
    for r in range(context):
        alone = _decoded_alone(q[r], k_cache, v_cache, table, r + 1, 0.2, window)
        assert torch.equal(alone, whole[r]), f"row {r}"
