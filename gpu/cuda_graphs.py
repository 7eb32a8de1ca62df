"""CUDA graphs of decode steps: captured at start for the batch sizes a server meets, a step padded
to the next captured size (vLLM's cudagraph capture sizes). A decode step of a big model launches
hundreds of small kernels; replayed as one graph it pays the launch cost once."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch

from gpu.attention import AttentionInputs
from gpu.model import CausalLM


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, then every multiple of 8 up to `max_num_seqs` (vLLM's list), and `max_num_seqs`
    itself, so that every batch the scheduler can plan has a graph."""
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs]
    sizes += range(8, max_num_seqs + 1, 8)
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return tuple(sizes)


def padded_size(batch: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest captured size that holds `batch` rows; None past the largest."""
    at = bisect.bisect_left(sizes, batch)
    return sizes[at] if at < len(sizes) else None


@dataclass(slots=True, frozen=True)
class DecodeRows:
    """One decode step's inputs, one row per sequence (numpy, on the host)."""

    input_ids: np.ndarray  # [N] int64
    positions: np.ndarray  # [N] int64
    slot_mapping: np.ndarray  # [N] int64
    context_lens: np.ndarray  # [N] int32
    block_tables: np.ndarray  # [N, W] int32

    def padded(self, size: int, width: int) -> DecodeRows:
        """`size` rows of `width` block columns. A padding row is token 0 at position 0 that
        writes no KV (slot -1) and attends to one slot of block 0: a real read, so the kernels see
        the shapes they were captured with, and a result nobody takes."""
        rows, columns = self.block_tables.shape
        if rows > size or columns > width:
            raise ValueError(f"a [{rows}, {columns}] step does not fit a [{size}, {width}] graph")
        tables = np.zeros((size, width), np.int32)
        tables[:rows, :columns] = self.block_tables
        return DecodeRows(
            input_ids=_pad(self.input_ids, size, 0, np.int64),
            positions=_pad(self.positions, size, 0, np.int64),
            slot_mapping=_pad(self.slot_mapping, size, -1, np.int64),
            context_lens=_pad(self.context_lens, size, 1, np.int32),
            block_tables=tables,
        )


def _pad(values: np.ndarray, size: int, fill: int, dtype: type) -> np.ndarray:
    out = np.full(size, fill, dtype)
    out[: len(values)] = values
    return out


class DecodeGraphs:
    """One captured graph per size, sharing one memory pool and one set of input buffers."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        sizes: tuple[int, ...],
        max_blocks: int,  # block table columns of a sequence of max_model_len tokens
        device: torch.device,
    ) -> None:
        self.model, self.kv_caches, self.sizes = model, kv_caches, sizes
        self.max_blocks = max_blocks
        n = max(sizes)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=device)
        # Every graph writes its logits here, so that the graphs' outputs take one [N, V] float32
        # (131 MB at 256 rows of Llama 3's vocabulary), not one per size.
        self.logits = torch.empty(n, model.config.vocab_size, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def capture(self) -> None:
        """Largest first (vLLM's order: the smaller graphs reuse the pool the largest made).
        Each size runs twice eagerly first, so that Triton compiles outside the capture."""
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(self.sizes, reverse=True):
            for _ in range(2):
                self._forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[:size].copy_(self._forward(size))
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def fits(self, num_rows: int, block_columns: int) -> bool:
        return padded_size(num_rows, self.sizes) is not None and block_columns <= self.max_blocks

    def run(self, rows: DecodeRows) -> torch.Tensor:  # -> [N, V] float32, on the device
        num_rows = len(rows.input_ids)
        size = padded_size(num_rows, self.sizes)
        if size is None:
            raise ValueError(f"no graph holds {num_rows} rows (largest {self.sizes[-1]})")
        padded = rows.padded(size, self.max_blocks)
        for buffer, values in (
            (self.input_ids, padded.input_ids),
            (self.positions, padded.positions),
            (self.slot_mapping, padded.slot_mapping),
            (self.context_lens, padded.context_lens),
            (self.block_tables, padded.block_tables),
        ):
            buffer[:size].copy_(torch.from_numpy(values), non_blocking=True)
        self.graphs[size].replay()
        return self.logits[:num_rows]

    def _forward(self, size: int) -> torch.Tensor:
        inputs = AttentionInputs(
            query_start_loc=self.query_start_loc[: size + 1],
            context_lens=self.context_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
        )
        return self.model(
            self.input_ids[:size],
            self.positions[:size],
            self.kv_caches,
            inputs,
            self.logits_indices[:size],
        )
