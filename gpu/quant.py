"""Weight-only quantized linears for the CPU path: per-channel int8 and group-wise int4.

Both run on torch's packed CPU kernels. GGUF Q4_1 blocks map onto Int4Linear without loss;
GGUF Q8_0 blocks are requantized per channel into Int8Linear (lossy, see `Int8Linear.from_q8_0`).

Kernel contracts, checked against torch 2.13 (tests/gpu/test_quant.py holds them):
* `torch._weight_int8pack_mm(x [M, K], w [N, K] int8, scales [N])` returns x @ (w * scales).T;
  x is float32, float16 or bfloat16 and `scales` must have x's dtype.
* `torch._convert_weight_to_int4pack_for_cpu(q [N, K] int32 in 0..15, 1)` packs codes into an
  opaque [N, K / 2] uint8 layout, and `torch._weight_int4pack_mm_for_cpu(x [M, K], packed,
  group_size, scale_and_zeros [K / group_size, N, 2])` returns x @ W.T with
  W[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n], g = k // group_size; scale is [..., 0] and
  zero (a float offset) is [..., 1]; scale_and_zeros must have x's dtype.

Layers compute in bfloat16 by default (inputs are cast, outputs cast back): on this CPU torch's
float32 int8/int4 kernels are 10-50x slower than float32 nn.Linear, the bfloat16 ones up to 5x
faster at decode batch sizes. Pass compute_dtype=torch.float32 for exact (slow) results.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gpu import native

Q4_1_BLOCK_WEIGHTS = 32
Q4_1_BLOCK_BYTES = 20  # f16 d, f16 m, 16 bytes of nibbles
Q8_0_BLOCK_WEIGHTS = 32
Q8_0_BLOCK_BYTES = 34  # f16 d, 32 int8


def _as_rows(x: torch.Tensor, in_features: int) -> torch.Tensor:  # [..., K] -> [M, K]
    if x.shape[-1] != in_features:
        raise ValueError(f"expected inputs with {in_features} features, got {tuple(x.shape)}")
    return x.reshape(-1, in_features)


def _f16_field(blocks: np.ndarray, start: int) -> np.ndarray:
    """The little-endian float16 at bytes [start, start + 2) of each block, as float32."""
    return (
        np.ascontiguousarray(blocks[..., start : start + 2])
        .view(np.float16)[..., 0]
        .astype(np.float32)
    )


def _blocks(
    raw_blocks: np.ndarray,
    out_features: int,
    in_features: int,
    block_weights: int,
    block_bytes: int,
) -> np.ndarray:  # [N, K / block_weights, block_bytes] uint8
    if in_features % block_weights != 0:
        raise ValueError(f"in_features {in_features} is not a multiple of {block_weights}")
    blocks_per_row = in_features // block_weights
    raw = np.asarray(raw_blocks, dtype=np.uint8)
    expected = out_features * blocks_per_row * block_bytes
    if raw.size != expected:
        raise ValueError(
            f"{raw.size} bytes do not hold a [{out_features}, {in_features}] tensor "
            f"({expected} bytes of {block_bytes}-byte blocks)"
        )
    return raw.reshape(out_features, blocks_per_row, block_bytes)


class Int8Linear(nn.Module):
    """y = x @ (w_int8 * scales).T, one symmetric scale per output channel."""

    def __init__(
        self,
        weight_int8: torch.Tensor,  # [N, K] int8
        scales: torch.Tensor,  # [N] float
        compute_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        if weight_int8.dtype != torch.int8 or scales.shape != (weight_int8.shape[0],):
            raise ValueError("Int8Linear needs int8 weights [N, K] and one scale per row [N]")
        self.out_features, self.in_features = weight_int8.shape
        self.compute_dtype = compute_dtype
        self.register_buffer("weight_int8", weight_int8.contiguous())
        self.register_buffer("scales", scales.to(compute_dtype).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N] in x's dtype
        rows = _as_rows(x, self.in_features).to(self.compute_dtype)
        out = torch._weight_int8pack_mm(rows, self.weight_int8, self.scales)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, compute_dtype: torch.dtype = torch.bfloat16
    ) -> Int8Linear:  # weight: [N, K]
        weight_f32 = weight.float()
        scales = weight_f32.abs().amax(dim=1) / 127.0
        inverse = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
        codes = torch.round(weight_f32 * inverse[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(codes, scales, compute_dtype)

    @classmethod
    def from_q8_0(
        cls,
        raw_blocks: np.ndarray,  # uint8, out_features * in_features / 32 blocks of 34 bytes
        out_features: int,
        in_features: int,
        compute_dtype: torch.dtype = torch.bfloat16,
    ) -> Int8Linear:
        """Dequantize GGUF Q8_0 and requantize per output channel.

        Not lossless: Q8_0 has one scale per 32 weights and this kernel one per row, so each
        weight moves by up to half a per-row step (row max / 254). Keep Q8_0 tensors in float
        where that matters.
        """
        blocks = _blocks(
            raw_blocks, out_features, in_features, Q8_0_BLOCK_WEIGHTS, Q8_0_BLOCK_BYTES
        )
        scales = _f16_field(blocks, 0)  # [N, K / 32]
        codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).astype(np.float32)
        weight = (codes * scales[..., None]).reshape(out_features, in_features)
        return cls.from_float(torch.from_numpy(weight), compute_dtype)


class Int4Linear(nn.Module):
    """y = x @ W.T with W = (q - 8) * scale + zero, q in 0..15, one (scale, zero) per group."""

    def __init__(
        self,
        packed: torch.Tensor,  # [N, K / 2] uint8, from _convert_weight_to_int4pack_for_cpu
        scale_and_zeros: torch.Tensor,  # [K / group_size, N, 2] float: scale, zero
        in_features: int,
        group_size: int,
        compute_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        self.out_features = packed.shape[0]
        self.in_features = in_features
        self.group_size = group_size
        self.compute_dtype = compute_dtype
        expected = (in_features // group_size, self.out_features, 2)
        if in_features % group_size != 0 or scale_and_zeros.shape != expected:
            raise ValueError(
                f"scale_and_zeros {tuple(scale_and_zeros.shape)} is not {expected} "
                f"for in_features {in_features}, group_size {group_size}"
            )
        self.register_buffer("packed", packed)
        self.register_buffer("scale_and_zeros", scale_and_zeros.to(compute_dtype).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N] in x's dtype
        rows = _as_rows(x, self.in_features).to(self.compute_dtype)
        out = torch._weight_int4pack_mm_for_cpu(
            rows, self.packed, self.group_size, self.scale_and_zeros
        )
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,  # [N, K] integers in 0..15
        scales: torch.Tensor,  # [N, K / group_size] float
        zeros: torch.Tensor,  # [N, K / group_size] float: the weight where q == 8
        group_size: int,
        compute_dtype: torch.dtype = torch.bfloat16,
    ) -> Int4Linear:
        in_features = codes.shape[1]
        packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        scale_and_zeros = torch.stack([scales.float().T, zeros.float().T], dim=-1)
        return cls(packed, scale_and_zeros, in_features, group_size, compute_dtype)

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,  # [N, K]
        group_size: int = 32,
        compute_dtype: torch.dtype = torch.bfloat16,
    ) -> Int4Linear:
        """Asymmetric min/max quantization of each group of `group_size` weights to 16 levels."""
        out_features, in_features = weight.shape
        if in_features % group_size != 0:
            raise ValueError(f"in_features {in_features} is not a multiple of {group_size}")
        groups = weight.float().reshape(out_features, in_features // group_size, group_size)
        low = groups.amin(dim=-1)
        scales = (groups.amax(dim=-1) - low) / 15.0
        inverse = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
        codes = torch.round((groups - low[..., None]) * inverse[..., None]).clamp(0, 15)
        zeros = low + 8.0 * scales
        return cls.from_codes(
            codes.reshape(out_features, in_features), scales, zeros, group_size, compute_dtype
        )

    @classmethod
    def from_q4_1(
        cls,
        raw_blocks: np.ndarray,  # uint8, out_features * in_features / 32 blocks of 20 bytes
        out_features: int,
        in_features: int,
        compute_dtype: torch.dtype = torch.bfloat16,
    ) -> Int4Linear:
        """Map GGUF Q4_1 blocks (w = d * q + m) onto group-32 int4 without dequantizing.

        (q - 8) * d + (m + 8 * d) == d * q + m, so the 4-bit codes carry over unchanged with
        scale = d and zero = m + 8 * d. With float32 compute that is exact up to float32
        rounding; bfloat16 compute rounds d and the zero to bfloat16.
        """
        blocks = _blocks(
            raw_blocks, out_features, in_features, Q4_1_BLOCK_WEIGHTS, Q4_1_BLOCK_BYTES
        )
        scales = _f16_field(blocks, 0)  # d: [N, K / 32]
        minimums = _f16_field(blocks, 2)  # m: [N, K / 32]
        nibbles = blocks[..., 4:]  # [N, K / 32, 16]: weight i in the low nibble, i + 16 in the high
        codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(
            out_features, in_features
        )
        return cls.from_codes(
            torch.from_numpy(codes.astype(np.int32)),
            torch.from_numpy(scales),
            torch.from_numpy(minimums + 8.0 * scales),
            Q4_1_BLOCK_WEIGHTS,
            compute_dtype,
        )


def dense_cpu_dtype() -> torch.dtype:
    """The dtype of dense CPU matmuls for compute-bound inputs: bfloat16 where the CPU multiplies
    it natively (AVX-512 BF16, AMX), float32 elsewhere. On an AVX2-only EPYC a [204, 576] x
    [576, 1536] matmul took 19.2 ms in bfloat16 (converted in software) and 2.3 ms in float32."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        flags = []
    return torch.bfloat16 if {"avx512_bf16", "amx_bf16"} & set(flags) else torch.float32


