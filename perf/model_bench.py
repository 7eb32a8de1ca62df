"""`pipeline-bench model`: the model runner's prefill and decode throughput per weight format,
beside a plain unpaged fp32 torch baseline run in the same process (on CPU), or beside the same
steps run eagerly (on CUDA: decode steps replay CUDA graphs), and against the memory roofline.

Decode runs B sequences at a given context (their KV blocks hold whatever is there: the cost of a
step does not depend on the values), one token each per step, through `ModelRunner.step` with
greedy sampling. The baseline is the same fp32 weights with contiguous per-sequence KV tensors,
repeated KV heads and torch's SDPA: what a plain implementation does. The roofline is the bytes one
decode step must read (weights + KV) over this machine's measured read bandwidth, or on CUDA over
the device's peak (--peak-bandwidth-gb-s, an H200's 4.8 TB/s by default).
"""

from __future__ import annotations

import contextlib
import itertools
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from gpu import native
from gpu.backends import apply_rotary
from gpu.model import CausalLM
from gpu.runner import ForwardInputs, ModelRunner, RunnerConfig, StepBatch
from gpu.sampler import SamplingArrays

WEIGHTS = {  # name -> (model dtype, quantization)
    "fp32": ("float32", None),
    "bf16": ("bfloat16", None),
    "int8": ("float32", "int8"),
    "int4": ("float32", "int4"),
    "int4_bf16": ("bfloat16", "int4"),  # int4 linears with bf16 activations and KV cache
}


@dataclass(frozen=True, slots=True)
class ModelBenchArgs:
    model_path: str
    weights: tuple[str, ...] = ("fp32", "bf16", "int8", "int4")
    batches: tuple[int, ...] = (1, 8, 32, 64)
    context: int = 256
    prefill_tokens: int = 512
    steps: int = 8
    threads: int = 0
    baseline: bool = True  # CPU: the unpaged fp32 baseline; CUDA compares against eager steps
    device: str = "cpu"
    random_weights: bool = False  # model_path is a random-weight checkpoint (--random-weights)
    peak_bandwidth_gb_s: float | None = None  # the roofline's; None: measured (CPU) or an H200's
    tensor_parallel_size: int = 1  # > 1: this process is rank 0 of a gloo group (perf/tp_ranks.py)
    # > 0: also a step of each batch where every sequence verifies this many drafts (speculative
    # decoding), timed against the batch's decode step: what drafting costs at that load.
    verify_drafts: int = 0
    # CPU kernel levels to measure in turn (gpu/cpu_isa.py); empty: PIPELINE_SERVE_CPU_ISA's
    cpu_isa: tuple[str, ...] = ()


H200_HBM_GB_S = 4800.0  # HBM3e, NVIDIA's figure


