"""`pipeline-bench serve`: an OpenAI streaming load generator for any compatible server.

Closed loop (a fixed number of requests in flight, swept over `--concurrency`) or open loop
(Poisson arrivals at `--request-rate`). Each request streams a chat completion and records when
each chunk arrives: TTFT is the first content chunk, ITL the gaps between content chunks, TPOT the
decode time per output token after the first, E2E the whole request. `--compare URL2` runs the same
load against a second server, interleaved run by run, and prints ratios.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from perf.attribution import attribution
from perf.pipeline_stats import gantt_spans, overhead_per_token, stage_figures
from perf.stats import percentiles_ms
from pipeline.trace import SPAN

WORDS = [
    "time",
    "person",
    "year",
    "way",
    "day",
    "thing",
    "man",
    "world",
    "life",
    "hand",
    "part",
    "child",
    "eye",
    "woman",
    "place",
    "work",
    "week",
    "case",
    "point",
    "government",
    "company",
    "number",
    "group",
    "problem",
    "fact",
    "river",
    "mountain",
    "ocean",
    "forest",
    "garden",
    "kitchen",
    "window",
    "music",
    "science",
    "history",
    "engine",
    "pipeline",
    "memory",
    "process",
    "signal",
    "ring",
    "token",
    "stream",
    "server",
]


@dataclass(frozen=True, slots=True)
class Workload:
    prompts: list[list[dict[str, str]]]  # chat messages per request
    max_tokens: list[int]


@dataclass(slots=True)
class RequestResult:
    ok: bool
    start_s: float
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""
    stage_ms: dict[str, float] = field(
        default_factory=dict
    )  # from the server's per-request metrics

    @property
    def tpot_s(self) -> float:
        if self.output_tokens <= 1:
            return 0.0
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_ms: float | None = None
    itl_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> Slo | None:
        if not text:
            return None
        values: dict[str, float] = {}
        for part in text.split(","):
            key, _, value = part.partition("=")
            if key not in ("ttft", "itl", "tpot", "e2e"):
                raise ValueError(f"unknown SLO {key!r}: use ttft, itl, tpot, e2e (milliseconds)")
            values[f"{key}_ms"] = float(value)
        return cls(**values)

    def met(self, r: RequestResult) -> bool:
        checks = (
            (self.ttft_ms, r.ttft_s),
            (self.itl_ms, max(r.itl_s, default=0.0)),
            (self.tpot_ms, r.tpot_s),
            (self.e2e_ms, r.e2e_s),
        )
        return r.ok and all(limit is None or value * 1e3 <= limit for limit, value in checks)


def synthetic(
    num_requests: int, prompt_tokens: int, max_tokens: int, seed: int, tokens_per_word: float
) -> Workload:
    """Random-word prompts of about prompt_tokens tokens (calibrated), deterministic by seed."""
    rng = random.Random(seed)
    words = max(1, round(prompt_tokens / tokens_per_word))
    prompts = [
        [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(words))}]
        for _ in range(num_requests)
    ]
    return Workload(prompts, [max_tokens] * num_requests)


def grounded(num_requests: int, max_tokens: int, seed: int) -> Workload:
    """Requests whose answer repeats the prompt: copy a function of this project's own source,
    given in the prompt (the edit-and-echo work where prompt lookup pays). Deterministic by seed;
    nothing is downloaded."""
    rng = random.Random(seed)
    passages = _functions_of_the_project()
    prompts = []
    for _ in range(num_requests):
        source = rng.choice(passages)
        prompts.append(
            [
                {
                    "role": "user",
                    "content": "Copy this Python function exactly, line for line:\n\n"
                    f"```python\n{source}\n```",
                }
            ]
        )
    return Workload(prompts, [max_tokens] * num_requests)


def _functions_of_the_project() -> list[str]:
    """Top-level functions of stages/ and server/ between 300 and 900 characters (about 80-250
    tokens), in a fixed order."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    found = []
    for package in ("stages", "server"):
        for path in sorted((root / package).rglob("*.py")):
            text = path.read_text()
            for node in ast.parse(text).body:
                if isinstance(node, ast.FunctionDef):
                    source = ast.get_source_segment(text, node) or ""
                    if 300 <= len(source) <= 900:
                        found.append(source)
    if not found:
        raise RuntimeError(f"no functions found under {root} for the grounded workload")
    return found


