"""`pipeline-bench offline`: drive the engine in-process, without HTTP, and show where time goes.

The bench process is the owner of the pipeline (as the server process would be). Requests are token
prompts of exactly `--prompt-tokens` random ids; each load level runs after a warm-up, and reads
every stage's trace spans and every process's CPU time over exactly that window.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from perf.attribution import attribution
from perf.pipeline_stats import gantt_spans, overhead_per_token, stage_figures
from perf.stats import percentiles_ms


@dataclass(frozen=True, slots=True)
class OfflineArgs:
    model_path: str
    dummy: bool = False
    concurrency: tuple[int, ...] = (1,)
    num_requests: int = 0
    prompt_tokens: int = 204
    max_tokens: int = 128
    seed: int = 0
    device: str = "cpu"  # on CUDA the KV cache takes 0.9 of the device's memory (vLLM's default)
    random_weights: bool = False  # model_path is a random-weight checkpoint
    dtype: str = "float32"
    quantization: str | None = None
    threads: int = 0
    tensor_parallel_size: int = 1
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 512
    kv_cache_bytes: int = 512 * 1024 * 1024
    gantt_seconds: float = 2.0


async def _worker(one, pending: list[int], samples: dict[str, list[float]]) -> int:  # type: ignore[no-untyped-def]
    """Closed loop: take the next request as soon as the last one finished."""
    done = 0
    while pending:
        done += await one(pending.pop(), samples)
    return done


async def run_offline(args: OfflineArgs) -> tuple[dict[str, Any], list[tuple[str, float, float]]]:
    engine = _engine(args)
    await engine.start()
    one = _requester(engine, args, np.random.default_rng(args.seed))
    runs: list[dict[str, Any]] = []
    gantt: list[tuple[str, float, float]] = []
    try:
        for concurrency in args.concurrency:
            run, spans = await _run_level(engine, one, concurrency, args.num_requests)
            runs.append(run)
            gantt = gantt_spans(spans, args.gantt_seconds)
    finally:
        await engine.stop()
    return {"runs": runs}, gantt


def _engine(args: OfflineArgs) -> Any:
    from stages.config import EngineConfig
    from stages.engine import Engine

    return Engine(
        EngineConfig(
            model_path=args.model_path,
            dummy=args.dummy,
            dtype=args.dtype,
            quantization=args.quantization,
            threads=args.threads,
            tensor_parallel_size=args.tensor_parallel_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_bytes=args.kv_cache_bytes,
            device=args.device,
            gpu_memory_utilization=0.9 if args.device == "cuda" else None,
            random_weights=args.random_weights,
            log_format="json",
            log_level="warning",
        )
    )


def _requester(
    engine: Any, args: OfflineArgs, rng: np.random.Generator
) -> Callable[[int, dict[str, list[float]]], Awaitable[int]]:
    """`one(i, samples)`: request i, a random prompt of special-token-free ids, greedy to
    max_tokens; its TTFT and ITLs into samples; its token count."""
    from pipeline.clock import now_ns
    from stages.api import GenerateRequest, SamplingParams, TokensPrompt

    vocab = engine.bundle.vocab_size
    special = np.array(sorted(engine.bundle.special_token_ids), np.int64)

    def prompt() -> TokensPrompt:
        ids = rng.integers(0, vocab, args.prompt_tokens)
        ids[np.isin(ids, special)] = 0 if 0 not in special else ids[0]
        return TokensPrompt(ids.tolist())

    async def one(i: int, samples: dict[str, list[float]]) -> int:
        request = GenerateRequest(
            f"offline-{i}",
            prompt(),
            SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True),
            arrival_ns=now_ns(),
        )
        start = last = time.perf_counter()
        tokens = 0
        async for out in engine.generate(request):
            now = time.perf_counter()
            if out.token_ids:
                if tokens == 0:
                    samples["ttft"].append(now - start)
                else:
                    samples["itl"].append(now - last)
                last = now
                tokens += len(out.token_ids)
        return tokens

    return one


async def _run_level(
    engine: Any,
    one: Callable[[int, dict[str, list[float]]], Awaitable[int]],
    concurrency: int,
    num_requests: int,
) -> tuple[dict[str, Any], Any]:
    """One concurrency level after a short warm-up: its figures, and the stages' spans."""
    count = num_requests or max(8, 4 * concurrency)
    await asyncio.gather(*(one(-1, {"ttft": [], "itl": []}) for _ in range(min(concurrency, 4))))
    engine.read_traces()
    cpu0, wall0 = engine.cpu_seconds(), time.perf_counter()
    samples: dict[str, list[float]] = {"ttft": [], "itl": []}
    pending = list(range(count))
    workers = (_worker(one, pending, samples) for _ in range(concurrency))
    tokens = sum(await asyncio.gather(*workers))
    wall = time.perf_counter() - wall0
    spans, cpu1 = engine.read_traces(), engine.cpu_seconds()
    run = {
        "concurrency": concurrency,
        "completed": count,
        "duration_s": wall,
        "output_tok_per_s": tokens / wall,
        "ttft_ms": percentiles_ms(samples["ttft"]),
        "itl_ms": percentiles_ms(samples["itl"]),
        "stages": stage_figures(spans, wall),
        "attribution": attribution(spans),
        "overhead": overhead_per_token(cpu0, cpu1, spans, tokens),
    }
    return run, spans
