"""LoRA adapters in the model: --max-loras slots of stacked adapter weights per projection, a
host-memory LRU of loaded adapters (--max-cpu-loras), and the batched low-rank update that adds
each row's adapter to a projection's output, every adapter and the base in one step (Punica)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import structlog
import torch
from torch import nn

from gpu.model import CausalLM
from gpu.native import LORA_TILE
from gpu.tensor_parallel import RowParallel, TensorParallel, shard_adapter
from stages.lora import ADAPTER_WEIGHTS, LoraConfig, module_shape, read_adapter
from stages.text.checkpoint import ModelConfig, shard_shape

log = structlog.get_logger(__name__)

# Each fused projection of the model, its parent module and the Hugging Face projections stacked
# along its output (gpu/model.py fuses q, k, v and gate, up).
PROJECTIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "o_proj": ("self_attn", ("o_proj",)),
    "gate_up_proj": ("mlp", ("gate_proj", "up_proj")),
    "down_proj": ("mlp", ("down_proj",)),
}


@dataclass(slots=True, frozen=True)
class AdapterWeights:
    """One adapter in the slot layout, in host memory: per (layer, fused projection) with parts
    P, `a` [in, P * R] (part j's A transposed in columns j*R.., zero past its rank) and `b`
    [P * R, out] (part j's B transposed, times the scaling, in its output columns); R is
    --max-lora-rank. A projection the adapter leaves alone is absent (zeros)."""

    lora_id: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def load_adapter(
    lora_id: int, path: str, model: ModelConfig, max_rank: int, dtype: torch.dtype
) -> AdapterWeights:
    """Read a PEFT adapter directory (checked again: the files may have changed since the server
    checked them) into the slot layout."""
    from safetensors.torch import load_file

    spec = read_adapter(path, model, max_rank)
    tensors = load_file(f"{path}/{ADAPTER_WEIGHTS}")
    prefix = "base_model.model.model.layers"
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for layer in sorted(spec.layers):
        for fused, (parent, parts) in PROJECTIONS.items():
            found = [
                (j, part)
                for j, part in enumerate(parts)
                if f"{prefix}.{layer}.{parent}.{part}.lora_A.weight" in tensors
            ]
            if not found:
                continue
            a, b = _zeros(model, fused, max_rank, dtype)
            out_at = 0
            for j, part in enumerate(parts):
                out_features, _ = module_shape(model, part)
                if (j, part) in found:
                    name = f"{prefix}.{layer}.{parent}.{part}"
                    lora_a = tensors[f"{name}.lora_A.weight"].float()  # [r, in]
                    lora_b = tensors[f"{name}.lora_B.weight"].float()  # [out, r]
                    r = lora_a.shape[0]
                    cols = slice(j * max_rank, j * max_rank + r)
                    a[:, cols] = lora_a.t().to(dtype)
                    b[cols, out_at : out_at + out_features] = (lora_b.t() * spec.scaling).to(dtype)
                out_at += out_features
            weights[(layer, fused)] = (a, b)
    return AdapterWeights(lora_id, weights)


def _zeros(
    model: ModelConfig, fused: str, max_rank: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:  # -> ([in, P * R], [P * R, out])
    parts = PROJECTIONS[fused][1]
    _, in_features = module_shape(model, parts[0])
    out_features = sum(module_shape(model, part)[0] for part in parts)
    width = len(parts) * max_rank
    return torch.zeros(in_features, width, dtype=dtype), torch.zeros(
        width, out_features, dtype=dtype
    )


@dataclass(slots=True, frozen=True)
class LoraStep:
    """One step's adapter rows grouped by slot, for batched matmuls over slots 0..span-1: group
    s is `rows[s * per_slot:(s + 1) * per_slot]`, the tokens of slot s and then padding (row 0,
    whose update `valid` zeroes). Base rows are in no group."""

    span: int  # slots 0..span-1 hold the step's adapters (placed lowest first)
    per_slot: int  # the most tokens any slot has in this step
    rows: torch.Tensor  # [span * per_slot] int64, token rows
    valid: torch.Tensor  # [span, per_slot, 1] in the model's dtype: 1 for a token, 0 for padding
    # The same rows for the fused C layers (gpu/fused.py), without padding: each adapter row and
    # its slot, grouped by slot, and tiles of up to LORA_TILE rows of one slot (each tile's first
    # index into them, then their count).
    adapter_rows: torch.Tensor  # [A] int64
    adapter_slots: torch.Tensor  # [A] int64
    adapter_tiles: torch.Tensor  # [tiles + 1] int64

    @classmethod
    def of(
        cls, token_slots: np.ndarray, span: int, dtype: torch.dtype, device: torch.device
    ) -> LoraStep:
        """`token_slots` [T] int64: each token's slot, -1 for the base model."""
        adapted = np.nonzero(token_slots >= 0)[0]
        slots = token_slots[adapted]
        order = np.argsort(slots, kind="stable")
        counts = np.bincount(slots, minlength=span)
        per_slot = int(counts.max())
        # Each token's place in its group: its rank among the slot's tokens.
        starts = np.cumsum(counts) - counts
        place = np.arange(len(order)) - np.repeat(starts, counts)
        rows = np.zeros((span, per_slot), np.int64)
        valid = np.zeros((span, per_slot), np.float32)
        rows[slots[order], place] = adapted[order]
        valid[slots[order], place] = 1.0
        return cls(
            span,
            per_slot,
            torch.from_numpy(rows.ravel()).to(device),
            torch.from_numpy(valid).to(device=device, dtype=dtype).unsqueeze(2),
            torch.from_numpy(adapted[order]),
            torch.from_numpy(slots[order]),
            torch.from_numpy(np.append(np.nonzero(place % LORA_TILE == 0)[0], len(order))),
        )


class LoraSlots:
    """The adapters the model can apply in a step: per (layer, fused projection) every slot's A
    transposed and B, `a` [L, P * R, in] and `b` [L, P * R, out], L = --max-loras (A's rows are
    contiguous for the fused C layers' dot products). An adapter a step needs and
    no slot holds is copied into the least recently used slot the step does not need, from the
    host-memory LRU (--max-cpu-loras) or, the first time, from its directory."""

    def __init__(
        self,
        model: ModelConfig,  # the whole model's
        config: LoraConfig,
        dtype: torch.dtype,
        device: torch.device,
        tensor_parallel: TensorParallel | None = None,  # slots of this rank's shard (cut adapters)
    ) -> None:
        self.model_config = model
        self.config = config
        self.dtype = dtype
        self.rank = config.max_lora_rank
        self.tensor_parallel = tensor_parallel
        local = (
            model
            if tensor_parallel is None
            else shard_shape(model, tensor_parallel.world_size, tensor_parallel.rank).config
        )
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        slots = config.max_loras
        for layer in range(model.num_layers):
            for fused in PROJECTIONS:
                a, b = _zeros(local, fused, self.rank, dtype)
                key = (layer, fused)
                self.a[key] = a.t().to(device).unsqueeze(0).repeat(slots, 1, 1)
                self.b[key] = b.to(device).unsqueeze(0).repeat(slots, 1, 1)
        self.device = device
        self.slot_of: dict[int, int] = {}  # adapter id -> slot
        self.used_at = [0] * config.max_loras  # per slot, the step that last used it
        self.host: OrderedDict[int, AdapterWeights] = OrderedDict()  # least recently used first
        self.step: LoraStep | None = None  # set for the forward of a step with adapter rows
        self._steps = 0

    def begin(
        self,
        token_lora_ids: np.ndarray,  # [T] int64, each token's adapter id; 0: the base model
        paths: Mapping[int, str],  # the path of each adapter id in the step
    ) -> None:
        """Make the step's adapters resident and group its rows by slot; a step of base rows
        only leaves `step` None, and the model runs as without adapters."""
        self._steps += 1
        wanted = sorted(set(np.unique(token_lora_ids).tolist()) - {0})
        if not wanted:
            self.step = None
            return
        if len(wanted) > self.config.max_loras:
            raise RuntimeError(
                f"a step mixes {len(wanted)} adapters; --max-loras is {self.config.max_loras}"
            )
        for lora_id in wanted:
            if lora_id not in self.slot_of:
                self._place(lora_id, paths[lora_id], keep=set(wanted))
            self.used_at[self.slot_of[lora_id]] = self._steps
            if lora_id in self.host:  # recently used: the last to leave host memory
                self.host.move_to_end(lora_id)
        slot_by_id = np.full(max(wanted) + 1, -1, np.int64)
        for lora_id in wanted:
            slot_by_id[lora_id] = self.slot_of[lora_id]
        span = max(self.slot_of[i] for i in wanted) + 1
        self.step = LoraStep.of(slot_by_id[token_lora_ids], span, self.dtype, self.device)

    def end(self) -> None:
        self.step = None

    def _place(self, lora_id: int, path: str, keep: set[int]) -> None:
        weights = self._host_copy(lora_id, path)
        free = [s for s in range(self.config.max_loras) if s not in self.slot_of.values()]
        if free:
            slot = free[0]  # the lowest, so that a step's slots span few
        else:
            evictable = [(self.used_at[s], s) for i, s in self.slot_of.items() if i not in keep]
            slot = min(evictable)[1]
            del self.slot_of[next(i for i, s in self.slot_of.items() if s == slot)]
        for key, a in self.a.items():
            pair = weights.weights.get(key)
            if pair is None:
                a[slot].zero_()
                self.b[key][slot].zero_()
            else:
                a[slot].copy_(pair[0].t())
                self.b[key][slot].copy_(pair[1])
        self.slot_of[lora_id] = slot
        log.info("lora adapter placed", lora_id=lora_id, slot=slot)

    def _host_copy(self, lora_id: int, path: str) -> AdapterWeights:
        weights = self.host.get(lora_id)
        if weights is not None:
            self.host.move_to_end(lora_id)
            return weights
        weights = load_adapter(lora_id, path, self.model_config, self.rank, self.dtype)
        if self.tensor_parallel is not None:  # host memory holds this rank's share only
            cut = shard_adapter(weights.weights, self.model_config, self.tensor_parallel)
            weights = AdapterWeights(lora_id, cut)
        self.host[lora_id] = weights
        while len(self.host) > self.config.cpu_loras:
            self.host.popitem(last=False)
        log.info("lora adapter loaded", lora_id=lora_id, path=path)
        return weights


class LoraLinear(nn.Module):
    """A projection (any kernel: dense, int8, int4, native GGUF) plus, on the rows of a step
    with adapters, each row's low-rank update (Punica's shrink and expand): the rows gathered by
    slot, (x @ A) @ B as two batched matmuls over the slots, added back to their rows. Each row
    costs only its own adapter's arithmetic; base rows cost nothing."""

    def __init__(self, base: nn.Module, slots: LoraSlots, key: tuple[int, str]) -> None:
        super().__init__()
        self.base = base
        self.slots = slots
        self.key = key

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in] -> [T, out]
        out = self.base(x)
        step = self.slots.step
        if step is None:
            return out
        a = self.slots.a[self.key][: step.span].transpose(1, 2)  # [S, in, W]
        b = self.slots.b[self.key][: step.span]  # [S, W, out]
        # Matmuls this small run on one thread: split over two, MKL's took 7 ms instead of 50 us
        # on a loaded 2-core machine (a thread waiting for the other's core at each barrier).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            grouped = x.index_select(0, step.rows).to(a.dtype)  # [S * M, in]
            shrunk = torch.bmm(grouped.view(step.span, step.per_slot, -1), a)  # [S, M, W]
            update = torch.bmm(shrunk.mul_(step.valid), b)  # [S, M, out], 0 on padding
            return out.index_add_(0, step.rows, update.view(-1, out.shape[1]).to(out.dtype))
        finally:
            torch.set_num_threads(threads)


def install_lora(
    model: CausalLM,
    config: LoraConfig,
    device: torch.device,
    tensor_parallel: TensorParallel | None = None,  # `model` is this rank's shard
) -> LoraSlots:
    """Wrap every decoder projection of `model` (after any quantization) in a LoraLinear, and
    give the slots to its fused C layers, if it has them. A row-parallel projection's linear is
    wrapped inside its all-reduce: each rank adds its partial update (shard_adapter)."""
    base_dtype = model.model.embed_tokens.weight.dtype
    dtype = base_dtype if config.dtype == "auto" else getattr(torch, config.dtype)
    slots = LoraSlots(model.config, config, dtype, device, tensor_parallel)
    for layer_index, layer in enumerate(model.model.layers):
        for fused, (parent_name, _) in PROJECTIONS.items():
            parent = getattr(layer, parent_name)
            module = getattr(parent, fused)
            if isinstance(module, RowParallel):
                module.linear = LoraLinear(module.linear, slots, (layer_index, fused))
            else:
                setattr(parent, fused, LoraLinear(module, slots, (layer_index, fused)))
    model.lora = slots
    if model.fused_layers is not None and not model.fused_layers.attach_lora(slots):
        log.info("adapter slots the fused C layers cannot take: adapter steps run per op")
    return slots
