"""The paged KV cache: per layer, K and V pools of fixed-size blocks indexed by block tables."""

from __future__ import annotations

import torch

from stages.text.checkpoint import ModelConfig, kv_block_bytes_for

DEFAULT_BLOCK_SIZE = 16


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
    """`layers[i] = (k_cache, v_cache)`, each [num_blocks, block_size, num_kv_heads, head_dim]."""

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
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(config.num_layers)
        ]

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