def from_jsonl(path: str, num_requests: int, max_tokens: int) -> Workload:
    """Chat requests from a JSONL file: each line has `messages` and optionally `max_tokens`."""
    prompts, limits = [], []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            prompts.append(row["messages"])
            limits.append(int(row.get("max_tokens", max_tokens)))
    if num_requests:
        prompts, limits = prompts[:num_requests], limits[:num_requests]
    return Workload(prompts, limits)


class Client:
    """Streams chat completions from one server."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        model: str,
        api_key: str | None,
        ignore_eos: bool,
        temperature: float = 0.0,
    ) -> None:
        self.session = session
        self.url = url.rstrip("/")
        self.model = model
        self.headers = _auth(api_key)
        self.ignore_eos = ignore_eos
        self.temperature = temperature

    async def chat(self, messages: list[dict[str, str]], max_tokens: int) -> RequestResult:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        result, unsent = await self._stream(body)
        if unsent:
            # A pooled keep-alive connection the server had closed (llama-server closes idle
            # ones after 5 s, and an interleaved --compare leaves them idle that long) fails as
            # the request is written: it never reached the server, so it goes again, once, on a
            # fresh connection.
            result, _ = await self._stream(body)
        return result

    async def _stream(self, body: dict[str, Any]) -> tuple[RequestResult, bool]:
        """The request's result, and whether it failed before it was written whole."""
        start = time.perf_counter()
        result = RequestResult(ok=False, start_s=start)
        last = start
        try:
            async with self.session.post(
                f"{self.url}/v1/chat/completions", json=body, headers=self.headers
            ) as resp:
                if resp.status != 200:
                    result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    return result, False
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        result.error = str(chunk["error"])[:200]
                        return result, False
                    now = time.perf_counter()
                    stages = (chunk.get("metrics") or {}).get("stage_time_ms")
                    if stages:
                        result.stage_ms = {k: float(v) for k, v in stages.items()}
                    if chunk.get("usage"):
                        result.output_tokens = chunk["usage"].get("completion_tokens", 0)
                        result.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
                    choices = chunk.get("choices") or []
                    if choices and (choices[0].get("delta") or {}).get("content"):
                        if result.ttft_s == 0.0:
                            result.ttft_s = now - start
                        else:
                            result.itl_s.append(now - last)
                        last = now
        except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            unsent = isinstance(exc, aiohttp.ClientOSError) and "write request body" in str(exc)
            return result, unsent
        result.e2e_s = time.perf_counter() - start
        if result.output_tokens == 0:
            result.output_tokens = len(result.itl_s) + (1 if result.ttft_s else 0)
        result.ok = result.ttft_s > 0
        if not result.ok:
            result.error = "no content streamed"
        return result, False


async def closed_loop(
    client: Client, work: Workload, concurrency: int, progress: Progress
) -> list[RequestResult]:
    queue = list(range(len(work.prompts)))
    queue.reverse()
    results: list[RequestResult] = []

    async def worker() -> None:
        while queue:
            i = queue.pop()
            results.append(await client.chat(work.prompts[i], work.max_tokens[i]))
            progress.tick()

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(queue)))))
    return results


