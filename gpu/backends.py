"""The kernel sets a decoder layer runs besides its linears, behind one interface (`Kernels`):
the torch reference, the native CPU kernels (gpu/native) and the Triton GPU kernels (gpu/kernels),
and `kernels_for`, which picks one for a device."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from gpu import attention as torch_attention
from gpu import native
from gpu.attention import AttentionInputs, StepLayout


def rope_angles(
    positions: torch.Tensor,  # [T] int64
    inv_freq: torch.Tensor,  # [D / 2] float32
) -> tuple[torch.Tensor, torch.Tensor]:  # -> (cos, sin), each [T, D / 2] float32
    """Each position's rotary angles, in float32 as transformers and vLLM compute them: the
    one definition behind a step's cos and sin and the Triton kernel's table of positions."""
    freqs = positions.float().unsqueeze(1) * inv_freq.unsqueeze(0)
    return freqs.cos(), freqs.sin()


class Rope:
    """One step's rotary angles, made at most once for all its layers. The CPU kernels read
    cos and sin [T, D / 2], computed from the positions at the first layer that asks. The Triton
    kernel reads rows of an angle table (cos | sin, [N, D]): the model's table of every position
    where it has one (`CausalLM.set_angle_table`, made once at load as vLLM's cos_sin_cache, so a
    step computes no angle: the positions are the rows), else the step's cos and sin
    concatenated, token t at row t."""

    __slots__ = ("_cos", "_inv_freq", "_positions", "_rows", "_sin", "_table")

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self._cos: torch.Tensor | None = cos  # [T, D // 2] float32
        self._sin: torch.Tensor | None = sin
        self._positions: torch.Tensor | None = None
        self._inv_freq: torch.Tensor | None = None
        self._table: torch.Tensor | None = None
        self._rows: torch.Tensor | None = None

    @classmethod
    def at(
        cls,
        positions: torch.Tensor,  # [T] int64
        inv_freq: torch.Tensor,  # [D / 2] float32
        table: torch.Tensor | None = None,  # [N, D] float32, rows of positions 0 .. N - 1
    ) -> Rope:
        """The angles of these positions, computed when first read."""
        rope = cls.__new__(cls)
        rope._cos = rope._sin = None
        rope._positions, rope._inv_freq = positions, inv_freq
        rope._table, rope._rows = (table, positions) if table is not None else (None, None)
        return rope

    def _angles(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos is None or self._sin is None:
            assert self._positions is not None and self._inv_freq is not None
            self._cos, self._sin = rope_angles(self._positions, self._inv_freq)
        return self._cos, self._sin

    @property
    def cos(self) -> torch.Tensor:
        return self._angles()[0]

    @property
    def sin(self) -> torch.Tensor:
        return self._angles()[1]

    def table(self) -> tuple[torch.Tensor, torch.Tensor]:  # -> ([N, D] float32, [T] int64)
        """The Triton rotary kernel's angle table and the row each token reads."""
        if self._table is None or self._rows is None:
            angles = torch.cat(self._angles(), dim=1)
            self._table, self._rows = angles, torch.arange(len(angles), device=angles.device)
        return self._table, self._rows


@dataclass(slots=True, frozen=True)
class Kernels:
    """What a decoder layer runs besides its linears, one implementation per device kind:
    the torch reference path, the native CPU kernels (gpu/native) or the Triton GPU kernels.

    `prepare` runs once per forward and its result is handed to every layer's
    `rotary_write_kv` (rotates q and k of the fused qkv rows, stores k and v in the paged cache,
    returns q as [T, H, D]) and `paged_attention` (-> [T, H, D]).
    `add_rms_norm(x, residual, w, eps)` returns (rms_norm(x + residual) * w, x + residual) and
    may reuse `residual`'s storage for the sum.
    """

    prepare: Callable[[AttentionInputs], Any]
    rotary_write_kv: Callable[
        [torch.Tensor, Rope, int, int, tuple[torch.Tensor, torch.Tensor], Any], torch.Tensor
    ]
    paged_attention: Callable[
        [torch.Tensor, tuple[torch.Tensor, torch.Tensor], Any, float, int | None], torch.Tensor
    ]
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
    ]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama RMSNorm: normalise in float32, round to x's dtype, then scale."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _torch_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return torch_rms_norm(summed, weight, eps), summed


