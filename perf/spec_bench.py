"""`pipeline-bench spec`: speculative decoding on against off, side by side in one run.

Starts two `pipeline-serve` processes on the same model (one with `--speculative-config`, one
without), then drives both with `pipeline-bench serve`'s load generator, interleaved level by level:
the grounded workload (copy a function given in the prompt, to EOS) at c=1 and c=8, and the
random-prompt workload of the earlier benchmarks at c=32 and c=1, at temperature 0 (the load
generator's). It prints each pair's ratio against the issue's goal with the acceptance figures
from /metrics, and writes the JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from perf import serve_bench

# (workload, concurrency, requests, what is compared, goal): the goal is on / off, except for
# ITL, where it is the most on may take relative to off.
CASES = (
    ("grounded", 1, 8, "output_tok_per_s", 2.5),
    ("grounded", 8, 24, "output_tok_per_s", 1.8),
    ("random", 32, 64, "output_tok_per_s", 0.97),
    ("random", 1, 8, "itl_p50", 1.0),
)


@dataclass(frozen=True, slots=True)
class SpecBenchArgs:
    model: str | None = None  # None: the default model
    speculative_config: str = (
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, '
        '"prompt_lookup_max": 5}'
    )
    port: int = 8610
    threads: int = 2
    max_tokens: int = 128
    repeats: int = 1
    extra_server_args: tuple[str, ...] = ()
    # A fresh pair of servers for each repeat: two server processes differ by several percent
    # for the whole of their lives (where their memory and threads landed), which one pair of
    # servers would add to every ratio alike.
    fresh_servers: bool = True


def draft_model_config(draft: str | None, num_speculative_tokens: int) -> str:
    """The --speculative-config of the draft_model method; None drafts with the default model
    (SmolLM2 for SmolLM2, the one pair at hand: a correctness and overhead figure, since the
    draft costs as much as the target)."""
    from stages.config import default_model_path

    return json.dumps(
        {
            "method": "draft_model",
            "model": draft or default_model_path(),
            "num_speculative_tokens": num_speculative_tokens,
        }
    )


def _get(port: int, path: str) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("GET", path)
        return connection.getresponse().status
    finally:
        connection.close()


@contextlib.contextmanager
def _server(args: list[str], port: int, log_path: str) -> Iterator[str]:
    argv = [sys.executable, "-m", "server.cli", *args, "--port", str(port), "--log-format", "json"]
    os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)  # --log-dir may be new
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"pipeline-serve exited; see {log_path}")
                with contextlib.suppress(OSError):
                    if _get(port, "/health") == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"pipeline-serve did not become ready; see {log_path}")
                time.sleep(0.2)
            yield f"http://127.0.0.1:{port}"
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(60)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def run_spec_bench(args: SpecBenchArgs, log_dir: str) -> dict[str, Any]:
    common = ([args.model] if args.model else []) + [
        "--threads",
        str(args.threads),
        *args.extra_server_args,
    ]
    on_args = [*common, "--speculative-config", args.speculative_config]
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as servers:
        on_url = off_url = ""
        for repeat in range(args.repeats):
            if repeat == 0 or args.fresh_servers:
                servers.close()  # the last pair's, if any
                on_url = servers.enter_context(
                    _server(on_args, args.port, os.path.join(log_dir, "spec-on.log"))
                )
                off_url = servers.enter_context(
                    _server(common, args.port + 1, os.path.join(log_dir, "spec-off.log"))
                )
            # Alternate which server goes first in each pair, so that drift favours neither.
            urls = (on_url, off_url) if repeat % 2 == 0 else (off_url, on_url)
            for workload, concurrency, requests, measure, goal in CASES:
                print(
                    f"[spec bench] {workload} c={concurrency} ({repeat + 1}/{args.repeats})",
                    file=sys.stderr,
                    flush=True,
                )
                report, _ = asyncio.run(
                    serve_bench.run_serve(
                        serve_bench.ServeArgs(
                            urls=urls,
                            concurrency=(concurrency,),
                            num_requests=requests,
                            max_tokens=args.max_tokens,
                            workload=workload,
                        )
                    )
                )
                by_url = {run["url"]: run for run in report["runs"]}
                rows.append(
                    _row(workload, concurrency, measure, goal, by_url[on_url], by_url[off_url])
                )
    return {"speculative_config": args.speculative_config, "rows": rows}


def _row(
    workload: str, concurrency: int, measure: str, goal: float, on: dict, off: dict
) -> dict[str, Any]:
    if measure == "itl_p50":
        ratio = on["itl_ms"]["p50"] / off["itl_ms"]["p50"] if off["itl_ms"]["p50"] else 0.0
        met = ratio <= goal
    else:
        ratio = on[measure] / off[measure] if off[measure] else 0.0
        met = ratio >= goal
    spec = on.get("speculative_decoding", {})
    return {
        "workload": workload,
        "concurrency": concurrency,
        "measure": measure,
        "goal": goal,
        "ratio": ratio,
        "met": met,
        "on": _figures(on),
        "off": _figures(off),
        "acceptance_rate": spec.get("acceptance_rate", 0.0),
        "mean_acceptance_length": spec.get("mean_acceptance_length", 0.0),
        "num_draft_tokens": spec.get("num_draft_tokens", 0.0),
    }


def _figures(run: dict) -> dict[str, float]:
    return {
        "output_tok_per_s": run["output_tok_per_s"],
        "ttft_p50_ms": run["ttft_ms"]["p50"],
        "itl_p50_ms": run["itl_ms"]["p50"],
        "itl_p99_ms": run["itl_ms"]["p99"],
        "errors": run["errors"],
    }


def format_table(report: dict[str, Any]) -> str:
    header = (
        "| workload | c | measure | on / off | goal | on tok/s | off tok/s | accepted | mean len "
        "| TTFT p50 on/off (ms) | ITL p50 on/off (ms) | ITL p99 on/off (ms) |"
    )
    lines = [header, "|" + "---|" * 12]
    for row in report["rows"]:
        on, off = row["on"], row["off"]
        goal = ("<= " if row["measure"] == "itl_p50" else ">= ") + f"{row['goal']:g}"
        lines.append(
            f"| {row['workload']} | {row['concurrency']} | {row['measure']} | "
            f"{row['ratio']:.2f}{'' if row['met'] else ' (missed)'} | {goal} | "
            f"{on['output_tok_per_s']:.1f} | {off['output_tok_per_s']:.1f} | "
            f"{row['acceptance_rate']:.0%} | {row['mean_acceptance_length']:.2f} | "
            f"{on['ttft_p50_ms']:.0f} / {off['ttft_p50_ms']:.0f} | "
            f"{on['itl_p50_ms']:.1f} / {off['itl_p50_ms']:.1f} | "
            f"{on['itl_p99_ms']:.1f} / {off['itl_p99_ms']:.1f} |"
        )
    return "\n".join(lines)


# -- the ceiling ---------------------------------------------------------------------------------


def run_ceiling(args: SpecBenchArgs, log_dir: str, weights: str = "int4") -> dict[str, Any]:
    """The most the grounded cases' ratios can reach with this model, method and CPU: each
    request's greedy output (from a server without speculation) replayed through the method's
    proposer (perf/spec_replay.py), priced with the verification cost measured on the model at
    the case's batch (`pipeline-bench model --verify-drafts`, context 256)."""
    from perf import model_bench, spec_replay
    from stages.config import default_model_path
    from stages.speculative_config import SpeculativeConfig

    spec = SpeculativeConfig.parse(args.speculative_config)
    if spec.drafts_with_a_model:
        raise ValueError("--ceiling replays model-free methods (ngram, suffix), not a draft model")
    k = spec.num_speculative_tokens
    cases = [(c, n) for workload, c, n, _, _ in CASES if workload == "grounded"]
    print("[spec ceiling] verification cost on the model ...", file=sys.stderr, flush=True)
    bench = model_bench.run_model_bench(
        model_bench.ModelBenchArgs(
            model_path=args.model or default_model_path(),
            weights=(weights,),
            batches=tuple(c for c, _ in cases),
            steps=20,
            threads=args.threads,
            baseline=False,
            verify_drafts=k,
        )
    )
    cost = {
        row["batch"]: row["decode_steps"] for row in bench["rows"] if row["mode"] == f"verify{k}"
    }
    common = [*([args.model] if args.model else []), "--threads", str(args.threads)]
    common += args.extra_server_args
    rows = []
    with _server(common, args.port, os.path.join(log_dir, "spec-off.log")) as url:
        for concurrency, count in cases:
            print(f"[spec ceiling] grounded c={concurrency}: greedy outputs", file=sys.stderr)
            work = serve_bench.grounded(count, args.max_tokens, seed=0)  # the bench's prompts
            outputs = asyncio.run(_greedy_outputs(url, work.prompts, args.max_tokens))
            requests = [(out.prompt_ids, out.output_ids) for out in outputs]
            each = spec_replay.replay_each(
                spec, requests, spec_replay.linear_cost(cost[concurrency], k)
            )
            row = {
                "workload": "grounded",
                "concurrency": concurrency,
                "verify_decode_steps": cost[concurrency],
                **spec_replay.summed(each).summary(),
            }
            if concurrency == 1:  # one request at a time, as these were timed
                timings = [(out.ttft_s, out.e2e_s) for out in outputs]
                row["prefill_share"] = sum(t for t, _ in timings) / sum(e for _, e in timings)
                row["ratio_with_prefill"] = spec_replay.with_prefill(each, timings)
                row["oracle_ratio_with_prefill"] = spec_replay.with_prefill(each, timings, True)
            rows.append(row)
    return {"speculative_config": args.speculative_config, "weights": weights, "rows": rows}