async def open_loop(
    client: Client, work: Workload, rate: float, seed: int, progress: Progress
) -> list[RequestResult]:
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, len(work.prompts))
    tasks = []

    async def one(i: int) -> RequestResult:
        r = await client.chat(work.prompts[i], work.max_tokens[i])
        progress.tick()
        return r

    for i, gap in enumerate(gaps):
        tasks.append(asyncio.create_task(one(i)))
        await asyncio.sleep(gap)
    return list(await asyncio.gather(*tasks))


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done = label, total, 0
        self.started = time.perf_counter()
        self._shown = 0.0
        self.show()

    def tick(self) -> None:
        self.done += 1
        now = time.perf_counter()
        if now - self._shown > 0.25 or self.done == self.total:
            self.show()

    def show(self) -> None:
        self._shown = time.perf_counter()
        width = 30
        filled = int(width * self.done / max(1, self.total))
        elapsed = self._shown - self.started
        sys.stderr.write(
            f"\r{self.label:<28} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {elapsed:6.1f}s"
        )
        if self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def summarize(
    results: Sequence[RequestResult], wall_s: float, cpu_s: float, slo: Slo | None
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "duration_s": wall_s,
        "request_per_s": len(ok) / wall_s if wall_s else 0.0,
        "output_tok_per_s": out_tokens / wall_s if wall_s else 0.0,
        "mean_prompt_tokens": float(np.mean([r.prompt_tokens for r in ok])) if ok else 0.0,
        "mean_output_tokens": float(np.mean([r.output_tokens for r in ok])) if ok else 0.0,
        "ttft_ms": percentiles_ms([r.ttft_s for r in ok]),
        "itl_ms": percentiles_ms([g for r in ok for g in r.itl_s]),
        "tpot_ms": percentiles_ms([r.tpot_s for r in ok if r.output_tokens > 1]),
        "e2e_ms": percentiles_ms([r.e2e_s for r in ok]),
        "client_cpu_s": cpu_s,
        "client_cpu_fraction": cpu_s / wall_s if wall_s else 0.0,
        "error_samples": sorted({r.error for r in results if not r.ok})[:3],
    }
    stage_names = sorted({name for r in ok for name in r.stage_ms})
    if (
        stage_names
    ):  # the server sends per-request metrics (pipeline-serve --enable-per-request-metrics)
        summary["request_stage_ms"] = {
            name: percentiles_ms([r.stage_ms.get(name, 0.0) / 1e3 for r in ok])
            for name in stage_names
        }
    if slo is not None:
        good = [r for r in results if slo.met(r)]
        summary["goodput_req_per_s"] = len(good) / wall_s if wall_s else 0.0
        summary["slo_attainment"] = len(good) / len(results) if results else 0.0
    return summary


SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
)


async def fetch_spec_counters(
    session: aiohttp.ClientSession, url: str, api_key: str | None
) -> dict[str, float] | None:
    """The speculative-decoding counters on /metrics (vLLM's names), summed over label sets;
    None when the server exports none (speculation off, or not a vLLM-compatible server)."""
    try:
        async with session.get(f"{url.rstrip('/')}/metrics", headers=_auth(api_key)) as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
    except aiohttp.ClientError:
        return None
    return parse_spec_counters(text)


def parse_spec_counters(text: str) -> dict[str, float] | None:
    """SPEC_COUNTERS' values in a Prometheus text page, summed over label sets; None unless all
    are there."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in SPEC_COUNTERS:
            found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found if len(found) == len(SPEC_COUNTERS) else None


def spec_summary(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """A run's acceptance from the counters' deltas, as vLLM reports it: the share of drafted
    tokens accepted, and tokens per verification step (accepted + 1)."""
    drafts, tokens, accepted = (after[n] - before[n] for n in SPEC_COUNTERS)
    return {
        "num_drafts": drafts,
        "num_draft_tokens": tokens,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / tokens if tokens else 0.0,
        "mean_acceptance_length": 1.0 + accepted / drafts if drafts else 0.0,
    }


async def fetch_profile(
    session: aiohttp.ClientSession, url: str, api_key: str | None
) -> tuple[dict[str, np.ndarray], dict[str, float]] | None:
    """Spans since the last read and CPU seconds from pipeline-serve's /debug/profile, if it has one."""
    async with session.get(f"{url.rstrip('/')}/debug/profile", headers=_auth(api_key)) as resp:
        if resp.status != 200:
            return None
        body = await resp.json()
    spans = {}
    for stage, columns in body["stages"].items():
        records = np.zeros(len(columns["seq"]), SPAN)
        records["link"] = -1  # a server older than the step links: no span joins another
        for name in SPAN.names or ():
            if name in columns:  # an older server's spans lack the newer columns
                records[name] = columns[name]
        spans[stage] = records
    return spans, body["cpu_seconds"]


