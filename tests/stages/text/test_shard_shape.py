"""A tensor-parallel rank's share of a model: whole GQA groups spread evenly, one KV head
replicated when they are fewer than the ranks, and a clear refusal where neither fits."""

from __future__ import annotations

import dataclasses

import pytest

from stages.text.checkpoint import (
    ModelConfig,
    UnsupportedModelError,
    cache_shape,
    shard_shape,
)

SMOLLM2 = ModelConfig(
    architecture="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    rope_scaling=None,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    attention_bias=False,
)


def shares(config: ModelConfig, world: int) -> list[tuple[int, int, int, int, int]]:
    """Per rank: (first head, heads, first KV head, KV heads, MLP columns)."""
    out = []
    for rank in range(world):
        s = shard_shape(config, world, rank)
        c = s.config
        out.append(
            (s.first_head, c.num_heads, s.first_kv_head, c.num_kv_heads, c.intermediate_size)
        )
    return out


def test_smollm2_on_two_ranks_splits_its_three_groups_one_and_two():
    assert shares(SMOLLM2, 2) == [(0, 3, 0, 1, 768), (3, 6, 1, 2, 768)]
    assert cache_shape(SMOLLM2, 2).num_kv_heads == 2  # blocks sized by the larger share
    assert shard_shape(SMOLLM2, 1, 0).config == SMOLLM2


def test_fewer_kv_heads_than_ranks_replicate_one_per_rank():
    one_kv = dataclasses.replace(SMOLLM2, num_heads=8, num_kv_heads=2, intermediate_size=1537)
    assert shares(one_kv, 4) == [
        (0, 2, 0, 1, 384),
        (2, 2, 0, 1, 384),
        (4, 2, 1, 1, 384),
        (6, 2, 1, 1, 385),
    ]


def test_a_split_that_fits_no_group_is_refused_by_name():
    with pytest.raises(UnsupportedModelError, match="--tensor-parallel-size 4 with 3 KV heads"):
        shard_shape(SMOLLM2, 4, 0)
