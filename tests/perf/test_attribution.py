"""perf/attribution.py: the time between two tokens and a token's way, from spans joined by step."""

from __future__ import annotations

import numpy as np
import pytest

from perf.attribution import DELIVER, DETOKENIZE, FORWARD, PLAN, RESULT, attribution
from pipeline.trace import SPAN

US = 1000  # ns


def spans(*rows: dict) -> np.ndarray:
    out = np.zeros(len(rows), SPAN)
    for i, row in enumerate(rows):
        for name, value in row.items():
            out[i][name] = value
    out["seq"] = np.arange(1, len(rows) + 1)
    return out


def span(kind, start_us, end_us, link, wait_us=0, lead_us=0, sample_us=0):
    return {
        "kind": kind,
        "t_start_ns": start_us * US,
        "t_end_ns": end_us * US,
        "link": link,
        "wait_ns": wait_us * US,
        "lead_ns": lead_us * US,
        "aux": sample_us,
    }


def two_steps() -> dict[str, np.ndarray]:
    """Step 1 planned while execute waits for it; step 2 planned a step ahead, so it sits in the
    ring until execute has sent step 1's outputs."""
    return {
        "schedule": spans(
            span(PLAN, 0, 100, 1),
            span(PLAN, 400, 450, 2),
            span(RESULT, 1250, 1300, 1),
            span(RESULT, 2300, 2350, 2),
        ),
        "execute": spans(
            span(FORWARD, 200, 1200, 1, wait_us=150, lead_us=20, sample_us=100),
            span(FORWARD, 1260, 2260, 2, wait_us=0, lead_us=30, sample_us=200),
        ),
        "detokenize": spans(span(DETOKENIZE, 1320, 1400, 1), span(DETOKENIZE, 2360, 2400, 2)),
        "server": spans(span(DELIVER, 1450, 1500, 1), span(DELIVER, 2450, 2470, 2)),
    }


def test_the_step_period_is_split_into_executes_parts_that_add_up_to_it():
    figures = attribution(two_steps())
    period = figures["period"]
    assert period["count"] == 1
    parts = {key: period[key]["mean_ms"] * 1e3 for key in period if key != "count"}
    assert parts == pytest.approx(
        {"outputs": 30, "wait": 0, "unpack": 30, "model": 800, "sample": 200, "total": 1060}
    )
    assert figures["planned_ahead"] == 1.0  # step 2's plan ended before step 1's forward did


def test_a_tokens_way_names_each_stage_and_hop_and_a_plan_queued_behind_the_step_before():
    path = attribution(two_steps())["path"]
    assert path["count"] == 2
    first = {
        "plan": 100,
        "queued": 0,  # execute was already waiting
        "to_execute": 80,  # the plan ended at 100, execute had it at 180
        "unpack": 20,
        "model": 900,
        "sample": 100,
        "to_schedule": 50,
        "result": 50,
        "to_detokenize": 20,
        "detokenize": 80,
        "to_server": 50,
        "deliver": 50,
    }
    second = {
        "plan": 50,
        "queued": 780,  # planned at 450, taken when execute was done with step 1 (1230)
        "to_execute": 0,
        "unpack": 30,
        "model": 800,
        "sample": 200,
        "to_schedule": 40,
        "result": 50,
        "to_detokenize": 10,
        "detokenize": 40,
        "to_server": 50,
        "deliver": 20,
    }
    for key, value in first.items():
        assert path[key]["mean_ms"] * 1e3 == pytest.approx((value + second[key]) / 2), key
    assert path["total"]["mean_ms"] * 1e3 == pytest.approx((1500 + 2470 - 400) / 2)


def test_an_idle_pipeline_between_requests_is_not_counted_as_a_steps_wait():
    forwards, plans = [], []
    end = 0
    for step in range(1, 8):
        wait = 50_000 if step == 7 else 0  # 50 ms with nothing to do, then a new request
        start = end + 10 + wait
        forwards.append(span(FORWARD, start, start + 990, step, wait_us=wait))
        plans.append(span(PLAN, start - 5, start - 2, step))
        end = start + 990
    figures = attribution({"execute": spans(*forwards), "schedule": spans(*plans)})
    assert figures["idle_gaps"] == 1 and figures["period"]["count"] == 5
    assert figures["period"]["total"]["mean_ms"] == pytest.approx(1.0)
    assert figures["path"]["count"] == 0  # no detokenize or server spans: no way to follow


def test_replicas_are_joined_within_each_not_across():
    """Under data parallelism step ids repeat across replicas: each replica's spans join only
    with its own."""
    one, other = two_steps(), two_steps()
    other["execute"]["t_start_ns"] += 10_000_000  # a replica whose steps run 10 ms later
    other["execute"]["t_end_ns"] += 10_000_000
    merged = {f"{stage}.dp0": s for stage, s in one.items()}
    merged |= {f"{stage}.dp1": s for stage, s in other.items()}
    figures = attribution(merged)
    assert figures["period"]["count"] == 2
    assert figures["period"]["total"]["mean_ms"] == pytest.approx(1.06)
    assert figures["path"]["count"] == 4
