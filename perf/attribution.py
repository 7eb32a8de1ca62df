"""Where the time between two streamed tokens goes, from the stages' spans joined by step.

Every span of one engine step carries the step's id as its `link` (stages/spans.py): schedule's
plan and result, execute's forward (its `aux` the microseconds spent sampling, its `wait_ns` the
wait for the plan and its `lead_ns` the unpacking after it), detokenize's span, and the server's
delivery of each output (from its deltas' arrival to the chunk written). Two views:

- the step period: the time from one forward's end to the next, which is the time between two
  tokens of a stream that gets one a step, split into execute's parts;
- a token's way: from schedule planning its step to the server writing its chunk, each stage's
  work and each hop between them (a ring message and the wake-up of the one waiting on it).
"""

from __future__ import annotations

from typing import Any

import numpy as np

# stages/spans.py's kinds (perf/ does not import the stages)
PLAN, RESULT, FORWARD, DETOKENIZE, DELIVER = 2, 3, 4, 5, 6

PERIOD_PARTS = (
    ("outputs", "execute: outputs packed and sent"),
    ("wait", "execute: waiting for the next plan"),
    ("unpack", "execute: plan unpacked, requests admitted"),
    ("model", "execute: the model's forward"),
    ("sample", "execute: sampling"),
)
PATH_PARTS = (
    ("plan", "schedule: planning the step"),
    ("queued", "plan queued behind the step before"),
    ("to_execute", "schedule -> execute: ring, wake-up"),
    ("unpack", "execute: plan unpacked, requests admitted"),
    ("model", "execute: the model's forward"),
    ("sample", "execute: sampling"),
    ("to_schedule", "execute -> schedule: outputs, ring, wake-up"),
    ("result", "schedule: outputs applied, tokens sent"),
    ("to_detokenize", "schedule -> detokenize: ring, wake-up"),
    ("detokenize", "detokenize: text, stop strings, deltas"),
    ("to_server", "detokenize -> server: ring, wake-up, queue"),
    ("deliver", "server: chunk encoded and written"),
)
# A wait this many median periods long is the pipeline idle (no request), not a step's cost
IDLE_PERIODS = 5.0


def _by_link(spans: np.ndarray, kind: int) -> dict[int, np.void]:
    """The first span of `kind` per link."""
    out: dict[int, np.void] = {}
    for span in spans[(spans["kind"] == kind) & (spans["link"] >= 0)]:
        out.setdefault(int(span["link"]), span)
    return out