class ThinThickLinear(nn.Module):
    """A weight-only quantized linear for thin inputs, a dense one for thick inputs.

    The quantized kernels read a quarter to a half of the bytes, which wins while a matmul is
    bound by memory (decode: a few rows); once it is bound by compute (prefill chunks, large
    decode batches) a dense matmul is about twice as fast. llama.cpp switches kernels the same way.
    """

    def __init__(
        self,
        quantized: nn.Module,
        weight: torch.Tensor,
        max_thin_rows: int = 8,
        dense_dtype: torch.dtype | None = None,  # None: dense_cpu_dtype()
    ) -> None:
        super().__init__()
        self.quantized = quantized
        self.max_thin_rows = max_thin_rows
        dtype = dense_dtype or dense_cpu_dtype()
        self.register_buffer("dense_weight", weight.detach().to(dtype).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., K] -> [..., N] in x's dtype
        rows = x.numel() // x.shape[-1]
        if rows <= self.max_thin_rows:
            return self.quantized(x)
        return F.linear(x.to(self.dense_weight.dtype), self.dense_weight).to(x.dtype)


class NativeQ4Linear(nn.Module):
    """GGUF Q4_1 weights (w = d * q + m, per 32) on the native CPU kernels (gpu/native).

    The activations are quantized per 32 to int8 on the way in, as llama.cpp does, and the dot
    products run on integer SIMD: about a quarter of the bytes of bf16 and no dequantized copy.
    The codes are stored in the layout of this build's kernel: 16 output channels per vector
    with AVX2 and up (`native.q4_1_gemm_pack`), row by row in the portable build
    (`native.q4_1_pack`).
    """

    def __init__(
        self,
        nibbles: torch.Tensor,  # [N, K / 32, 16] uint8, GGUF's: weight i low nibble, i + 16 high
        scales: torch.Tensor,  # [N, K / 32]: d, kept in float16 as GGUF stores it
        minimums: torch.Tensor,  # [N, K / 32]: m, float16
        many_rows: bool | None = None,  # the layout; None: the build's (the only one it fuses)
    ) -> None:
        super().__init__()
        self.out_features = nibbles.shape[0]
        self.in_features = nibbles.shape[1] * Q4_1_BLOCK_WEIGHTS
        nibbles, scales, minimums = (
            nibbles.contiguous(),
            scales.half().contiguous(),
            minimums.half().contiguous(),
        )
        if many_rows and not native.gemm_available():
            raise ValueError("the many-row Q4_1 kernel needs AVX2 (this build is portable)")
        self.many_rows = native.gemm_available() if many_rows is None else many_rows
        if self.many_rows:
            codes, scales, minimums = native.q4_1_gemm_pack(nibbles, scales, minimums)
        else:
            codes = native.q4_1_pack(nibbles)
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.register_buffer("minimums", minimums)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N] in x's dtype
        rows = _as_rows(x, self.in_features).float().contiguous()
        if self.many_rows:
            out = native.q4_1_gemm(rows, self.codes, self.scales, self.minimums, self.out_features)
        else:
            out = native.q4_1_matmul(rows, self.codes, self.scales, self.minimums)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    @classmethod
    def from_q4_1(
        cls,
        raw_blocks: np.ndarray,
        out_features: int,
        in_features: int,
        many_rows: bool | None = None,
    ) -> NativeQ4Linear:
        """The GGUF blocks as they are (lossless)."""
        blocks = _blocks(
            raw_blocks, out_features, in_features, Q4_1_BLOCK_WEIGHTS, Q4_1_BLOCK_BYTES
        )
        halves = np.ascontiguousarray(blocks[..., :4]).view(np.float16)  # [N, K / 32, 2]: d, m
        return cls(
            torch.from_numpy(np.ascontiguousarray(blocks[..., 4:])),
            torch.from_numpy(np.ascontiguousarray(halves[..., 0])),
            torch.from_numpy(np.ascontiguousarray(halves[..., 1])),
            many_rows,
        )

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, many_rows: bool | None = None
    ) -> NativeQ4Linear:  # weight: [N, K]
        """Asymmetric min/max quantization of each 32 weights to 16 levels (Q4_1, scale and
        minimum in float16 as llama.cpp stores them)."""
        out_features, in_features = weight.shape
        if in_features % Q4_1_BLOCK_WEIGHTS:
            raise ValueError(f"in_features {in_features} is not a multiple of 32")
        groups = weight.float().reshape(out_features, -1, Q4_1_BLOCK_WEIGHTS)
        low = groups.amin(dim=-1).half().float()
        scales = ((groups.amax(dim=-1) - low) / 15.0).half().float()
        inverse = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
        codes = torch.round((groups - low[..., None]) * inverse[..., None]).clamp(0, 15)
        codes = codes.to(torch.uint8)
        nibbles = codes[..., :16] | (codes[..., 16:] << 4)
        return cls(nibbles, scales, low, many_rows)


