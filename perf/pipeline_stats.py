"""Where the time goes: per-stage figures from trace spans and process CPU times over one window."""

from __future__ import annotations

from typing import Any

import numpy as np

from perf.stats import percentiles_ms

FORWARD_KIND = 4  # stages.spans.SPAN_FORWARD (perf/ does not import the stages)
FRONT_END = "server"  # Engine.cpu_seconds' name for the process that drives the stages
SPAN_NAMES = {1: "render", 2: "plan", 3: "result", 4: "forward", 5: "detokenize", 6: "deliver"}


def stage_figures(spans: dict[str, np.ndarray], window_s: float) -> dict[str, Any]:
    """Busy fraction, time per span, batch and queue depth of each stage's spans in the window."""
    out: dict[str, Any] = {}
    for stage, s in spans.items():
        if len(s) == 0:
            out[stage] = {"spans": 0, "busy_fraction": 0.0}
            continue
        durations = (s["t_end_ns"] - s["t_start_ns"]) / 1e9
        out[stage] = {
            "spans": len(s),
            "busy_fraction": _covered_s(s) / window_s if window_s else 0.0,
            "span_ms": percentiles_ms(durations.tolist()),
            "mean_batch": float(s["batch"].mean()),
            "mean_tokens": float(s["tokens"].mean()),
            "mean_depth": float(s["depth"].mean()),
            "max_depth": int(s["depth"].max()),
            "kinds": sorted({SPAN_NAMES.get(int(k), str(k)) for k in s["kind"]}),
        }
    return out


def _covered_s(spans: np.ndarray) -> float:
    """Seconds covered by at least one span: the server's deliveries overlap one another."""
    order = np.argsort(spans["t_start_ns"], kind="stable")
    starts, ends = spans["t_start_ns"][order], np.maximum.accumulate(spans["t_end_ns"][order])
    # a span starting after every earlier one ended opens a new covered stretch
    opens = np.concatenate([[True], starts[1:] > ends[:-1]])
    first = np.flatnonzero(opens)
    last = np.concatenate([first[1:] - 1, [len(starts) - 1]])
    return float((ends[last] - starts[first]).sum()) / 1e9


def overhead_per_token(
    cpu_before: dict[str, float],
    cpu_after: dict[str, float],
    spans: dict[str, np.ndarray],
    tokens: int,
) -> dict[str, float]:
    """CPU microseconds per generated token outside the forward pass.

    `overhead_us_per_token` is the pipeline's: the four stage processes (the forward pass taken
    out of execute). `front_end_us_per_token` is the process that drives them (the HTTP server,
    or pipeline-bench itself offline), and `total_us_per_token` both.
    """
    used = {name: cpu_after.get(name, 0.0) - cpu_before.get(name, 0.0) for name in cpu_after}
    forward_by = {  # each process's own forward (tensor-parallel ranks each run one)
        name: float(s["cpu_ns"][s["kind"] == FORWARD_KIND].sum()) / 1e9
        for name, s in spans.items()
        if len(s)
    }
    forward_s = sum(forward_by.values())
    total = sum(used.values())
    front_end = used.get(FRONT_END, 0.0)

    def per_token(seconds: float) -> float:
        return seconds / tokens * 1e6 if tokens else 0.0

    return {
        "tokens": tokens,
        "cpu_s_total": total,
        "cpu_s_forward": forward_s,
        "overhead_us_per_token": per_token(total - front_end - forward_s),
        "front_end_us_per_token": per_token(front_end),
        "total_us_per_token": per_token(total - forward_s),
        **{f"cpu_s_{name}": value for name, value in used.items()},
        **{f"forward_s_{name}": value for name, value in forward_by.items()},
    }


def gantt_spans(spans: dict[str, np.ndarray], seconds: float) -> list[tuple[str, float, float]]:
    """The last `seconds` of spans as (stage, start_s, end_s) relative to the earliest start shown."""
    all_ends = [int(s["t_end_ns"].max()) for s in spans.values() if len(s)]
    if not all_ends:
        return []
    end = max(all_ends)
    start = end - int(seconds * 1e9)
    rows = []
    for stage, s in spans.items():
        keep = s[s["t_end_ns"] >= start]
        rows += [
            (stage, (a - start) / 1e9, (b - start) / 1e9)
            for a, b in zip(keep["t_start_ns"], keep["t_end_ns"], strict=True)
        ]
    return rows


def format_stages(figures: dict[str, Any], overhead: dict[str, float]) -> str:
    lines = [
        f"{'stage':<12} {'spans':>7} {'busy':>6} {'span p50':>9} {'p99':>8} {'batch':>6} {'depth':>6}"
    ]
    for stage, f in figures.items():
        if not f["spans"]:
            lines.append(f"{stage:<12} {0:>7}")
            continue
        lines.append(
            f"{stage:<12} {f['spans']:>7} {f['busy_fraction']:>6.0%} {f['span_ms']['p50']:>8.2f}m "
            f"{f['span_ms']['p99']:>7.2f}m {f['mean_batch']:>6.1f} {f['mean_depth']:>6.2f}"
        )
    lines.append(
        f"pipeline CPU outside the forward pass: {overhead['overhead_us_per_token']:.1f} us per "
        f"generated token in the stages, {overhead['front_end_us_per_token']:.1f} more in the front "
        f"end, {overhead['total_us_per_token']:.1f} in all ({overhead['tokens']} tokens, "
        f"{overhead['cpu_s_total']:.2f} s CPU, {overhead['cpu_s_forward']:.2f} s of it in forward)"
    )
    tokens = overhead["tokens"]
    if tokens:
        # By process; the forward pass is counted in the process that ran it (execute, and each
        # tensor-parallel rank) and taken out of that one.
        shares = []
        for key, value in overhead.items():
            if not key.startswith("cpu_s_") or key in ("cpu_s_total", "cpu_s_forward"):
                continue
            name = key.removeprefix("cpu_s_")
            value -= overhead.get(f"forward_s_{name}", 0.0)
            shares.append(f"{name} {value / tokens * 1e6:.1f}")
        lines.append("  by process (us per token): " + ", ".join(shares))
    return "\n".join(lines)
