"""Test helper: drive sequences through the paged model step by step, like the scheduler would."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class PagedSequence:
    token_ids: list[int]
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0


class BlockPool:
    """Hands out KV blocks in a shuffled order so that block tables are never contiguous."""

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.block_size = block_size
        self.free = list(np.random.default_rng(seed).permutation(num_blocks))

    def ensure(self, seq: PagedSequence, num_tokens: int) -> None:
        while len(seq.blocks) * self.block_size < num_tokens:
            seq.blocks.append(int(self.free.pop()))


@dataclass
class StepBatch:
    """One step's flattened mixed batch, as numpy arrays (the execute stage's view)."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [B + 1] int32
    context_lens: np.ndarray  # [B] int32
    block_tables: np.ndarray  # [B, max_blocks] int32
    slot_mapping: np.ndarray  # [T] int64


def build_step(pool: BlockPool, chunks: list[tuple[PagedSequence, int]]) -> StepBatch:
    """Schedule `num_new` more tokens of each sequence; they must already be in `token_ids`."""
    ids, positions, slots, starts, lens = [], [], [], [0], []
    for seq, num_new in chunks:
        begin, end = seq.num_cached, seq.num_cached + num_new
        pool.ensure(seq, end)
        for pos in range(begin, end):
            ids.append(seq.token_ids[pos])
            positions.append(pos)
            slots.append(
                seq.blocks[pos // pool.block_size] * pool.block_size + pos % pool.block_size
            )
        seq.num_cached = end
        starts.append(starts[-1] + num_new)
        lens.append(end)
    max_blocks = max(len(seq.blocks) for seq, _ in chunks) + 1
    tables = np.zeros((len(chunks), max_blocks), dtype=np.int32)
    for row, (seq, _) in enumerate(chunks):
        tables[row, : len(seq.blocks)] = seq.blocks
    return StepBatch(
        input_ids=np.asarray(ids, dtype=np.int64),
        positions=np.asarray(positions, dtype=np.int64),
        query_start_loc=np.asarray(starts, dtype=np.int32),
        context_lens=np.asarray(lens, dtype=np.int32),
        block_tables=tables,
        slot_mapping=np.asarray(slots, dtype=np.int64),
    )
