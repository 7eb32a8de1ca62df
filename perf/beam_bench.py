"""`pipeline-bench beam`: beam search (width 4) against n = 4 sampling on one server, interleaved.

Starts one `pipeline-serve` (SmolLM2 Q4_1 unless a model is given) and, at each concurrency, runs
batches of requests of each kind in alternation (which goes first alternates too), every request
asking for 4 choices of `max_tokens` tokens with ignore_eos, so both kinds produce the same
tokens. Output tok/s counts every choice's tokens; the table shows beam / sampling per level.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from statistics import median
from typing import Any

from perf.spec_bench import _server

KINDS = ("beam", "sampling")
WORDS = [
    "river",
    "stone",
    "light",
    "garden",
    "paper",
    "window",
    "music",
    "silver",
    "morning",
    "forest",
    "cloud",
    "bridge",
]


@dataclass(frozen=True, slots=True)
class BeamBenchArgs:
    model: str | None = None  # None: the default model
    width: int = 4
    concurrency: tuple[int, ...] = (1, 8)
    requests_per_batch: int = 0  # 0: the concurrency, at least 2
    repeats: int = 3  # batch pairs per level
    max_tokens: int = 64
    prompt_words: int = 120
    port: int = 8630
    threads: int = 2


def _prompt(index: int, words: int) -> str:
    """A prompt of its own per request (a number first), so no two share cached blocks."""
    body = " ".join(WORDS[(index * 7 + i * 5) % len(WORDS)] for i in range(words))
    return f"Request {index}. Continue this list of words: {body}"


def _body(kind: str, index: int, args: BeamBenchArgs) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": _prompt(index, args.prompt_words),
        "n": args.width,
        "max_tokens": args.max_tokens,
        "ignore_eos": True,
    }
    if kind == "beam":
        body["use_beam_search"] = True
    else:
        body["temperature"] = 1.0
        body["seed"] = index
    return body


def _post(url: str, body: dict[str, Any]) -> tuple[int, float]:
    """(output tokens of all choices, seconds)."""
    request = urllib.request.Request(
        url + "/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        answer = json.loads(response.read())
    return int(answer["usage"]["completion_tokens"]), time.perf_counter() - started


def _batch(url: str, kind: str, concurrency: int, first: int, args: BeamBenchArgs) -> dict:
    count = args.requests_per_batch or max(2, concurrency)
    bodies = [_body(kind, first + i, args) for i in range(count)]
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(lambda body: _post(url, body), bodies))
    elapsed = time.perf_counter() - started
    tokens = sum(t for t, _ in done)
    return {
        "output_tokens": tokens,
        "elapsed_s": elapsed,
        "output_tok_per_s": tokens / elapsed,
        "latency_p50_s": median(s for _, s in done),
    }


def run_beam_bench(args: BeamBenchArgs, log_dir: str) -> dict[str, Any]:
    server_args = ([args.model] if args.model else []) + ["--threads", str(args.threads)]
    rows = []
    with _server(server_args, args.port, os.path.join(log_dir, "beam-bench.log")) as url:
        _batch(url, "beam", 1, 10_000, BeamBenchArgs(requests_per_batch=1, max_tokens=4))
        _batch(url, "sampling", 1, 10_001, BeamBenchArgs(requests_per_batch=1, max_tokens=4))
        index = 0
        for concurrency in args.concurrency:
            runs: dict[str, list[dict]] = {kind: [] for kind in KINDS}
            for repeat in range(args.repeats):
                order = KINDS if repeat % 2 == 0 else KINDS[::-1]
                for kind in order:
                    print(
                        f"[beam bench] {kind} c={concurrency} ({repeat + 1}/{args.repeats})",
                        file=sys.stderr,
                        flush=True,
                    )
                    run = _batch(url, kind, concurrency, index, args)
                    index += 1000
                    runs[kind].append(run)
            rows.append(_row(concurrency, runs))
    return {"width": args.width, "max_tokens": args.max_tokens, "rows": rows}


def _row(concurrency: int, runs: dict[str, list[dict]]) -> dict[str, Any]:
    """Totals over the batches of each kind (tokens over time), and beam / sampling."""
    rate = {
        kind: sum(r["output_tokens"] for r in runs[kind]) / sum(r["elapsed_s"] for r in runs[kind])
        for kind in KINDS
    }
    return {
        "concurrency": concurrency,
        "beam_tok_per_s": rate["beam"],
        "sampling_tok_per_s": rate["sampling"],
        "ratio": rate["beam"] / rate["sampling"] if rate["sampling"] else 0.0,
        "beam_latency_p50_s": median(r["latency_p50_s"] for r in runs["beam"]),
        "sampling_latency_p50_s": median(r["latency_p50_s"] for r in runs["sampling"]),
        "batches": runs,
    }


def format_table(report: dict[str, Any]) -> str:
    lines = [
        f"width {report['width']}, {report['max_tokens']} tokens per choice",
        "| c | beam tok/s | n=4 sampling tok/s | beam / sampling | request p50 beam / sampling (s) |",
        "|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        lines.append(
            f"| {row['concurrency']} | {row['beam_tok_per_s']:.1f} | "
            f"{row['sampling_tok_per_s']:.1f} | {row['ratio']:.2f} | "
            f"{row['beam_latency_p50_s']:.2f} / {row['sampling_latency_p50_s']:.2f} |"
        )
    return "\n".join(lines)
