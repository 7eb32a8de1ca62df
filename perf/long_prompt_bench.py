"""`pipeline-bench long-prompt`: what one long prompt costs the streams already running.

`--streams` closed-loop greedy streams run; after a settling time a prompt of `--prompt-tokens`
arrives. The streams' output tok/s is measured before it arrives, while it prefills (until its
first token) and after, with its time to first token, once for each `--long-prefill-share`
given (1: no limit, the old policy), each on an engine of its own, in alternating order over
`--rounds`.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class LongPromptArgs:
    model_path: str
    shares: tuple[float, ...] = (1 / 3, 1.0)
    streams: int = 8
    prompt_tokens: int = 4000
    stream_tokens: int = 32  # each stream request's max_tokens (closed loop: the next follows)
    settle_s: float = 5.0  # streams alone before the long prompt, and after its first token
    long_prefill_token_threshold: int = 512
    threads: int = 0
    rounds: int = 1


async def measure_one(args: LongPromptArgs, share: float) -> dict[str, Any]:
    from pipeline.clock import now_ns
    from stages.api import GenerateRequest, SamplingParams, TextPrompt, TokensPrompt
    from stages.config import EngineConfig
    from stages.engine import Engine

    engine = Engine(
        EngineConfig(
            model_path=args.model_path,
            threads=args.threads,
            max_num_seqs=args.streams + 1,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            long_prefill_share=share,
            enable_prefix_caching=False,
            log_format="json",
            log_level="error",
        )
    )
    await engine.start()
    vocab = engine.model_info.vocab_size
    emitted: list[float] = []  # when each stream token arrived (monotonic s)
    done = asyncio.Event()

    async def stream(w: int) -> None:
        serial = 0
        while not done.is_set():
            words = " ".join(f"w{(w * 7 + serial + k) % 50}" for k in range(12))
            request = GenerateRequest(
                f"s{w}-{serial}",
                TextPrompt(f"Stream {w}: {words}"),
                SamplingParams(temperature=0.0, max_tokens=args.stream_tokens, ignore_eos=True),
                arrival_ns=now_ns(),
            )
            async for out in engine.generate(request):
                emitted.extend([time.monotonic()] * len(out.token_ids))
            serial += 1

    async def long_prompt() -> tuple[float, float]:
        await asyncio.sleep(args.settle_s)
        ids = random.Random(0).choices(range(10, vocab), k=args.prompt_tokens)
        request = GenerateRequest(
            "long",
            TokensPrompt(ids),
            SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
            arrival_ns=now_ns(),
        )
        arrived = time.monotonic()
        first = 0.0
        async for _ in engine.generate(request):
            first = first or time.monotonic()
        await asyncio.sleep(args.settle_s)
        done.set()
        return arrived, first

    try:
        started = time.monotonic()
        results = await asyncio.gather(long_prompt(), *(stream(w) for w in range(args.streams)))
        arrived, first = results[0]
        ended = time.monotonic()
    finally:
        await engine.stop()

    def rate(start: float, end: float) -> float:
        return sum(start <= t < end for t in emitted) / max(end - start, 1e-9)

    warm = started + 1.0  # the first second starts the streams
    return {
        "long_prefill_share": share,
        "streams_tok_s_before": rate(warm, arrived),
        "streams_tok_s_during": rate(arrived, first),
        "streams_tok_s_after": rate(first, ended),
        "long_prompt_ttft_s": first - arrived,
    }


def run_long_prompt_bench(args: LongPromptArgs) -> dict[str, Any]:
    """Each share's passes, alternating which goes first, and their medians."""
    passes: dict[float, list[dict[str, Any]]] = {share: [] for share in args.shares}
    for round_ in range(args.rounds):
        order = args.shares if round_ % 2 == 0 else tuple(reversed(args.shares))
        for share in order:
            passes[share].append(asyncio.run(measure_one(args, share)))
    rows = []
    for share, runs in passes.items():
        row: dict[str, Any] = {"long_prefill_share": share, "passes": len(runs)}
        for key in runs[0]:
            if key != "long_prefill_share":
                row[key] = sorted(run[key] for run in runs)[len(runs) // 2]
        rows.append(row)
    return {
        "model": args.model_path,
        "streams": args.streams,
        "prompt_tokens": args.prompt_tokens,
        "rows": rows,
        "passes": {str(share): runs for share, runs in passes.items()},
    }


def format_table(report: dict[str, Any]) -> str:
    lines = [
        f"{report['streams']} streams, one prompt of {report['prompt_tokens']} tokens arriving",
        f"{'share':>7}{'before tok/s':>14}{'during':>9}{'after':>9}{'during/before':>15}"
        f"{'long TTFT s':>13}",
    ]
    for row in report["rows"]:
        before = row["streams_tok_s_before"]
        lines.append(
            f"{row['long_prefill_share']:>7.2f}{before:>14.1f}{row['streams_tok_s_during']:>9.1f}"
            f"{row['streams_tok_s_after']:>9.1f}"
            f"{row['streams_tok_s_during'] / max(before, 1e-9):>14.2f}x"
            f"{row['long_prompt_ttft_s']:>13.1f}"
        )
    return "\n".join(lines)