async def tokens_per_word(
    session: aiohttp.ClientSession, url: str, model: str, api_key: str | None
) -> float:
    """Calibrate synthetic prompts with the server's /tokenize (vLLM's and ours); 1.3 if absent."""
    text = " ".join(WORDS * 4)
    try:
        async with session.post(
            f"{url.rstrip('/')}/tokenize",
            json={"model": model, "prompt": text},
            headers=_auth(api_key),
        ) as resp:
            if resp.status == 200:
                count = (await resp.json()).get("count")
                if count:
                    return count / len(text.split())
    except aiohttp.ClientError:
        pass
    return 1.3


def _auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def served_model(session: aiohttp.ClientSession, url: str, api_key: str | None) -> str:
    async with session.get(f"{url.rstrip('/')}/v1/models", headers=_auth(api_key)) as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


@dataclass(frozen=True, slots=True)
class ServeArgs:
    urls: tuple[str, ...]
    concurrency: tuple[int, ...] = (1,)
    request_rates: tuple[float, ...] = ()
    num_requests: int = 0  # 0: 4 x concurrency, at least 8
    prompt_tokens: int = 204
    max_tokens: int = 128
    seed: int = 0
    dataset: str | None = None
    workload: str = "random"  # "random" (random-word prompts) or "grounded" (copy a function)
    slo: Slo | None = None
    api_key: str | None = None
    model: str | None = None
    ignore_eos: bool = True
    warmup: int = 1
    timeout_s: float = 600.0
    profile: bool = False  # read /debug/profile around each run: stage figures and overhead
    temperature: float = 0.0  # greedy by default; above 0 the server's random sampling is timed

    @property
    def requests_ignore_eos(self) -> bool:
        """Random prompts and datasets run to max_tokens (ignore_eos), as the earlier benchmarks
        did; grounded requests end at EOS: the answer is the copy, and what a model writes past
        its EOS is text no user gets, which repeats nothing of the prompt."""
        return self.ignore_eos and (self.dataset is not None or self.workload != "grounded")


