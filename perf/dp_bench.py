"""`pipeline-bench dp`: data-parallel routing, cache-aware against round robin, in one run.

Starts two `pipeline-serve --data-parallel-size 2` servers on the same model, one per routing
policy, each replica's KV cache sized to hold about half of the workload's shared prefixes. The
workload is chat requests that each start with one of `groups` long system prompts (a tenant's
instructions, a RAG document) and end with a question of their own. Both servers are driven by
`pipeline-bench serve`'s load generator in turns (order alternated per repeat), each after
/reset_prefix_cache, and compared on the prefix-cache hit rate (from the `engine`-labelled
/metrics counters) and throughput. Prints the table and writes the JSON.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import json
import os
import random
import re
import sys
from dataclasses import dataclass
from typing import Any

from perf import serve_bench
from perf.spec_bench import _server

POLICIES = ("cache_aware", "round_robin")
_COUNTER = re.compile(r'^vllm:(prefix_cache_(?:queries|hits))_total\{engine="(\d+)"[^}]*\} (\S+)$')


@dataclass(frozen=True, slots=True)
class DpBenchArgs:
    model: str | None = None  # None: the default model
    groups: int = 12  # distinct shared prefixes
    prefix_words: int = 300  # about 400 SmolLM2 tokens, 25 KV blocks of 16
    question_words: int = 12
    num_requests: int = 48
    concurrency: int = 4
    max_tokens: int = 8
    # per replica: about 7 of the 12 prefixes beside the running requests (SmolLM2's bfloat16
    # KV block is 360 KiB)
    kv_cache_memory: str = "80MiB"
    repeats: int = 2
    port: int = 8620
    seed: int = 0
    extra_server_args: tuple[str, ...] = ()


def workload(args: DpBenchArgs, seed: int) -> list[dict[str, Any]]:
    """JSONL rows ({messages, max_tokens}): each request one group's system prompt and a
    question of its own, groups drawn at random."""
    rng = random.Random(seed)
    words = serve_bench.WORDS
    prefixes = [
        f"Group {g}. " + " ".join(rng.choice(words) for _ in range(args.prefix_words))
        for g in range(args.groups)
    ]
    rows = []
    for i in range(args.num_requests):
        question = " ".join(rng.choice(words) for _ in range(args.question_words))
        messages = [
            {"role": "system", "content": rng.choice(prefixes)},
            {"role": "user", "content": f"Question {i}: {question}?"},
        ]
        rows.append({"messages": messages, "max_tokens": args.max_tokens})
    return rows


def parse_cache_counters(text: str) -> dict[int, tuple[float, float]]:
    """Per engine (queried prompt tokens, of which found cached) from a /metrics page."""
    found: dict[int, dict[str, float]] = {}
    for line in text.splitlines():
        match = _COUNTER.match(line)
        if match is not None:
            found.setdefault(int(match[2]), {})[match[1]] = float(match[3])
    return {
        engine: (values.get("prefix_cache_queries", 0.0), values.get("prefix_cache_hits", 0.0))
        for engine, values in sorted(found.items())
    }


def cache_summary(
    before: dict[int, tuple[float, float]], after: dict[int, tuple[float, float]]
) -> dict[str, Any]:
    """The run's hit rate over all replicas and the prompt tokens each replica was sent."""
    queries = {e: after[e][0] - before.get(e, (0.0, 0.0))[0] for e in after}
    hits = {e: after[e][1] - before.get(e, (0.0, 0.0))[1] for e in after}
    total = sum(queries.values())
    return {
        "prefix_cache_hit_rate": sum(hits.values()) / total if total else 0.0,
        "prompt_tokens_per_engine": [queries[e] for e in sorted(queries)],
    }


def _http(port: int, method: str, path: str) -> str:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request(method, path)
        response = connection.getresponse()
        body = response.read().decode()
        if response.status != 200:
            raise RuntimeError(f"{method} {path}: {response.status} {body}")
        return body
    finally:
        connection.close()


