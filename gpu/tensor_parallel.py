"""Megatron-style tensor parallelism of the decoder: each rank keeps its slice of every layer
(column-parallel QKV and gate/up, row-parallel o_proj and down_proj with one all-reduce each)
and of the vocabulary (embedding and LM head); rank 0 gathers the logits."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gpu.loader import GgufRawTensor
from gpu.model import CausalLM
from stages.text.checkpoint import QUANT_BLOCK_WEIGHTS, ModelConfig, shard_shape


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This process's place in a tensor-parallel group (joined by its caller)."""

    rank: int
    world_size: int
    group: Any = None  # a torch.distributed ProcessGroup; None: the default group

    @property
    def samples(self) -> bool:
        """Rank 0 gets the whole logits and samples; the others only compute."""
        return self.rank == 0

    def min_over_ranks(self, value: int, device: torch.device | str) -> int:
        """The least of every rank's `value` (each rank calls this; `device`: where the group's
        backend takes tensors, the rank's CUDA device under NCCL)."""
        tensor = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return int(tensor.item())

    def from_first_rank(self, value: int, device: torch.device | str) -> int:
        """Rank 0's `value`, on every rank (each calls this)."""
        tensor = torch.tensor([value], dtype=torch.int64, device=device)
        dist.broadcast(tensor, group=self.group, group_src=0)
        return int(tensor.item())


class RowParallel(nn.Module):
    """A linear over this rank's slice of its input features: the partial sums of all ranks
    add up to the full output (one all-reduce)."""

    def __init__(self, linear: nn.Module, tp: TensorParallel) -> None:
        super().__init__()
        self.linear = linear
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in / world] -> [T, out]
        out = self.linear(x)
        dist.all_reduce(out, group=self.tp.group)
        return out


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding table; ids outside them give zeros, and the all-reduce
    fills each row from the rank that holds it."""

    def __init__(self, weight: torch.Tensor, start: int, count: int, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [V / world (padded), hidden]
        self.start, self.count, self.tp = start, count, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: [T] int64 -> [T, hidden]
        local = ids - self.start
        outside = (local < 0) | (local >= self.count)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(1), 0.0)
        dist.all_reduce(out, group=self.tp.group)
        return out


class VocabParallelLMHead(nn.Module):
    """This rank's rows of the LM head: each rank scores its vocabulary slice, rank 0 gathers
    them into the whole logits (the other ranks return their slice, which nobody reads)."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = weight  # [V / world (padded), hidden]; the embedding's own when tied
        self.vocab_size, self.tp = vocab_size, tp
        # The slice's scores from another linear over the same rows (quantize_linears puts an
        # 8-bit copy for thin inputs here, as it does for a whole LM head); None: the weight.
        self.local: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [S, hidden] -> [S, V] on rank 0
        scores = F.linear(x, self.weight) if self.local is None else self.local(x)
        local = scores.contiguous()
        if not self.tp.samples:
            dist.gather(local, None, group=self.tp.group, group_dst=0)
            return local
        parts = [torch.empty_like(local) for _ in range(self.tp.world_size)]
        dist.gather(local, parts, group=self.tp.group, group_dst=0)
        return torch.cat(parts, dim=1)[:, : self.vocab_size]


