"""`pipeline-bench chaos`: streams under random stage kills, checked against a run without any.

The bench process owns the pipeline (as the server would). A reference pass runs every prompt
once, greedy, with no failure; then `--streams` closed-loop workers cycle through the prompts
while a killer SIGKILLs a random stage every so often. Each completed request's text must equal
its prompt's reference; the report counts requests, kills, lost requests (an error instead of a
completion) and wrong texts, and the recovery time per stage that died, from the kill to the
engine taking requests again. With `--template-bombs N`, N requests bring chat templates of
their own that loop for minutes or build a gigabyte string, spread over the run: each must be a
400 that names the limit it passed, and the streams beside them must not notice. With
`--non-readers N`, N streams are read once and then left unread: each must be aborted once it
leaves --max-unread-tokens unread (NON_READER_LIMIT here), its KV blocks freed.

With a baseline (`run_chaos_ab`) the same run goes on the baseline tree's code and on this tree's,
each pass in a process of its own (this file run as a script on the tree's import path), the sides
in alternating order, and the recovery times per stage are reported side by side.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from perf.stats import percentiles_ms

STAGES = ("render", "schedule", "execute", "detokenize")


@dataclass(frozen=True, slots=True)
class ChaosArgs:
    model_path: str
    dummy: bool = False
    streams: int = 16
    kills: int = 12
    kill_interval_s: float = 3.0  # mean time between a recovery and the next kill
    stages: tuple[str, ...] = STAGES
    max_tokens: int = 48
    num_prompts: int = 16
    seed: int = 0
    threads: int = 0
    template_bombs: int = 0
    non_readers: int = 0


# Chat templates a request may bring (--trust-request-chat-template) that render for minutes or
# take a gigabyte, and the limit each must be refused by
BOMBS = (
    (
        "{% for i in range(100000) %}{% for j in range(30000) %}{% endfor %}{% endfor %}",
        "--chat-template-timeout",
    ),
    ("{{ ('%999999999s' % 'a')|length }}", "--chat-template-memory"),
)
BOMB_TIMEOUT_S = 1.0
NON_READER_LIMIT = 256  # --max-unread-tokens in the run: a non-reader is aborted in seconds


def _prompts(count: int) -> list[str]:
    topics = ("rivers", "bread", "the moon", "chess", "bees", "glass", "trains", "clouds")
    return [
        f"Write two sentences about {topics[i % len(topics)]} (note {i})." for i in range(count)
    ]


async def run_chaos(args: ChaosArgs) -> dict[str, Any]:
    from pipeline.names import names_in_shm
    from stages.config import EngineConfig
    from stages.engine import Engine

    engine = Engine(
        EngineConfig(
            model_path=args.model_path,
            dummy=args.dummy,
            threads=args.threads,
            max_num_seqs=max(args.streams, 1),
            log_format="json",
            log_level="error",
            # Every kill is a failure the engine must survive: the budget is not under test here.
            max_stage_restarts=args.kills + 1,
            chat_template_timeout_s=BOMB_TIMEOUT_S,
            max_unread_tokens=NON_READER_LIMIT,
        )
    )
    await engine.start()
    run = _ChaosRun(args, engine)
    try:
        await run.reference_pass()
        started = time.monotonic()
        await asyncio.gather(
            run.killer(),
            run.bomber(),
            run.non_reader(),
            *(run.worker(w) for w in range(args.streams)),
        )
        duration = time.monotonic() - started
        # Schedule publishes its gauges after it has sent the last tokens on: let them settle.
        deadline = time.monotonic() + 10
        while engine.stats()["num_requests_running"] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        stats = engine.stats()
    finally:
        await engine.stop()
    left = [n for n in names_in_shm() if any(ns in n for ns in run.namespaces)]
    return run.report(duration, stats, left)


class _ChaosRun:
    """One pass: the reference texts, the closed-loop workers, the killer, the template bombs
    and the non-readers, and what they counted."""

    def __init__(self, args: ChaosArgs, engine: Any) -> None:
        self.args = args
        self.engine = engine
        self.prompts = _prompts(args.num_prompts)
        self.reference: list[str] = []
        self.done = asyncio.Event()
        self.serials = iter(range(1 << 62))
        self.namespaces = {engine.supervisor.namespace}
        self.kills: list[dict[str, Any]] = []
        self.completed = self.lost = self.wrong = 0
        self.bombs_refused = self.non_readers_aborted = 0
        self.errors: list[str] = []

    def request(self, i: int, serial: str) -> Any:
        from pipeline.clock import now_ns
        from stages.api import ChatPrompt, GenerateRequest, SamplingParams

        return GenerateRequest(
            f"chaos-{serial}",
            ChatPrompt([{"role": "user", "content": self.prompts[i]}]),
            SamplingParams(temperature=0.0, max_tokens=self.args.max_tokens),
            arrival_ns=now_ns(),
        )

    async def text_of(self, request: Any) -> str:
        return "".join([out.text async for out in self.engine.generate(request)])

    async def reference_pass(self) -> None:
        """Every prompt once, greedy, before any kill: the texts every later run must equal."""
        for i in range(len(self.prompts)):
            self.reference.append(await self.text_of(self.request(i, f"ref-{i}")))

    async def worker(self, w: int) -> None:
        from stages.api import EngineError

        i = w % len(self.prompts)
        while not self.done.is_set():
            while not self.engine.ready:  # a closed-loop client backs off while it restarts
                await asyncio.sleep(0.05)
            try:
                text = await self.text_of(self.request(i, str(next(self.serials))))
            except EngineError as error:
                if error.status == 503 and not self.done.is_set():
                    continue  # refused at the door during a restart: nothing was admitted
                self.lost += 1
                self.errors.append(error.message)
            else:
                self.completed += 1
                self.wrong += text != self.reference[i]
            i = (i + 1) % len(self.prompts)

    async def bomber(self) -> None:
        """Each bomb a 400 naming its limit (a 503 at the door during a restart is sent again);
        anything else is counted lost."""
        from pipeline.clock import now_ns
        from stages.api import ChatPrompt, EngineError, GenerateRequest, SamplingParams

        args = self.args
        rng = random.Random(args.seed + 1)
        span_s = args.kills * args.kill_interval_s
        for n in range(args.template_bombs):
            await asyncio.sleep(rng.uniform(0.5, 1.5) * span_s / max(args.template_bombs, 1))
            template, limit = BOMBS[n % len(BOMBS)]
            prompt = ChatPrompt([{"role": "user", "content": "hi"}], chat_template=template)
            sampling = SamplingParams(temperature=0.0, max_tokens=4)
            while True:
                bomb = GenerateRequest(f"bomb-{n}", prompt, sampling, arrival_ns=now_ns())
                try:
                    await self.text_of(bomb)
                except EngineError as error:
                    if error.status == 503:
                        await asyncio.sleep(0.05)
                        continue
                    if error.status == 400 and limit in error.message:
                        self.bombs_refused += 1
                        break
                    self.errors.append(error.message)
                self.lost += 1
                break

    async def non_reader(self) -> None:
        """Streams read once and then not at all, one after another: each must be aborted (the
        engine's count of such aborts goes up) while the others go on."""
        from pipeline.clock import now_ns
        from stages.api import EngineError, GenerateRequest, SamplingParams

        args, engine = self.args, self.engine
        rng = random.Random(args.seed + 2)
        span_s = args.kills * args.kill_interval_s
        for n in range(args.non_readers):
            await asyncio.sleep(rng.uniform(0.5, 1.5) * span_s / max(args.non_readers, 1))
            while not engine.ready:
                await asyncio.sleep(0.05)
            before = engine.stats()["num_requests_aborted_unread_total"]
            # all the room the model leaves: far more than the limit lets it leave unread
            sampling = SamplingParams(temperature=0.0, ignore_eos=True, logprobs=5)
            prompt = self.request(n % len(self.prompts), "x").prompt
            req = GenerateRequest(f"unread-{n}", prompt, sampling, arrival_ns=now_ns())
            outputs = engine.generate(req)
            try:
                await anext(outputs)
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    if engine.stats()["num_requests_aborted_unread_total"] > before:
                        self.non_readers_aborted += 1
                        break
                    await asyncio.sleep(0.05)
            except EngineError as error:  # refused or failed before its first output
                self.errors.append(f"non-reader: {error.message}")
            finally:
                await outputs.aclose()

    async def killer(self) -> None:
        args, engine = self.args, self.engine
        rng = random.Random(args.seed)
        for _ in range(args.kills):
            await asyncio.sleep(rng.uniform(0.5, 1.5) * args.kill_interval_s)
            stage = rng.choice(args.stages)
            self.namespaces.add(engine.supervisor.namespace)
            in_flight = int(engine.stats()["num_streams"])
            started = time.monotonic()
            os.kill(engine.supervisor.pids()[stage], signal.SIGKILL)
            while engine.ready:
                await asyncio.sleep(0.005)
            failure = engine.failure  # the stage the engine blames, while it restarts
            while not engine.ready:
                await asyncio.sleep(0.005)
            self.kills.append(
                {
                    "stage": stage,
                    "named": failure.actor if failure is not None else "",
                    "recovery_s": time.monotonic() - started,
                    "in_flight": in_flight,
                }
            )
        self.done.set()

    def report(self, duration: float, stats: dict[str, float], left: list[str]) -> dict[str, Any]:
        args, kills = self.args, self.kills
        recovery = {
            stage: percentiles_ms([k["recovery_s"] for k in kills if k["stage"] == stage])
            | {"kills": sum(k["stage"] == stage for k in kills)}
            for stage in args.stages
        }
        return {
            "model": "dummy" if args.dummy else args.model_path,
            "streams": args.streams,
            "duration_s": duration,
            "requests": self.completed + self.lost,
            "completed": self.completed,
            "lost": self.lost,
            "wrong_text": self.wrong,
            "kills": len(kills),
            # kills the engine blamed on another stage than the one killed (issue 37, item 3)
            "misnamed_kills": sum(k["named"] != k["stage"] for k in kills),
            "template_bombs": args.template_bombs,
            "template_bombs_refused": self.bombs_refused,
            "non_readers": args.non_readers,
            "non_readers_aborted": self.non_readers_aborted,
            "in_flight_at_kill": [k["in_flight"] for k in kills],
            "recovery_ms": recovery,
            "kill_log": kills,
            "kv_blocks_held_after": int(stats["num_blocks"] - stats["num_free_blocks"]),
            "scheduler_after": {
                k: stats[k] for k in ("num_requests_running", "num_requests_waiting")
            },
            "shm_names_left": left,
            "errors": self.errors[:10],
        }


def format_table(report: dict[str, Any]) -> str:
    lines = [
        f"{report['requests']} requests over {report['duration_s']:.0f} s with "
        f"{report['streams']} streams; {report['kills']} kills "
        f"(in flight at each: {report['in_flight_at_kill']})",
        f"completed {report['completed']}, lost {report['lost']}, "
        f"text differing from the uninterrupted run {report['wrong_text']}, "
        f"KV blocks held after {report['kv_blocks_held_after']}, "
        f"shared-memory names left {len(report['shm_names_left'])}, "
        f"kills blamed on another stage {report.get('misnamed_kills', 0)}",
        f"template bombs {report.get('template_bombs', 0)}, refused with a 400 naming their "
        f"limit {report.get('template_bombs_refused', 0)}; streams left unread "
        f"{report.get('non_readers', 0)}, aborted {report.get('non_readers_aborted', 0)}",
        "",
        f"{'stage':<12}{'kills':>6}{'recovery p50 ms':>17}{'p99 ms':>10}",
    ]
    for stage, row in report["recovery_ms"].items():
        lines.append(f"{stage:<12}{row['kills']:>6}{row['p50']:>17.0f}{row['p99']:>10.0f}")
    return "\n".join(lines)


def run_chaos_ab(args: ChaosArgs, baseline_tree: str, rounds: int) -> dict[str, Any]:
    """`rounds` passes on each side, alternating which goes first; kills pooled per side."""
    this_tree = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sides = {"baseline": baseline_tree, "this": this_tree}
    reports: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    for r in range(rounds):
        order = ("baseline", "this") if r % 2 == 0 else ("this", "baseline")
        for side in order:
            pass_args = dataclasses.replace(args, seed=args.seed + r)
            reports[side].append(_pass_in(sides[side], pass_args))
    summary: dict[str, Any] = {"trees": sides, "rounds": rounds, "recovery_ms": {}}
    for side, passes in reports.items():
        kills = [k for p in passes for k in p["kill_log"]]
        summary[side] = {
            key: sum(p[key] for p in passes)
            for key in ("requests", "completed", "lost", "wrong_text", "kills")
        }
        summary[side]["kv_blocks_held_after"] = max(p["kv_blocks_held_after"] for p in passes)
        summary[side]["shm_names_left"] = sum(len(p["shm_names_left"]) for p in passes)
        summary["recovery_ms"][side] = {
            stage: percentiles_ms([k["recovery_s"] for k in kills if k["stage"] == stage])
            | {"kills": sum(k["stage"] == stage for k in kills)}
            for stage in args.stages
        }
    return summary


def _pass_in(tree: str, args: ChaosArgs) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=tree)
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), json.dumps(dataclasses.asdict(args))],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"chaos pass in {tree} failed: {done.stderr[-2000:]}")
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def format_ab_table(summary: dict[str, Any]) -> str:
    lines = []
    for side in ("baseline", "this"):
        row = summary[side]
        lines.append(
            f"{side} ({summary['trees'][side]}): {row['requests']} requests, {row['kills']} kills, "
            f"lost {row['lost']}, wrong text {row['wrong_text']}, "
            f"KV blocks held after {row['kv_blocks_held_after']}, "
            f"names left {row['shm_names_left']}"
        )
    lines += [
        "",
        f"{'stage':<12}{'kills':>10}{'baseline p50':>14}{'p99':>8}{'this p50':>10}{'p99':>8}"
        f"{'p50 ratio':>11}",
    ]
    base, this = summary["recovery_ms"]["baseline"], summary["recovery_ms"]["this"]
    for stage in base:
        b, t = base[stage], this[stage]
        ratio = t["p50"] / b["p50"] if b["p50"] else float("nan")
        lines.append(
            f"{stage:<12}{b['kills']:>5}/{t['kills']:<4}{b['p50']:>14.0f}{b['p99']:>8.0f}"
            f"{t['p50']:>10.0f}{t['p99']:>8.0f}{ratio:>10.2f}x"
        )
    return "\n".join(lines)


if __name__ == "__main__":  # one pass of run_chaos_ab, on the engine of the tree on sys.path
    from pipeline.logs import configure_logging

    configure_logging("console", "error")
    values = json.loads(sys.argv[1])
    values["stages"] = tuple(values["stages"])
    print(json.dumps(asyncio.run(run_chaos(ChaosArgs(**values)))))
