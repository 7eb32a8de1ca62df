"""The paged KV cache: per layer, K and V pools of fixed-size blocks indexed by block tables."""

from __future__ import annotations

import torch

from stages.text.checkpoint import ModelConfig, kv_block_bytes_for

DEFAULT_BLOCK_SIZE = 16
FP8 = torch.float8_e4m3fn
# vLLM's K_SCALE_CONSTANT and V_SCALE_CONSTANT: --calculate-kv-scales sets a layer's scales to
# max |k| / 200 and max |v| / 100 of the first step, leaving e4m3's +-448 room above them.
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0


class LayerKV(tuple[torch.Tensor, torch.Tensor]):
    """One layer's (k_cache, v_cache). An fp8 cache also has `scales`, (k_scale, v_scale) as
    [1] float32 on the device (what is stored times the scale is the value), and
    `calculate_scales`: set, the next step that writes K/V sets the scales from its values."""

    scales: tuple[torch.Tensor, torch.Tensor] | None
    calculate_scales: bool

    def __new__(
        cls,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> LayerKV:
        layer = super().__new__(cls, (k_cache, v_cache))
        layer.scales = scales
        layer.calculate_scales = False
        return layer

    def set_scales_from(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """The scales from this step's K and V (on the device, no sync), once."""
        assert self.scales is not None
        tiny = torch.finfo(torch.float32).tiny
        self.scales[0].copy_((k.abs().amax().float() / K_SCALE_CONSTANT).clamp_min(tiny))
        self.scales[1].copy_((v.abs().amax().float() / V_SCALE_CONSTANT).clamp_min(tiny))
        self.calculate_scales = False


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V together."""
    return kv_block_bytes_for(config, block_size, torch.empty((), dtype=dtype).element_size())


def num_blocks_for_budget(
    config: ModelConfig, kv_cache_bytes: int, block_size: int, dtype: torch.dtype
) -> int:
    num_blocks = kv_cache_bytes // kv_block_bytes(config, block_size, dtype)
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_bytes={kv_cache_bytes} holds no block of {block_size} tokens "
            f"({kv_block_bytes(config, block_size, dtype)} bytes each)"
        )
    return int(num_blocks)


class KVCache:
    """`layers[i] = (k_cache, v_cache)`, each [num_blocks, block_size, num_kv_heads, head_dim]
    (a LayerKV: an fp8 cache's layers carry their scales, 1.0 to begin with)."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.layers: list[LayerKV] = [
            LayerKV(
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
                None
                if dtype != FP8
                else (torch.ones(1, device=device), torch.ones(1, device=device)),
            )
            for _ in range(config.num_layers)
        ]

    def calculate_scales_on_next_write(self) -> None:
        """--calculate-kv-scales: every layer's scales from the next step that writes K/V."""
        for layer in self.layers:
            if layer.scales is None:
                raise ValueError("only an fp8 KV cache has scales to calculate")
            layer.calculate_scales = True

    def copy_blocks(self, pairs: torch.Tensor) -> None:  # pairs: [C, 2] int64 (source, dest)
        """Every layer's K and V of each source block into its destination block."""
        sources, destinations = pairs[:, 0], pairs[:, 1]
        for k_cache, v_cache in self.layers:
            k_cache[destinations] = k_cache[sources]
            v_cache[destinations] = v_cache[sources]

    @classmethod
    def from_budget(
        cls,
        config: ModelConfig,
        kv_cache_bytes: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> KVCache:
        num_blocks = num_blocks_for_budget(config, kv_cache_bytes, block_size, dtype)
        return cls(config, num_blocks, block_size, dtype, device)