class NativeQ8Linear(nn.Module):
    """GGUF Q8_0 weights (w = d * q, per 32) on the native CPU kernels; the LM head's format.

    Stored like NativeQ4Linear: 16 output channels per vector with AVX2 and up
    (`native.q8_0_gemm_pack`), row by row otherwise.
    """

    def __init__(
        self,
        codes: torch.Tensor,  # [N, K] int8
        scales: torch.Tensor,  # [N, K / 32]: d, float16 as GGUF stores it
        many_rows: bool | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        codes, scales = codes.contiguous(), scales.half().contiguous()
        if many_rows and not native.gemm_available():
            raise ValueError("the many-row Q8_0 kernel needs AVX2 (this build is portable)")
        self.many_rows = native.gemm_available() if many_rows is None else many_rows
        self.register_buffer("corrections", None)
        if self.many_rows:
            codes, scales, self.corrections = native.q8_0_gemm_pack(codes, scales)
        else:
            scales = scales.float()
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N] in x's dtype
        rows = _as_rows(x, self.in_features).float().contiguous()
        if self.many_rows:
            out = native.q8_0_gemm(
                rows, self.codes, self.scales, self.corrections, self.out_features
            )
        else:
            out = native.q8_0_matmul(rows, self.codes, self.scales)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    @classmethod
    def from_q8_0(
        cls,
        raw_blocks: np.ndarray,
        out_features: int,
        in_features: int,
        many_rows: bool | None = None,
    ) -> NativeQ8Linear:
        """The GGUF blocks as they are (lossless)."""
        blocks = _blocks(
            raw_blocks, out_features, in_features, Q8_0_BLOCK_WEIGHTS, Q8_0_BLOCK_BYTES
        )
        codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(out_features, -1)
        d = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]
        return cls(torch.from_numpy(codes), torch.from_numpy(np.ascontiguousarray(d)), many_rows)

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, many_rows: bool | None = None
    ) -> NativeQ8Linear:  # weight: [N, K]
        """Symmetric quantization of each 32 weights to -127..127 (Q8_0, float16 scales)."""
        out_features, in_features = weight.shape
        if in_features % Q8_0_BLOCK_WEIGHTS:
            raise ValueError(f"in_features {in_features} is not a multiple of 32")
        groups = weight.float().reshape(out_features, -1, Q8_0_BLOCK_WEIGHTS)
        scales = (groups.abs().amax(dim=-1) / 127.0).half().float()
        inverse = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
        codes = torch.round(groups * inverse[..., None]).clamp(-127, 127).to(torch.int8)
        return cls(codes.reshape(out_features, in_features), scales, many_rows)


class WithBias(nn.Module):
    """A bias-free quantized linear plus the float bias of the layer it replaced (Qwen2 qkv)."""

    def __init__(self, linear: nn.Module, bias: torch.Tensor) -> None:
        super().__init__()
        self.linear = linear
        self.register_buffer("bias", bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, K]
        return self.linear(x) + self.bias
