"""`pipeline-bench roofline`: what one decode step of a model moves and computes by design, and
the time it would take at a GPU's HBM bandwidth and tensor-core peak.

Bytes are counted per kernel as the kernels are written (gpu/kernels, cuBLAS for the linears):
every weight of a rank read once a step, each sequence's KV read once per KV head
(`paged_decode`; the per-query-head design before it read it once per query head), the split
partials written and read back, and the elementwise kernels' reads and writes. Each kernel's
time is the larger of its bytes at the bandwidth and its FLOPs at the peak; the step is their
sum, plus the all-reduces' bytes at the NVLink bandwidth under tensor parallelism. Caches and
overlap are not modelled: this is the floor `perf/gpu_check.sh`'s measurements are set against.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

# Published figures of the SXM parts: HBM bandwidth (bytes/s), dense bf16 tensor FLOP/s, SMs, and
# NVLink bandwidth in one direction (bytes/s).
GPUS: dict[str, tuple[float, float, int, float]] = {
    "a100": (2.039e12, 312e12, 108, 300e9),
    "h100": (3.35e12, 989e12, 132, 450e9),
    "h200": (4.8e12, 989e12, 132, 450e9),
}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
PARTIAL_BYTES = 4  # the split partials are float32
LOGIT_BYTES = 4  # logits are sampled in float32


@dataclass(frozen=True, slots=True)
class Part:
    """One kernel's (or kernel family's) share of a step."""

    name: str
    bytes: float
    flops: float
    seconds: float


@dataclass(frozen=True, slots=True)
class Roofline:
    model: str
    gpu: str
    batch: int
    context: int
    tensor_parallel: int
    parts: tuple[Part, ...]
    step_s: float
    unique_kv_bytes: float  # each sequence's K and V, once
    attention_bytes: float  # what decode attention moves: KV, queries, outputs, partials
    per_query_head_kv_bytes: float  # the KV a kernel reading it once per query head moves

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.step_s

    @property
    def attention_over_unique_kv(self) -> float:
        return self.attention_bytes / self.unique_kv_bytes


def roofline(
    model: str,
    gpu: str,
    batch: int,
    context: int,
    tensor_parallel: int = 1,
    dtype: str = "bfloat16",
    kv_cache_dtype: str | None = None,
    max_model_len: int | None = None,
) -> Roofline:
    """One decode step of `batch` sequences of `context` tokens each, on one rank.

    `max_model_len` is the block tables' bound (a CUDA graph's); by default the context, as an
    eager step's tables are as wide as its longest sequence.
    """
    from gpu.kernels.paged_attention import partitions_used, split_bounds
    from stages.text.checkpoint import config_from_hf
    from stages.text.random_model import PRESETS

    if gpu not in GPUS:
        raise ValueError(f"unknown GPU {gpu!r}; choose from {sorted(GPUS)}")
    if model not in PRESETS:
        raise ValueError(f"unknown model {model!r}; choose from {sorted(PRESETS)}")
    if batch < 1 or context < 1 or tensor_parallel < 1:
        raise ValueError("batch, context and tensor parallel size must be at least 1")
    bandwidth, peak, multiprocessors, nvlink = GPUS[gpu]
    c = config_from_hf(PRESETS[model])
    if c.num_heads % tensor_parallel or c.intermediate_size % tensor_parallel:
        raise ValueError(f"{model} does not shard over {tensor_parallel} ranks")
    act = DTYPE_BYTES[dtype]
    kv = DTYPE_BYTES[kv_cache_dtype or dtype]
    layers, hidden, d = c.num_layers, c.hidden_size, c.head_dim
    heads = c.num_heads // tensor_parallel
    kv_heads = max(1, c.num_kv_heads // tensor_parallel)
    inter = c.intermediate_size // tensor_parallel
    vocab = -(-c.vocab_size // tensor_parallel)
    seen = context if c.sliding_window is None else min(context, c.sliding_window)

    def part(name: str, moved: float, flops: float = 0.0) -> Part:
        return Part(name, moved, flops, max(moved / bandwidth, flops / peak))

    layer_weights = hidden * (heads + 2 * kv_heads) * d + heads * d * hidden + 3 * hidden * inter
    weights = (layers * layer_weights + vocab * hidden) * act
    unique_kv = batch * seen * layers * 2 * kv_heads * d * kv
    splits = split_bounds(batch, kv_heads, max_model_len or context, multiprocessors)
    used = partitions_used(seen, splits)
    partials = 0 if used <= 1 else batch * heads * used * (d + 2) * PARTIAL_BYTES * 2 * layers
    queries_and_outputs = batch * heads * d * act * 2 * layers
    attention = unique_kv + partials + queries_and_outputs
    parts = (
        part("linears (weights)", weights + batch * hidden * act, 2 * weights / act * batch),
        part("decode attention", attention, 4 * batch * seen * heads * d * layers),
        part("KV write", batch * layers * 2 * kv_heads * d * (act + kv)),
        part("norms", (2 * layers + 1) * 4 * batch * hidden * act),
        part("rotary", layers * 2 * batch * (heads + kv_heads) * d * act),
        part("silu_mul", layers * 3 * batch * inter * act),
        part("logits and sampling", 2 * batch * c.vocab_size * LOGIT_BYTES),
    )
    all_reduce = 0.0
    if tensor_parallel > 1:  # ring all-reduce: 2 (N - 1) / N of the buffer each way, 2 a layer
        ring = 2 * (tensor_parallel - 1) / tensor_parallel
        all_reduce = 2 * layers * batch * hidden * act * ring
        parts += (Part("all-reduce (NVLink)", all_reduce, 0.0, all_reduce / nvlink),)
    return Roofline(
        model=model,
        gpu=gpu,
        batch=batch,
        context=context,
        tensor_parallel=tensor_parallel,
        parts=parts,
        step_s=sum(p.seconds for p in parts),
        unique_kv_bytes=unique_kv,
        attention_bytes=attention,
        per_query_head_kv_bytes=unique_kv * (heads // kv_heads),
    )


def format_roofline(r: Roofline) -> str:
    tp = f", TP={r.tensor_parallel} (one rank)" if r.tensor_parallel > 1 else ""
    lines = [
        f"{r.model} on {r.gpu}, batch {r.batch}, context {r.context}{tp}: one decode step",
        f"{'part':<22} {'MB moved':>10} {'GFLOP':>9} {'µs':>9}",
    ]
    for p in r.parts:
        lines.append(
            f"{p.name:<22} {p.bytes / 1e6:>10.1f} {p.flops / 1e9:>9.1f} {p.seconds * 1e6:>9.1f}"
        )
    lines.append(
        f"{'step':<22} {sum(p.bytes for p in r.parts) / 1e6:>10.1f} "
        f"{sum(p.flops for p in r.parts) / 1e9:>9.1f} {r.step_s * 1e6:>9.1f}"
    )
    lines.append(f"predicted: {r.step_s * 1e3:.2f} ms a step, {r.tokens_per_s:,.0f} output tok/s")
    lines.append(
        f"decode attention moves {r.attention_over_unique_kv:.3f}x the unique KV bytes "
        f"(a kernel per query head: up to {r.per_query_head_kv_bytes / r.unique_kv_bytes:.0f}x)"
    )
    return "\n".join(lines)


def main(json_path: str | None = None, **kwargs: object) -> int:
    result = roofline(**kwargs)  # type: ignore[arg-type]
    print(format_roofline(result))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(asdict(result) | {"tokens_per_s": result.tokens_per_s}, f, indent=2)
    return 0
