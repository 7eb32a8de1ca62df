"""`pipeline-bench lora`: throughput with LoRA adapters against the base model alone, in one run.

Writes random rank-R adapters of the model (PEFT format, every attention and MLP projection),
starts one `pipeline-serve --enable-lora` with them, and drives it with `pipeline-bench serve`'s
load generator at c=32, interleaved round by round (the order alternates): every request for the
base model, then the same requests spread over the adapters (request i names adapter i mod N), so
each step mixes every adapter. Prints the ratio of each pair and their median against the goal.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np

from perf import serve_bench
from perf.spec_bench import _server
from stages.config import default_model_path
from stages.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    ATTENTION_MODULES,
    TARGET_MODULES,
    module_shape,
)
from stages.text.checkpoint import load_model_config

GOAL = 0.85  # adapters' throughput over the base's: vLLM PR #11267 measured 0.66 for one rank-8


@dataclass(frozen=True, slots=True)
class LoraBenchArgs:
    model: str | None = None  # None: the default model
    num_adapters: int = 4
    rank: int = 8
    concurrency: int = 32
    num_requests: int = 128
    max_tokens: int = 128
    repeats: int = 3
    port: int = 8620
    threads: int = 2


def write_adapters(model_path: str, directory: str, count: int, rank: int) -> list[str]:
    """`count` random rank-`rank` PEFT adapters of the model, in `directory`/a0.. (small weights,
    so that outputs stay text)."""
    from safetensors.numpy import save_file

    model = load_model_config(model_path)
    paths = []
    for index in range(count):
        rng = np.random.default_rng(index)
        tensors = {}
        for layer in range(model.num_layers):
            for module in TARGET_MODULES:
                out_features, in_features = module_shape(model, module)
                parent = "self_attn" if module in ATTENTION_MODULES else "mlp"
                name = f"base_model.model.model.layers.{layer}.{parent}.{module}"
                a = rng.standard_normal((rank, in_features)) * 0.02
                b = rng.standard_normal((out_features, rank)) * 0.02
                tensors[f"{name}.lora_A.weight"] = a.astype(np.float32)
                tensors[f"{name}.lora_B.weight"] = b.astype(np.float32)
        path = os.path.join(directory, f"a{index}")
        os.makedirs(path, exist_ok=True)
        save_file(tensors, os.path.join(path, ADAPTER_WEIGHTS))
        config = {
            "peft_type": "LORA",
            "r": rank,
            "lora_alpha": 2 * rank,
            "target_modules": list(TARGET_MODULES),
            "bias": "none",
        }
        with open(os.path.join(path, ADAPTER_CONFIG), "w") as file:
            json.dump(config, file)
        paths.append(path)
    return paths


async def _round(
    url: str, models: list[str], work: serve_bench.Workload, concurrency: int
) -> dict[str, Any]:
    """The workload at `concurrency` streams, request i for models[i mod len(models)]."""
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as session:
        clients = [serve_bench.Client(session, url, m, None, True) for m in models]
        queue = list(range(len(work.prompts)))[::-1]
        results: list[serve_bench.RequestResult] = []

        async def worker() -> None:
            while queue:
                i = queue.pop()
                client = clients[i % len(clients)]
                results.append(await client.chat(work.prompts[i], work.max_tokens[i]))

        cpu0, wall0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return serve_bench.summarize(results, wall, cpu, None)


async def _tokens_per_word(url: str) -> float:
    async with aiohttp.ClientSession() as session:
        return await serve_bench.tokens_per_word(session, url, "base", None)


def run_lora_bench(args: LoraBenchArgs, work_dir: str) -> dict[str, Any]:
    model = args.model or default_model_path()
    paths = write_adapters(model, work_dir, args.num_adapters, args.rank)
    names = [f"a{i}" for i in range(len(paths))]
    server_args = [
        model,
        "--served-model-name",
        "base",
        "--threads",
        str(args.threads),
        "--max-num-seqs",
        str(max(args.concurrency, 32)),
        "--enable-lora",
        "--max-loras",
        str(args.num_adapters),
        "--max-lora-rank",
        str(args.rank),
        "--lora-modules",
        *(f"{name}={path}" for name, path in zip(names, paths, strict=True)),
    ]
    rows = []
    with _server(server_args, args.port, os.path.join(work_dir, "serve.log")) as url:
        # The load generator's random-word prompts (about 200 tokens), calibrated on the server.
        words = asyncio.run(_tokens_per_word(url))
        work = serve_bench.synthetic(args.num_requests, 204, args.max_tokens, 0, words)
        # Warm-up: one short request per model, so every adapter is loaded before timing.
        warm = serve_bench.Workload(work.prompts[: len(names) + 1], [4] * (len(names) + 1))
        asyncio.run(_round(url, ["base", *names], warm, len(names) + 1))
        for repeat in range(args.repeats):
            order = ("base", "lora") if repeat % 2 == 0 else ("lora", "base")
            runs = {}
            for kind in order:
                print(f"[lora bench] {kind} ({repeat + 1}/{args.repeats})", file=sys.stderr)
                models = ["base"] if kind == "base" else names
                runs[kind] = asyncio.run(_round(url, models, work, args.concurrency))
            base, lora = runs["base"], runs["lora"]
            rows.append(
                {
                    "repeat": repeat,
                    "base_tok_per_s": base["output_tok_per_s"],
                    "lora_tok_per_s": lora["output_tok_per_s"],
                    "ratio": lora["output_tok_per_s"] / base["output_tok_per_s"],
                    "base_itl_p50_ms": base["itl_ms"]["p50"],
                    "lora_itl_p50_ms": lora["itl_ms"]["p50"],
                    "errors": base["errors"] + lora["errors"],
                }
            )
    ratio = statistics.median(row["ratio"] for row in rows)
    return {
        "model": model,
        "num_adapters": args.num_adapters,
        "rank": args.rank,
        "concurrency": args.concurrency,
        "threads": args.threads,
        "rows": rows,
        "median_ratio": ratio,
        "goal": GOAL,
        "met": ratio >= GOAL,
    }


def format_table(report: dict[str, Any]) -> str:
    lines = [
        f"c={report['concurrency']}, {report['num_adapters']} adapters of rank {report['rank']} "
        f"against the base model, {report['threads']} threads",
        "| pair | base tok/s | adapters tok/s | adapters / base | ITL p50 base / adapters (ms) "
        "| errors |",
        "|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        lines.append(
            f"| {row['repeat'] + 1} | {row['base_tok_per_s']:.1f} | {row['lora_tok_per_s']:.1f} "
            f"| {row['ratio']:.2f} | {row['base_itl_p50_ms']:.0f} / {row['lora_itl_p50_ms']:.0f} "
            f"| {row['errors']} |"
        )
    met = "met" if report["met"] else "missed"
    lines.append(f"median adapters / base: {report['median_ratio']:.2f} (goal >= {GOAL}: {met})")
    return "\n".join(lines)