def run_dp_bench(args: DpBenchArgs, log_dir: str) -> dict[str, Any]:
    common = [
        *([args.model] if args.model else []),
        "--data-parallel-size",
        "2",
        "--kv-cache-memory",
        args.kv_cache_memory,
        "--max-model-len",
        "2048",  # a small cache has to hold one request of max_model_len
        *args.extra_server_args,
    ]
    ports = {policy: args.port + i for i, policy in enumerate(POLICIES)}
    runs: list[dict[str, Any]] = []
    with (
        _server(
            [*common, "--data-parallel-routing", POLICIES[0]],
            ports[POLICIES[0]],
            os.path.join(log_dir, "dp-cache-aware.log"),
        ) as aware_url,
        _server(
            [*common, "--data-parallel-routing", POLICIES[1]],
            ports[POLICIES[1]],
            os.path.join(log_dir, "dp-round-robin.log"),
        ) as robin_url,
    ):
        urls = {POLICIES[0]: aware_url, POLICIES[1]: robin_url}
        for repeat in range(args.repeats):
            dataset = os.path.join(log_dir, f"dp-workload-{repeat}.jsonl")
            with open(dataset, "w") as f:
                for row in workload(args, args.seed + repeat):
                    f.write(json.dumps(row) + "\n")
            order = POLICIES if repeat % 2 == 0 else POLICIES[::-1]
            for policy in order:
                print(f"[dp bench] {policy} ({repeat + 1}/{args.repeats})", file=sys.stderr)
                port = ports[policy]
                _http(port, "POST", "/reset_prefix_cache")
                before = parse_cache_counters(_http(port, "GET", "/metrics"))
                report, _ = asyncio.run(
                    serve_bench.run_serve(
                        serve_bench.ServeArgs(
                            urls=(urls[policy],),
                            concurrency=(args.concurrency,),
                            num_requests=args.num_requests,
                            max_tokens=args.max_tokens,
                            dataset=dataset,
                            warmup=0,
                        )
                    )
                )
                after = parse_cache_counters(_http(port, "GET", "/metrics"))
                run = report["runs"][0]
                runs.append(
                    {
                        "policy": policy,
                        "repeat": repeat,
                        **cache_summary(before, after),
                        "output_tok_per_s": run["output_tok_per_s"],
                        "request_per_s": run["request_per_s"],
                        "ttft_p50_ms": run["ttft_ms"]["p50"],
                        "errors": run["errors"],
                    }
                )
    return {"args": dataclasses.asdict(args), "runs": runs, "ratios": ratios(runs)}


def ratios(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Cache-aware over round robin, each repeat's pair, averaged over the repeats."""
    pairs: dict[int, dict[str, dict[str, Any]]] = {}
    for run in runs:
        pairs.setdefault(run["repeat"], {})[run["policy"]] = run
    out: dict[str, list[float]] = {}
    for pair in pairs.values():
        aware, robin = pair.get(POLICIES[0]), pair.get(POLICIES[1])
        if aware is None or robin is None:
            continue
        for measure in ("prefix_cache_hit_rate", "request_per_s", "ttft_p50_ms"):
            if robin[measure]:
                out.setdefault(measure, []).append(aware[measure] / robin[measure])
    return {measure: sum(values) / len(values) for measure, values in out.items()}


def format_table(report: dict[str, Any]) -> str:
    lines = [
        "| routing | repeat | prefix cache hits | prompt tokens per engine | req/s | out tok/s "
        "| TTFT p50 (ms) | errors |",
        "|" + "---|" * 8,
    ]
    for run in report["runs"]:
        per_engine = " / ".join(f"{tokens:.0f}" for tokens in run["prompt_tokens_per_engine"])
        lines.append(
            f"| {run['policy']} | {run['repeat'] + 1} | {run['prefix_cache_hit_rate']:.1%} | "
            f"{per_engine} | {run['request_per_s']:.2f} | {run['output_tok_per_s']:.1f} | "
            f"{run['ttft_p50_ms']:.0f} | {run['errors']} |"
        )
    ratio = report["ratios"]
    if ratio:
        lines.append("")
        lines.append(
            "cache-aware / round robin: "
            + ", ".join(f"{measure} {value:.2f}x" for measure, value in ratio.items())
        )
    return "\n".join(lines)