def _replicas(spans: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    """The spans by replica ("" alone; ".dpN" under data parallelism), then by stage."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for name, records in spans.items():
        stage, _, replica = name.partition(".")
        out.setdefault(replica, {})[stage] = records
    return out


def step_periods(execute: np.ndarray) -> dict[str, np.ndarray]:
    """Each period between two consecutive forwards, split into PERIOD_PARTS (ns arrays), with
    the link of the step it ends with and the end of the forward before."""
    forwards = np.sort(execute[execute["kind"] == FORWARD], order="t_end_ns")
    if len(forwards) < 2:
        return {key: np.zeros(0) for key, _ in PERIOD_PARTS}
    prev, cur = forwards[:-1], forwards[1:]
    sample = np.minimum(cur["aux"].astype(np.int64) * 1000, cur["t_end_ns"] - cur["t_start_ns"])
    wait_start = cur["t_start_ns"] - cur["lead_ns"] - cur["wait_ns"]
    return {
        "outputs": np.maximum(wait_start - prev["t_end_ns"], 0),
        "wait": cur["wait_ns"].astype(np.int64),
        "unpack": cur["lead_ns"].astype(np.int64),
        "model": cur["t_end_ns"] - cur["t_start_ns"] - sample,
        "sample": sample,
        "links": cur["link"],  # the step each period ends with
        "prev_end_ns": prev["t_end_ns"],
    }


def token_paths(stages: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each delivered output's way from its step's plan to its chunk, split into PATH_PARTS."""
    schedule, execute = stages.get("schedule"), stages.get("execute")
    detokenize, server = stages.get("detokenize"), stages.get("server")
    if schedule is None or execute is None or detokenize is None or server is None:
        return {key: np.zeros(0) for key, _ in PATH_PARTS}
    plans, results = _by_link(schedule, PLAN), _by_link(schedule, RESULT)
    forwards, detoks = _by_link(execute, FORWARD), _by_link(detokenize, DETOKENIZE)
    marks = []
    for delivery in server[(server["kind"] == DELIVER) & (server["link"] >= 0)]:
        link = int(delivery["link"])
        p, f, r, d = plans.get(link), forwards.get(link), results.get(link), detoks.get(link)
        if p is None or f is None or r is None or d is None:
            continue  # a step whose spans fell out of the window
        received = int(f["t_start_ns"] - f["lead_ns"])
        sample = min(int(f["aux"]) * 1000, int(f["t_end_ns"] - f["t_start_ns"]))
        sent = min(int(r["t_end_ns"]), int(d["t_start_ns"]))
        marks.append(
            [
                p["t_start_ns"],
                p["t_end_ns"],
                max(int(p["t_end_ns"]), received - int(f["wait_ns"])),
                received,
                f["t_start_ns"],
                int(f["t_end_ns"]) - sample,
                f["t_end_ns"],
                r["t_start_ns"],
                sent,
                d["t_start_ns"],
                d["t_end_ns"],
                delivery["t_start_ns"],
                delivery["t_end_ns"],
            ]
        )
    if not marks:
        return {key: np.zeros(0) for key, _ in PATH_PARTS}
    times = np.maximum.accumulate(np.array(marks, dtype=np.int64), axis=1)
    parts = np.diff(times, axis=1)
    return {key: parts[:, i] for i, (key, _) in enumerate(PATH_PARTS)}


def attribution(spans: dict[str, np.ndarray]) -> dict[str, Any]:
    """Both views over a window of spans (all replicas together), in milliseconds."""
    periods: dict[str, list[np.ndarray]] = {key: [] for key, _ in PERIOD_PARTS}
    paths: dict[str, list[np.ndarray]] = {key: [] for key, _ in PATH_PARTS}
    ahead, idle = [], 0
    for stages in _replicas(spans).values():
        execute = stages.get("execute")
        if execute is None:
            continue
        split = step_periods(execute)
        total = sum(split[key] for key, _ in PERIOD_PARTS)
        if len(total):
            busy = split["wait"] < IDLE_PERIODS * np.median(total)
            idle += int((~busy).sum())
            for key, _ in PERIOD_PARTS:
                periods[key].append(split[key][busy])
            plans = _by_link(stages.get("schedule", np.zeros(0, execute.dtype)), PLAN)
            for link, prev_end in zip(
                split["links"][busy], split["prev_end_ns"][busy], strict=True
            ):
                plan = plans.get(int(link))
                if plan is not None:
                    ahead.append(int(plan["t_end_ns"]) <= int(prev_end))
        for key, values in token_paths(stages).items():
            paths[key].append(values)
    return {
        "period": _summary(periods, PERIOD_PARTS),
        "path": _summary(paths, PATH_PARTS),
        "planned_ahead": float(np.mean(ahead)) if ahead else 0.0,
        "idle_gaps": idle,
    }


def _summary(
    parts: dict[str, list[np.ndarray]], names: tuple[tuple[str, str], ...]
) -> dict[str, Any]:
    joined = {key: np.concatenate(parts[key]) if parts[key] else np.zeros(0) for key, _ in names}
    count = len(joined[names[0][0]])
    if not count:
        return {"count": 0}
    total = sum(joined[key].astype(np.float64) for key, _ in names)
    out: dict[str, Any] = {"count": count}
    for key, _ in names:
        out[key] = {
            "mean_ms": float(joined[key].mean()) / 1e6,
            "p50_ms": float(np.median(joined[key])) / 1e6,
        }
    out["total"] = {"mean_ms": float(total.mean()) / 1e6, "p50_ms": float(np.median(total)) / 1e6}
    return out


def format_attribution(figures: dict[str, Any]) -> str:
    """The two tables, each part's mean (the means add up to the total's), median and share."""
    lines = []
    period = figures["period"]
    if period["count"]:
        lines.append(
            f"the time between two tokens (execute's step period; {period['count']} steps, "
            f"{figures['planned_ahead']:.0%} planned a step ahead, {figures['idle_gaps']} idle "
            "gaps left out)"
        )
        lines += _rows(period, PERIOD_PARTS, "step period")
    path = figures["path"]
    if path["count"]:
        lines.append(f"a token's way from its plan to its chunk ({path['count']} outputs)")
        lines += _rows(path, PATH_PARTS, "plan to chunk written")
    return "\n".join(lines)


def _rows(summary: dict[str, Any], names: tuple[tuple[str, str], ...], total: str) -> list[str]:
    whole = summary["total"]["mean_ms"] or 1.0
    rows = [f"  {'':<46} {'mean':>8} {'p50':>8} {'share':>6}"]
    for key, label in (*names, ("total", total)):
        mean, p50 = summary[key]["mean_ms"], summary[key]["p50_ms"]
        rows.append(f"  {label:<46} {mean:>7.3f}m {p50:>7.3f}m {mean / whole:>6.0%}")
    return rows