def _torch_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rotary(
    x: torch.Tensor,  # x: [T, heads, D]
    cos: torch.Tensor,  # cos: [T, 1, D // 2] float32
    sin: torch.Tensor,  # sin: [T, 1, D // 2] float32
) -> torch.Tensor:
    """Rotate-half RoPE (Hugging Face layout: pairs are (i, i + D/2)), in float32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def _split_rotate(
    qkv: torch.Tensor, rope: Rope, num_heads: int, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [T, H, D], k and v [T, KVH, D]
    head_dim = rope.cos.shape[1] * 2
    tokens = qkv.shape[0]
    q, k, v = qkv.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1
    )
    cos, sin = rope.cos.unsqueeze(1), rope.sin.unsqueeze(1)
    q = apply_rotary(q.view(tokens, num_heads, head_dim), cos, sin)
    k = apply_rotary(k.view(tokens, num_kv_heads, head_dim), cos, sin)
    return q, k, v.view(tokens, num_kv_heads, head_dim)


def _torch_rotary_write_kv(
    qkv: torch.Tensor,
    rope: Rope,
    num_heads: int,
    num_kv_heads: int,
    kv: tuple[torch.Tensor, torch.Tensor],
    layout: StepLayout,
) -> torch.Tensor:
    q, k, v = _split_rotate(qkv, rope, num_heads, num_kv_heads)
    slots = layout.inputs.slot_mapping
    torch_attention.write_kv(k, v, *kv, slots, layout.all_slots_valid)
    return q


def _torch_paged_attention(
    q: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    layout: StepLayout,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    return torch_attention.paged_attention(q, kv[0], kv[1], layout, scale, sliding_window)


TORCH_KERNELS = Kernels(
    prepare=StepLayout.of,
    rotary_write_kv=_torch_rotary_write_kv,
    paged_attention=_torch_paged_attention,
    rms_norm=torch_rms_norm,
    add_rms_norm=_torch_add_rms_norm,
    silu_mul=_torch_silu_mul,
)


def _native_ready(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


def _native_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _native_ready(x, weight) and x.dim() == 2:
        return native.rms_norm(x, weight, eps)
    return torch_rms_norm(x, weight, eps)


def _native_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if _native_ready(x, residual, weight) and x.dim() == 2:
        return native.add_rms_norm(residual, x, weight, eps), residual
    return _torch_add_rms_norm(x, residual, weight, eps)


def _native_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if _native_ready(gate_up) and gate_up.dim() == 2:
        return native.silu_mul(gate_up)
    return _torch_silu_mul(gate_up)


def _native_rotary_write_kv(
    qkv: torch.Tensor,
    rope: Rope,
    num_heads: int,
    num_kv_heads: int,
    kv: tuple[torch.Tensor, torch.Tensor],
    layout: StepLayout,
) -> torch.Tensor:
    if not _native_ready(qkv) or kv[0].dtype not in (torch.float32, torch.bfloat16):
        return _torch_rotary_write_kv(qkv, rope, num_heads, num_kv_heads, kv, layout)
    native.rope_write_kv(
        qkv, rope.cos, rope.sin, num_heads, num_kv_heads, layout.inputs.slot_mapping, *kv
    )
    head_dim = rope.cos.shape[1] * 2
    return qkv[:, : num_heads * head_dim].view(qkv.shape[0], num_heads, head_dim)


def _native_paged_attention(
    q: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    layout: StepLayout,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    # Prefill rows are attended as decodes of their positions: a token's attention has the same
    # bits in any chunk, after a prefix-cache hit or a recomputation, and when decoded.
    native_q = q.dtype == torch.float32
    decode = native.paged_decode_attention if native_q else None
    prefill = native.paged_prefill_attention if native_q else None
    return torch_attention.paged_attention(
        q, kv[0], kv[1], layout, scale, sliding_window, decode, prefill
    )


NATIVE_KERNELS = Kernels(
    prepare=StepLayout.of,
    rotary_write_kv=_native_rotary_write_kv,
    paged_attention=_native_paged_attention,
    rms_norm=_native_rms_norm,
    add_rms_norm=_native_add_rms_norm,
    silu_mul=_native_silu_mul,
)


def triton_kernels() -> Kernels:
    """The Triton kernels (CUDA, or CPU tensors under TRITON_INTERPRET=1)."""
    from gpu import kernels

    def rotary_write_kv(
        qkv: torch.Tensor,
        rope: Rope,
        num_heads: int,
        num_kv_heads: int,
        kv: tuple[torch.Tensor, torch.Tensor],
        inputs: AttentionInputs,
    ) -> torch.Tensor:
        head_dim = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
        tokens = qkv.shape[0]
        q, k, v = qkv.split(
            [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1
        )
        q = q.view(tokens, num_heads, head_dim)
        k = k.view(tokens, num_kv_heads, head_dim)
        # The model's angle table and the tokens' positions, or the step's own angles: rotated
        # in place in qkv.
        angles, rows = rope.table()
        kernels.rotary(q, k, rows, angles)
        v = v.view(tokens, num_kv_heads, head_dim)
        scales = getattr(kv, "scales", None)  # an fp8 cache's (gpu/kv_cache.py:LayerKV)
        if getattr(kv, "calculate_scales", False) and tokens > 0:
            kv.set_scales_from(k, v)  # type: ignore[attr-defined]
        kernels.write_kv(k, v, kv[0], kv[1], inputs.slot_mapping, scales)
        return q

    def paged_attention(
        q: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        inputs: AttentionInputs,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        return kernels.paged_attention(
            q,
            kv[0],
            kv[1],
            inputs.block_tables,
            inputs.query_start_loc,
            inputs.context_lens,
            scale,
            sliding_window,
            getattr(kv, "scales", None),
        )

    return Kernels(
        prepare=lambda inputs: inputs,
        rotary_write_kv=rotary_write_kv,
        paged_attention=paged_attention,
        rms_norm=kernels.rms_norm,
        add_rms_norm=kernels.fused_add_rms_norm,
        silu_mul=kernels.silu_mul,
    )


def kernels_name(kernels: Kernels) -> str:
    """What the logs, /version and /metrics call a kernel set: `torch`, `triton`, or the level
    of the native CPU kernels (gpu/cpu_isa.py)."""
    if kernels is TORCH_KERNELS:
        return "torch"
    if kernels is NATIVE_KERNELS:
        return native.kernel_set()
    return "triton"


def kernels_for(device: str | torch.device, use_native: bool | None = None) -> Kernels:
    """Triton on CUDA; on CPU the native kernels where they build (unless `use_native` is
    False), else the torch path."""
    kind = torch.device(device).type
    if kind == "cuda":
        return triton_kernels()
    if kind == "cpu" and use_native is not False and native.available():
        return NATIVE_KERNELS
    return TORCH_KERNELS