@dataclass(frozen=True, slots=True)
class GreedyOutput:
    prompt_ids: Any  # [P] int32
    output_ids: Any  # [O] int32
    ttft_s: float  # to the chunk with the first output token
    e2e_s: float


async def _greedy_outputs(
    url: str, prompts: list[list[dict[str, str]]], max_tokens: int
) -> list[GreedyOutput]:
    """Each prompt's greedy completion, streamed one after another as the bench's load generator
    asks grounded requests at c=1 (they end at EOS or max_tokens), with its timings."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        model = await serve_bench.served_model(session, url, None)
        outputs = []
        for messages in prompts:
            body = {
                "model": model,
                "messages": messages,
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
                "return_token_ids": True,
            }
            started = time.perf_counter()
            async with session.post(f"{url}/v1/chat/completions", json=body) as response:
                response.raise_for_status()
                outputs.append(await _read_stream(response, started))
    return outputs


async def _read_stream(response: Any, started: float) -> GreedyOutput:
    import numpy as np

    prompt: list[int] = []
    output: list[int] = []
    first = 0.0
    async for raw in response.content:
        line = raw.strip()
        if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
            continue
        chunk = json.loads(line[5:])
        if "error" in chunk:  # a cut-off output would replay as a shorter, faster one
            raise RuntimeError(f"the greedy output failed: {chunk['error']}")
        prompt = chunk.get("prompt_token_ids") or prompt
        for choice in chunk.get("choices") or ():
            ids = choice.get("token_ids") or ()
            if ids and not first:
                first = time.perf_counter() - started
            output.extend(ids)
    return GreedyOutput(
        np.asarray(prompt, np.int32),
        np.asarray(output, np.int32),
        first,
        time.perf_counter() - started,
    )


def format_ceiling(report: dict[str, Any]) -> str:
    lines = [
        "| workload | c | verify k (decode steps) | steps with a proposal | accepted | tokens per step "
        "| ceiling, every proposal | ceiling, perfect draft length "
        "| with prefill (c=1): every proposal / perfect |",
        "|" + "---|" * 9,
    ]
    goals = {c: goal for w, c, _, _, goal in CASES if w == "grounded"}
    for row in report["rows"]:
        goal = goals.get(row["concurrency"])
        prefill = "-"
        if "ratio_with_prefill" in row:
            prefill = (
                f"{row['ratio_with_prefill']:.2f}x / {row['oracle_ratio_with_prefill']:.2f}x "
                f"(TTFT {row['prefill_share']:.0%} of the time off)"
            )
        lines.append(
            f"| {row['workload']} | {row['concurrency']} | {row['verify_decode_steps']:.2f} | "
            f"{row['steps_with_proposal']:.0%} | {row['acceptance_rate']:.0%} | "
            f"{row['tokens_per_step']:.2f} | {row['ratio']:.2f}x | {row['oracle_ratio']:.2f}x"
            + (f" (goal {goal:g}x)" if goal else "")
            + f" | {prefill} |"
        )
    return "\n".join(lines)