def read_bandwidth_gb_s(megabytes: int = 1024) -> float:
    """Bytes per second this machine reads from memory: a large tensor summed on torch's threads
    (all cores, as the model runs), best of 5."""
    data = torch.ones(megabytes * (1 << 20) // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def weight_bytes_read(model: torch.nn.Module, rows: int) -> int:
    """Bytes of weights one forward pass of `rows` input rows reads: of a ThinThickLinear only the
    copy that serves those rows, of an embedding table only the rows looked up."""
    from gpu.quant import ThinThickLinear

    total = 0
    skip: set[int] = set()
    for module in model.modules():
        if isinstance(module, ThinThickLinear):
            used = module.quantized if rows <= module.max_thin_rows else None
            tensors = list(used.buffers()) if used is not None else [module.dense_weight]
            total += sum(t.numel() * t.element_size() for t in tensors)
            skip.update(id(t) for t in module.buffers())
        elif isinstance(module, torch.nn.Embedding):
            total += rows * module.embedding_dim * module.weight.element_size()
            skip.add(id(module.weight))
    for tensor in (*model.parameters(), *model.buffers()):
        if id(tensor) not in skip:
            skip.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


def _median_time(fn: Any, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _alternating(first: Any, second: Any, repeats: int) -> tuple[float, float]:
    """Median times of two steps timed in turns (which goes first alternating), after a warm-up
    of each."""
    first(), second()
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(repeats):
        for which in (i % 2, 1 - i % 2):
            fn = (first, second)[which]
            start = time.perf_counter()
            fn()
            times[which].append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def decode_batch(
    runner: ModelRunner, batch: int, context: int, rng: np.random.Generator
) -> StepBatch:
    """B sequences at `context`, one token each."""
    return verify_batch(runner, batch, context, 0, rng)


def verify_batch(
    runner: ModelRunner, batch: int, context: int, drafts: int, rng: np.random.Generator
) -> StepBatch:
    """B sequences at `context`, each feeding its input token and `drafts` drafts after it, as a
    step of speculative decoding does (one logits row per position, the drafts verified); with
    no drafts, a decode step."""
    block = runner.kv_cache.block_size
    rows = 1 + drafts
    per_seq = -(-(context + rows) // block)
    tables = np.arange(batch * per_seq, dtype=np.int32).reshape(batch, per_seq)
    positions = np.tile(np.arange(context, context + rows, dtype=np.int64), batch)
    seq = np.repeat(np.arange(batch), rows)
    slots = tables[seq, positions // block].astype(np.int64) * block + positions % block
    return StepBatch(
        handles=np.arange(batch, dtype=np.int64),
        input_ids=rng.integers(0, runner.model_config.vocab_size, batch * rows),
        positions=positions,
        query_start_loc=np.arange(0, batch * rows + 1, rows, dtype=np.int32),
        context_lens=np.full(batch, context + rows, np.int32),
        block_tables=tables,
        slot_mapping=slots,
        prompt_lens=np.full(batch, context, np.int32),
        sample=np.ones(batch, bool),
        sampling=SamplingArrays.defaults(batch),
        prompt_logprobs=np.full(batch, -1, np.int32),
        num_draft=np.full(batch, drafts, np.int32) if drafts else None,
    )


def prefill_batch(runner: ModelRunner, tokens: int, rng: np.random.Generator) -> StepBatch:
    block = runner.kv_cache.block_size
    tables = np.arange(-(-tokens // block), dtype=np.int32)[None, :]
    positions = np.arange(tokens, dtype=np.int64)
    return StepBatch(
        handles=np.array([10_000], np.int64),
        input_ids=rng.integers(0, runner.model_config.vocab_size, tokens),
        positions=positions,
        query_start_loc=np.array([0, tokens], np.int32),
        context_lens=np.array([tokens], np.int32),
        block_tables=tables,
        slot_mapping=tables[0, positions // block].astype(np.int64) * block + positions % block,
        prompt_lens=np.array([tokens], np.int32),
        sample=np.ones(1, bool),
        sampling=SamplingArrays.defaults(1),
        prompt_logprobs=np.full(1, -1, np.int32),
    )


class UnpagedBaseline:
    """The same fp32 layers with contiguous KV tensors and plain SDPA (no paging, GQA by repeat)."""

    def __init__(self, model: CausalLM, batch: int, max_len: int) -> None:
        self.model = model
        c = model.config
        self.k = [
            torch.zeros(batch, c.num_kv_heads, max_len, c.head_dim) for _ in range(c.num_layers)
        ]
        self.v = [torch.zeros_like(k) for k in self.k]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, start: int) -> torch.Tensor:
        # input_ids: [B, S] int64; positions start..start+S-1 for every sequence
        m, c = self.model, self.model.config
        batch, length = input_ids.shape
        positions = torch.arange(start, start + length)
        freqs = positions.float()[:, None] * m.inv_freq[None, :]
        cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
        x = m.model.embed_tokens(input_ids)  # [B, S, hidden]
        group = c.num_heads // c.num_kv_heads
        for i, layer in enumerate(m.model.layers):
            h = layer.input_layernorm(x.reshape(-1, c.hidden_size))
            q, k, v = layer.self_attn.qkv_proj(h).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
            q = apply_rotary(
                q.view(-1, c.num_heads, c.head_dim),
                cos.repeat(batch, 1, 1),
                sin.repeat(batch, 1, 1),
            )
            k = apply_rotary(
                k.view(-1, c.num_kv_heads, c.head_dim),
                cos.repeat(batch, 1, 1),
                sin.repeat(batch, 1, 1),
            )
            q = q.view(batch, length, c.num_heads, c.head_dim).transpose(1, 2)
            self.k[i][:, :, start : start + length] = k.view(
                batch, length, c.num_kv_heads, c.head_dim
            ).transpose(1, 2)
            self.v[i][:, :, start : start + length] = v.reshape(
                batch, length, c.num_kv_heads, c.head_dim
            ).transpose(1, 2)
            keys = self.k[i][:, :, : start + length].repeat_interleave(group, dim=1)
            values = self.v[i][:, :, : start + length].repeat_interleave(group, dim=1)
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=length > 1)
            x = x + layer.self_attn.o_proj(out.transpose(1, 2).reshape(batch, length, c.q_size))
            x = x + layer.mlp(layer.post_attention_layernorm(x.reshape(-1, c.hidden_size))).view_as(
                x
            )
        return m.lm_head(m.model.norm(x[:, -1])).float()


def _eager_and_graphed(runner: ModelRunner, step: StepBatch, repeats: int) -> tuple[float, float]:
    """Median seconds of `step` run eagerly and as a CUDA graph replay, in alternating rounds (the
    device's clocks and the host drift), each round after its own warm-up."""
    graphs = runner.graphs
    eager: list[float] = []
    graphed: list[float] = []
    for _ in range(max(1, repeats // 4)):
        runner.graphs = None
        eager.append(_median_time(partial(runner.step, step), 4))
        runner.graphs = graphs
        graphed.append(_median_time(partial(runner.step, step), 4))
    return statistics.median(eager), statistics.median(graphed)


def run_model_bench(args: ModelBenchArgs) -> dict[str, Any]:
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    cuda = torch.device(args.device).type == "cuda"
    if args.peak_bandwidth_gb_s is not None:
        bandwidth = args.peak_bandwidth_gb_s
    else:
        bandwidth = H200_HBM_GB_S if cuda else read_bandwidth_gb_s()
    print(f"memory read bandwidth: {bandwidth:.1f} GB/s", file=sys.stderr)
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    baseline = _Baseline()
    # Each CPU kernel level asked for (--cpu-isa) in turn, in this one process; else the one
    # PIPELINE_SERVE_CPU_ISA chooses.
    kernels: list[dict[str, Any]] = []
    for level, weights in itertools.product(args.cpu_isa or (None,), args.weights):
        with native.using_level(level) if level else contextlib.nullcontext():
            rows += _weights_rows(args, weights, bandwidth, rng, baseline, kernels)
    return {"bandwidth_gb_s": bandwidth, "device": args.device, "rows": rows, "kernels": kernels}


def _kernel_pass(modules: list[Any], count: int) -> Callable[[], None]:
    """One call of each module's native kernel on `count` rows, inputs and outputs made once: the
    kernel and its ctypes call without the module's Python around it (the fused decode path
    calls the kernels from C), so that a small projection's GEMV is not timed as dispatch."""
    from gpu.quant import NativeQ4Linear, NativeQ8Linear

    inputs = {k: torch.randn(count, k) for k in {m.in_features for m in modules}}
    outs = [torch.empty(count, m.out_features) for m in modules]

    def run() -> None:
        for m, out in zip(modules, outs, strict=True):
            x = inputs[m.in_features]
            if isinstance(m, NativeQ4Linear) and m.many_rows:
                native.q4_1_gemm(x, m.codes, m.scales, m.minimums, m.out_features, out=out)
            elif isinstance(m, NativeQ8Linear) and m.many_rows:
                native.q8_0_gemm(x, m.codes, m.scales, m.corrections, m.out_features, out=out)
            else:  # the portable build's row layout
                m(x)

    return run


def kernel_rows(
    model: torch.nn.Module, kernels_name: str, weights: str, gemm_rows: int, repeats: int
) -> list[dict[str, Any]]:
    """Each native quantized linear of the model (all layers' instances of one projection, and
    the LM head) as a GEMV (1 row) and a GEMM (`gemm_rows` rows, a prefill chunk), each against
    its bound measured here, now: the GEMV's bytes/s against a STREAM-like read of the same
    packed weights (cold or cache-warm alike), the GEMM's int8 MAC/s against the peak of the
    build's dot instruction with every operand in registers."""
    from gpu.quant import NativeQ4Linear, NativeQ8Linear

    if native.load() is None:
        return []
    groups: dict[str, list[Any]] = {}
    in_order: list[Any] = []  # as a decode step reads them: more bytes than a cache holds
    for name, module in model.named_modules():
        if isinstance(module, (NativeQ4Linear, NativeQ8Linear)):
            projection = re.sub(r"\.\d+\.", ".*.", name).removesuffix(".quantized")
            groups.setdefault(projection, []).append(module)
            in_order.append(module)
    peak = native.int8_peak_macs_per_s()
    rows: list[dict[str, Any]] = []
    for projection, modules in groups.items():
        first = modules[0]
        n, k = first.out_features, first.in_features
        buffers = [t for m in modules for t in m.buffers() if t is not None]
        size = sum(t.numel() * t.element_size() for t in buffers)
        read = native.stream_read_bytes_per_s(buffers)
        for count in (1, gemm_rows):
            seconds = _median_time(_kernel_pass(modules, count), repeats)
            macs = len(modules) * n * k * count
            gemv = count == 1
            rows.append(
                {
                    "kernels": kernels_name,
                    "weights": weights,
                    "kernel": f"{type(first).__name__.removeprefix('Native')} {projection}",
                    "shape": f"{len(modules)}x[{n}, {k}]",
                    "rows": count,
                    "achieved": size / seconds if gemv else macs / seconds,
                    "bound": read if gemv else peak,
                    "unit": "B/s" if gemv else "MAC/s",
                }
            )
    if in_order:  # every projection once, layer after layer: the GEMVs of a batch-1 step
        buffers = [t for m in in_order for t in m.buffers() if t is not None]
        rows.append(
            {
                "kernels": kernels_name,
                "weights": weights,
                "kernel": "all, in the model's order",
                "shape": f"{len(in_order)} linears",
                "rows": 1,
                "achieved": sum(t.numel() * t.element_size() for t in buffers)
                / _median_time(_kernel_pass(in_order, 1), repeats),
                "bound": native.stream_read_bytes_per_s(buffers),
                "unit": "B/s",
            }
        )
    return rows


@dataclass(slots=True)
class _Baseline:
    """The unpaged fp32 model's figures (CPU), measured once for every level and format."""

    prefill_tok_per_s: float = 0.0
    decode_tok_per_s: dict[int, float] = field(default_factory=dict)  # by batch


def _weights_rows(
    args: ModelBenchArgs,
    weights: str,
    bandwidth: float,
    rng: np.random.Generator,
    baseline: _Baseline,
    kernels: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """Prefill, and each batch's decode step (and verification), on one weight format; its native
    kernels against their bounds into `kernels` (CPU)."""
    cuda = torch.device(args.device).type == "cuda"
    print(f"[{weights}] loading ...", file=sys.stderr, flush=True)
    runner, share, close = _load(args, _runner_config(args, weights))
    if (
        args.baseline
        and weights == "fp32"
        and not cuda
        and args.tensor_parallel_size == 1
        and not baseline.decode_tok_per_s  # the unpaged torch model's: once for every level
    ):
        _measure_baseline(args, runner, rng, baseline)
    rows = [_prefill_row(args, runner, share, weights, rng, baseline)]
    for batch in args.batches:
        rows.append(_decode_row(args, runner, share, weights, batch, bandwidth, rng, baseline))
        if args.verify_drafts > 0:
            rows.append(_verify_row(args, runner, share, weights, batch, rng))
    if not cuda and args.tensor_parallel_size == 1:
        kernels += kernel_rows(
            runner.model, runner.kernels_name, weights, args.prefill_tokens, max(2, args.steps // 4)
        )
    close()
    del runner
    if cuda:
        torch.cuda.empty_cache()
    return rows


def _runner_config(args: ModelBenchArgs, weights: str) -> RunnerConfig:
    """A runner of one weight format with KV room for the largest batch or the prefill."""
    max_batch = max(args.batches)
    per_seq = -(-(args.context + 1) // 16) + 1
    dtype, quantization = WEIGHTS[weights]
    element = 4 if dtype == "float32" else 2
    return RunnerConfig(
        dtype=dtype,
        quantization=quantization,
        kv_cache_bytes=max(max_batch * per_seq, -(-args.prefill_tokens // 16) + 1)
        * 16
        * 2
        * _kv_row_bytes(args.model_path, element),
        threads=args.threads,
        device=args.device,
        random_weights=args.random_weights,
        max_num_seqs=max_batch,
        max_model_len=max(args.context + 1, args.prefill_tokens),
    )


def _measure_baseline(
    args: ModelBenchArgs, runner: ModelRunner, rng: np.random.Generator, baseline: _Baseline
) -> None:
    """The plain unpaged fp32 torch model's prefill and decode speeds, into `baseline`."""
    c = runner.model_config
    print("[baseline] unpaged fp32 ...", file=sys.stderr, flush=True)
    base = UnpagedBaseline(runner.model, 1, args.prefill_tokens + 1)
    prompt = torch.from_numpy(rng.integers(0, c.vocab_size, (1, args.prefill_tokens)))
    baseline.prefill_tok_per_s = args.prefill_tokens / _median_time(
        partial(base.forward, prompt, 0), 2
    )
    for batch in args.batches:
        base = UnpagedBaseline(runner.model, batch, args.context + 1)
        token = torch.from_numpy(rng.integers(0, c.vocab_size, (batch, 1)))
        baseline.decode_tok_per_s[batch] = batch / _median_time(
            partial(base.forward, token, args.context), args.steps
        )


def _prefill_row(
    args: ModelBenchArgs,
    runner: ModelRunner,
    share: Callable[[ForwardInputs], None] | None,
    weights: str,
    rng: np.random.Generator,
    baseline: _Baseline,
) -> dict[str, Any]:
    step = prefill_batch(runner, args.prefill_tokens, rng)
    seconds = _median_time(partial(runner.step, step, share), 2)
    runner.free([10_000])
    print(
        f"[{runner.kernels_name} {weights}] prefill {args.prefill_tokens}: {args.prefill_tokens / seconds:.0f} tok/s",
        file=sys.stderr,
    )
    return {
        "mode": "prefill",
        "kernels": runner.kernels_name,
        "batch": 1,
        "context": args.prefill_tokens,
        "weights": weights,
        "tok_per_s": args.prefill_tokens / seconds,
        "baseline_tok_per_s": baseline.prefill_tok_per_s,
        "roofline_fraction": None,
    }


def _decode_row(
    args: ModelBenchArgs,
    runner: ModelRunner,
    share: Callable[[ForwardInputs], None] | None,
    weights: str,
    batch: int,
    bandwidth: float,
    rng: np.random.Generator,
    baseline: _Baseline,
) -> dict[str, Any]:
    """One batch's decode step, against the memory roofline at `bandwidth` GB/s."""
    step = decode_batch(runner, batch, args.context, rng)
    eager_seconds = None
    if runner.graphs is not None:
        eager_seconds, seconds = _eager_and_graphed(runner, step, args.steps)
    else:
        seconds = _median_time(partial(runner.step, step, share), args.steps)
    runner.free(np.arange(batch))
    element = 4 if WEIGHTS[weights][0] == "float32" else 2
    kv_bytes = batch * (args.context + 1) * _kv_row_bytes(args.model_path, element) * 2
    w_bytes = weight_bytes_read(runner.model, batch)
    ideal = (w_bytes + kv_bytes) / (bandwidth * 1e9)
    print(
        f"[{runner.kernels_name} {weights}] decode batch {batch}: {batch / seconds:.0f} tok/s ({seconds * 1e3:.1f} ms/step)",
        file=sys.stderr,
    )
    return {
        "mode": "decode",
        "kernels": runner.kernels_name,
        "batch": batch,
        "context": args.context,
        "weights": weights,
        "tok_per_s": batch / seconds,
        "baseline_tok_per_s": baseline.decode_tok_per_s.get(batch, 0.0),
        "roofline_fraction": ideal / seconds,
        "step_ms": seconds * 1e3,
        "bytes_per_step": w_bytes + kv_bytes,
        "eager_tok_per_s": None if eager_seconds is None else batch / eager_seconds,
    }


def _verify_row(
    args: ModelBenchArgs,
    runner: ModelRunner,
    share: Callable[[ForwardInputs], None] | None,
    weights: str,
    batch: int,
    rng: np.random.Generator,
) -> dict[str, Any]:
    """A step verifying `verify_drafts` drafts per sequence, against the batch's decode step.
    Its cost in decode steps is the break-even: drafting pays only where a sequence emits more
    tokens than that per verifying step (accepted drafts + 1), before the pipeline's own costs."""
    k = args.verify_drafts
    # Timed against decode steps of the same batch, alternating, so that the machine's drift
    # between the two measurements does not land in the ratio.
    decode = decode_batch(runner, batch, args.context, rng)
    step = verify_batch(runner, batch, args.context, k, rng)
    decode_seconds, seconds = _alternating(
        partial(runner.step, decode, share), partial(runner.step, step, share), args.steps
    )
    runner.free(np.arange(batch))
    print(
        f"[{weights}] verify {k} drafts, batch {batch}: {seconds * 1e3:.1f} ms/step, "
        f"{seconds / decode_seconds:.2f} decode steps",
        file=sys.stderr,
    )
    return {
        "mode": f"verify{k}",
        "kernels": runner.kernels_name,
        "batch": batch,
        "context": args.context,
        "weights": weights,
        "tok_per_s": batch * (1 + k) / seconds,  # positions computed
        "baseline_tok_per_s": 0.0,
        "roofline_fraction": None,
        "step_ms": seconds * 1e3,
        "decode_steps": seconds / decode_seconds,
    }


def _load(
    args: ModelBenchArgs, config: RunnerConfig
) -> tuple[ModelRunner, Callable[[ForwardInputs], None] | None, Callable[[], None]]:
    """The runner, what it shares each step's forward with (None: no other rank), and what ends
    the other ranks. With --tensor-parallel-size N the weights' byte counts are rank 0's."""
    if args.tensor_parallel_size == 1:
        return ModelRunner.from_path(args.model_path, config), None, lambda: None
    from perf.tp_ranks import RankGroup

    group = RankGroup(args.model_path, config, args.tensor_parallel_size)
    return group.runner, group.share, group.close


def _kv_row_bytes(model_path: str, element: int) -> int:
    """Bytes of K (or V) for one token across all layers."""
    from stages.text.checkpoint import load_model_config

    c = load_model_config(model_path)
    return c.num_layers * c.num_kv_heads * c.head_dim * element


def format_table(report: dict[str, Any]) -> str:
    """On CPU the baseline is the unpaged fp32 model; on CUDA the same steps run eagerly."""
    cuda = torch.device(report.get("device", "cpu")).type == "cuda"
    against = "eager" if cuda else "baseline"
    lines = [
        f"{'mode':<8} {'kernels':<11} {'weights':<7} {'batch':>5} {'ctx':>5} {'tok/s':>9} {against:>9} {'ratio':>7} {'ms/step':>8} {'roofline':>9}",
        "-" * 87,
    ]
    for r in report["rows"]:
        other = r.get("eager_tok_per_s") if cuda else r["baseline_tok_per_s"]
        ratio = r["tok_per_s"] / other if other else float("nan")
        roof = f"{r['roofline_fraction']:.0%}" if r["roofline_fraction"] is not None else "-"
        step = f"{r['step_ms']:.2f}" if "step_ms" in r else "-"
        lines.append(
            f"{r['mode']:<8} {r['kernels']:<11} {r['weights']:<7} {r['batch']:>5} {r['context']:>5} {r['tok_per_s']:>9.0f} "
            f"{other or 0:>9.0f} {ratio:>6.2f}x {step:>8} {roof:>9}"
        )
    for r in report["rows"]:
        if "decode_steps" in r:
            lines.append(
                f"{r['mode']} {r['weights']} batch {r['batch']}: one step costs "
                f"{r['decode_steps']:.2f} decode steps; drafts pay only above that many tokens "
                "out per sequence per step"
            )
    lines.append(f"\nmemory read bandwidth {report['bandwidth_gb_s']:.1f} GB/s")
    if report.get("kernels"):
        lines += [
            "",
            "each kernel against its bound, measured in the same run: GEMV (1 row) bytes/s against "
            "a read of the same packed weights, GEMM int8 MAC/s against the dot instruction's peak",
            f"{'kernels':<11} {'weights':<7} {'kernel':<44} {'shape':<16} {'rows':>5} {'achieved':>12} {'bound':>12} {'of bound':>8}",
        ]
        for r in report["kernels"]:
            scale, unit = (1e9, "GB/s") if r["unit"] == "B/s" else (1e9, "GMAC/s")
            share = f"{r['achieved'] / r['bound']:.0%}" if r["bound"] else "-"
            lines.append(
                f"{r['kernels']:<11} {r['weights']:<7} {r['kernel']:<44} {r['shape']:<16} {r['rows']:>5} "
                f"{r['achieved'] / scale:>7.1f} {unit:<4} {r['bound'] / scale:>7.1f} {unit:<4} {share:>8}"
            )
    return "\n".join(lines)