async def run_serve(args: ServeArgs) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The report ({"runs": [...]}) and, per run, the raw TTFT/ITL samples and stage spans (charts)."""
    samples: dict[str, dict[str, Any]] = {"ttft_ms": {}, "itl_ms": {}, "gantt": {}}
    timeout = aiohttp.ClientTimeout(total=args.timeout_s)
    # Idle pooled connections are dropped after 3 s, before the servers' own keep-alive
    # timeouts (llama-server's is 5 s) can close them under a request being written.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=3.0)
    runs: list[dict[str, Any]] = []
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        clients = []
        for url in args.urls:
            model = args.model or await served_model(session, url, args.api_key)
            tpw = await tokens_per_word(session, url, model, args.api_key)
            clients.append(
                (
                    url,
                    tpw,
                    Client(
                        session,
                        url,
                        model,
                        args.api_key,
                        args.requests_ignore_eos,
                        args.temperature,
                    ),
                )
            )
        loads: list[tuple[str, float]] = [
            ("concurrency", c) for c in (() if args.request_rates else args.concurrency)
        ]
        loads += [("request_rate", r) for r in args.request_rates]
        for kind, level in loads:
            count = args.num_requests or max(8, 4 * int(level if kind == "concurrency" else 8))
            for server, (url, tpw, client) in enumerate(clients):  # interleaved: level by level
                if args.dataset:
                    work = from_jsonl(args.dataset, count, args.max_tokens)
                elif args.workload == "grounded":
                    work = grounded(count, args.max_tokens, args.seed)
                else:
                    work = synthetic(count, args.prompt_tokens, args.max_tokens, args.seed, tpw)
                for i in range(args.warmup):
                    await client.chat(
                        work.prompts[i % len(work.prompts)], min(8, work.max_tokens[0])
                    )
                label = f"{kind}={level:g} {url}" if len(clients) > 1 else f"{kind}={level:g}"
                progress = Progress(label, count)
                before = await fetch_profile(session, url, args.api_key) if args.profile else None
                spec_before = await fetch_spec_counters(session, url, args.api_key)
                cpu0, wall0 = time.process_time(), time.perf_counter()
                if kind == "concurrency":
                    results = await closed_loop(client, work, int(level), progress)
                else:
                    results = await open_loop(client, work, level, args.seed, progress)
                wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
                run = {
                    kind: level if kind == "request_rate" else int(level),
                    "url": url,
                    "server": server,
                }
                run.update(summarize(results, wall, cpu, args.slo))
                spec_after = await fetch_spec_counters(session, url, args.api_key)
                if spec_before is not None and spec_after is not None:
                    run["speculative_decoding"] = spec_summary(spec_before, spec_after)
                if before is not None:
                    after = await fetch_profile(session, url, args.api_key)
                    if after is not None:
                        tokens = sum(r.output_tokens for r in results if r.ok)
                        run["stages"] = stage_figures(after[0], wall)
                        run["attribution"] = attribution(after[0])
                        run["overhead"] = overhead_per_token(before[1], after[1], after[0], tokens)
                        samples["gantt"][label] = gantt_spans(after[0], 2.0)
                runs.append(run)
                label = f"{kind}={level:g}" + (f" {url}" if len(clients) > 1 else "")
                ok = [r for r in results if r.ok]
                samples["ttft_ms"][label] = [r.ttft_s * 1e3 for r in ok]
                samples["itl_ms"][label] = [g * 1e3 for r in ok for g in r.itl_s]
    return {"runs": runs}, samples


def format_table(report: dict[str, Any]) -> str:
    header = (
        f"{'load':>10} {'server':<24} {'ok':>5} {'err':>4} {'req/s':>7} {'out tok/s':>10} "
        f"{'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>8} {'TPOT p50':>9} {'E2E p50':>9} {'cli cpu':>7}"
    )
    lines = [header, "-" * len(header)]
    for run in report["runs"]:
        load = f"c={run['concurrency']}" if "concurrency" in run else f"r={run['request_rate']:g}/s"
        lines.append(
            f"{load:>10} {run['url'][-24:]:<24} {run['completed']:>5} {run['errors']:>4} "
            f"{run['request_per_s']:>7.2f} {run['output_tok_per_s']:>10.1f} "
            f"{run['ttft_ms']['p50']:>8.0f}m {run['ttft_ms']['p99']:>7.0f}m "
            f"{run['itl_ms']['p50']:>7.1f}m {run['itl_ms']['p99']:>7.1f}m "
            f"{run['tpot_ms']['p50']:>8.1f}m {run['e2e_ms']['p50']:>8.0f}m {run['client_cpu_fraction']:>6.0%}"
        )
    for run in report["runs"]:
        spec = run.get("speculative_decoding")
        if spec:
            load = (
                f"c={run['concurrency']}"
                if "concurrency" in run
                else f"r={run['request_rate']:g}/s"
            )
            if not spec["num_draft_tokens"]:  # speculation off, or the policy drafted nothing
                lines.append(f"{load} {run['url']}: no speculative drafts")
                continue
            lines.append(
                f"{load} {run['url']}: speculative decoding accepted {spec['acceptance_rate']:.0%} "
                f"of {spec['num_draft_tokens']:.0f} drafts, mean acceptance length "
                f"{spec['mean_acceptance_length']:.2f}"
            )
    first = [r for r in report["runs"] if r.get("server", 0) == 0]
    second = [r for r in report["runs"] if r.get("server", 0) == 1]
    if second:
        lines.append("")
        urls = (first[0]["url"], second[0]["url"])
        for a, b in zip(first, second, strict=False):
            load = f"c={a['concurrency']}" if "concurrency" in a else f"r={a['request_rate']:g}/s"
            ratio = (
                a["output_tok_per_s"] / b["output_tok_per_s"]
                if b["output_tok_per_s"]
                else float("inf")
            )
            ttft = (
                a["ttft_ms"]["p50"] / b["ttft_ms"]["p50"] if b["ttft_ms"]["p50"] else float("inf")
            )
            itl = a["itl_ms"]["p99"] / b["itl_ms"]["p99"] if b["itl_ms"]["p99"] else float("inf")
            lines.append(
                f"{load}: {urls[0]} / {urls[1]}: {ratio:.2f}x output tok/s, TTFT p50 {ttft:.2f}x, ITL p99 {itl:.2f}x"
            )
    return "\n".join(lines)