@dataclass(frozen=True, slots=True)
class _Cut:
    """What one rank keeps of the whole model's tensors: shard_model cuts a loaded model by it,
    shard_weights the checkpoint's tensors as they stream in."""

    local: ModelConfig  # the rank's heads, KV heads and MLP columns
    heads: slice  # rows of q_proj, columns of o_proj
    kv_heads: slice  # rows of k_proj and of v_proj
    columns: slice  # rows of gate_proj and of up_proj, columns of down_proj
    vocab_start: int
    vocab_count: int  # rows of the vocabulary the rank holds (the last rank's may be fewer)
    vocab_per_rank: int  # rows of its slice, zero-padded to this
    qkv: list[range]  # rows of the fused [q; k; v]: the rank's query heads and their KV heads
    gate_up: list[range]  # rows of the fused [gate; up]: the rank's MLP columns of each

    @classmethod
    def of(cls, full: ModelConfig, tp: TensorParallel) -> _Cut:
        shard = shard_shape(full, tp.world_size, tp.rank)
        local, d = shard.config, full.head_dim
        per_rank = -(-full.vocab_size // tp.world_size)
        start = tp.rank * per_rank
        heads = slice(shard.first_head * d, shard.first_head * d + local.q_size)
        kv_heads = slice(shard.first_kv_head * d, shard.first_kv_head * d + local.kv_size)
        columns = slice(shard.first_column, shard.first_column + local.intermediate_size)
        return cls(
            local=local,
            heads=heads,
            kv_heads=kv_heads,
            columns=columns,
            vocab_start=start,
            vocab_count=max(0, min(per_rank, full.vocab_size - start)),
            vocab_per_rank=per_rank,
            qkv=[
                _range(heads),
                _range(kv_heads, full.q_size),
                _range(kv_heads, full.q_size + full.kv_size),
            ],
            gate_up=[_range(columns), _range(columns, full.intermediate_size)],
        )

    def vocab(self, weight: torch.Tensor) -> torch.Tensor:  # -> [per_rank, hidden], zero-padded
        out = weight.new_zeros(self.vocab_per_rank, weight.shape[1])
        out[: self.vocab_count] = weight[self.vocab_start : self.vocab_start + self.vocab_count]
        return out


def _range(part: slice, offset: int = 0) -> range:
    return range(offset + part.start, offset + part.stop)


@torch.no_grad()
def shard_model(model: CausalLM, tp: TensorParallel) -> ModelConfig:
    """Keep only this rank's slices of a loaded model, in place; return the rank's shape (what
    its attention and KV cache hold)."""
    full = model.config
    cut = _Cut.of(full, tp)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = _rows(attn.qkv_proj, cut.qkv)
        attn.o_proj = RowParallel(_columns(attn.o_proj, cut.heads), tp)
        attn.config = cut.local
        mlp.gate_up_proj = _rows(mlp.gate_up_proj, cut.gate_up)
        mlp.down_proj = RowParallel(_columns(mlp.down_proj, cut.columns), tp)
    embedding = VocabParallelEmbedding(
        cut.vocab(model.model.embed_tokens.weight), cut.vocab_start, cut.vocab_count, tp
    )
    head_weight = (
        embedding.weight
        if full.tie_word_embeddings
        else nn.Parameter(cut.vocab(model.lm_head.weight), requires_grad=False)
    )
    model.model.embed_tokens = embedding  # type: ignore[assignment]
    model.lm_head = VocabParallelLMHead(head_weight, full.vocab_size, tp)  # type: ignore[assignment]
    return cut.local


def shard_adapter(
    weights: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
    full: ModelConfig,
    tp: TensorParallel,
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """A LoRA adapter in the slot layout (gpu/lora.py: per (layer, fused projection) `a`
    [in, P * R] and `b` [P * R, out]) cut as shard_model cuts the projections it adds to: a
    column-parallel projection (qkv, gate_up) keeps A whole and the rank's output columns of B;
    a row-parallel one (o, down) the rank's input rows of A and B whole. Each rank's update to
    a row-parallel projection is then a partial sum too, B (x_k A_k), added before its
    all-reduce: the sum over ranks is B (x A), as for the weights."""
    cut = _Cut.of(full, tp)
    qkv, gate_up = _index(cut.qkv), _index(cut.gate_up)
    out = {}
    for (layer, fused), (a, b) in weights.items():
        if fused == "qkv_proj":
            b = b.index_select(1, qkv)
        elif fused == "gate_up_proj":
            b = b.index_select(1, gate_up)
        elif fused == "o_proj":
            a = a[cut.heads]
        elif fused == "down_proj":
            a = a[cut.columns]
        out[(layer, fused)] = (a.contiguous(), b.contiguous())
    return out


def _index(rows: list[range]) -> torch.Tensor:
    return torch.tensor([i for r in rows for i in r], dtype=torch.int64)


def shard_weights(
    weights: Iterable[tuple[str, torch.Tensor]], full: ModelConfig, tp: TensorParallel
) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's Hugging Face-named tensors cut to this rank's share as they stream by,
    under the names of a model shard_model has cut (row-parallel weights sit in `.linear`), so
    that a rank loads its shard holding at most one whole tensor besides it."""
    cut = _Cut.of(full, tp)
    for name, tensor in weights:
        parts = name.split(".")
        module = parts[-2] if len(parts) >= 2 else ""
        if module == "q_proj":
            yield name, tensor[cut.heads]
        elif module in ("k_proj", "v_proj"):
            yield name, tensor[cut.kv_heads]
        elif module in ("gate_proj", "up_proj"):
            yield name, tensor[cut.columns]
        elif module == "o_proj" and name.endswith(".weight"):
            yield name.replace(".o_proj.", ".o_proj.linear."), tensor[:, cut.heads]
        elif module == "down_proj" and name.endswith(".weight"):
            yield name.replace(".down_proj.", ".down_proj.linear."), tensor[:, cut.columns]
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            yield name, cut.vocab(tensor)
        else:  # norms: every rank's whole
            yield name, tensor


def shard_raw_blocks(
    raw: Mapping[str, GgufRawTensor], full: ModelConfig, tp: TensorParallel
) -> dict[str, GgufRawTensor]:
    """A GGUF file's quantized matrices (by Hugging Face name) cut as shard_weights cuts the
    float tensors: whole rows of blocks for q/k/v, gate/up and the vocabulary (zero blocks
    pad the last rank's), whole blocks of every row for o_proj and down_proj (their input
    slices fall on blocks: stages.text.checkpoint.quantized_shard_problem). Lossless: a rank quantizes nothing anew."""
    cut = _Cut.of(full, tp)
    out = {}
    for name, tensor in raw.items():
        parts = name.split(".")
        module = parts[-2] if len(parts) >= 2 else ""
        per_block = tensor.blocks.shape[1] // (tensor.shape[1] // QUANT_BLOCK_WEIGHTS)  # bytes
        if module == "q_proj":
            blocks = tensor.blocks[cut.heads]
        elif module in ("k_proj", "v_proj"):
            blocks = tensor.blocks[cut.kv_heads]
        elif module in ("gate_proj", "up_proj"):
            blocks = tensor.blocks[cut.columns]
        elif module in ("o_proj", "down_proj"):
            part = cut.heads if module == "o_proj" else cut.columns
            first, end = part.start // QUANT_BLOCK_WEIGHTS, part.stop // QUANT_BLOCK_WEIGHTS
            blocks = tensor.blocks[:, first * per_block : end * per_block]
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            blocks = np.zeros((cut.vocab_per_rank, tensor.blocks.shape[1]), np.uint8)
            blocks[: cut.vocab_count] = tensor.blocks[
                cut.vocab_start : cut.vocab_start + cut.vocab_count
            ]
        else:
            continue  # nothing else is quantized
        blocks = np.ascontiguousarray(blocks)
        shape = (len(blocks), blocks.shape[1] // per_block * QUANT_BLOCK_WEIGHTS)
        out[name] = GgufRawTensor(blocks, shape, tensor.ggml_type)
    return out


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An nn.Linear holding copies of these tensors (built on meta: no throwaway init)."""
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    out.weight = nn.Parameter(weight.clone(), requires_grad=False)
    if bias is not None:
        out.bias = nn.Parameter(bias.clone(), requires_grad=False)
    return out


def _rows(linear: nn.Module, rows: list[range]) -> nn.Linear:
    """A linear of the given output rows of `linear` (its bias too)."""
    index = _index(rows)
    bias = None if linear.bias is None else linear.bias.index_select(0, index)
    return _linear(linear.weight.index_select(0, index), bias)


def _columns(linear: nn.Module, part: slice) -> nn.Linear:
    """A bias-free linear of the given input columns of `linear`."""
    return _linear(linear.weight[:, part].contiguous(), None)
