"""`--report DIR`: PNG charts of a pipeline-bench run (matplotlib, no display needed)."""

from __future__ import annotations

import os
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np


def cdf_chart(path: str, title: str, series: dict[str, list[float]], unit: str = "ms") -> str:
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, values in series.items():
        if not values:
            continue
        xs = np.sort(np.asarray(values))
        ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=label)
    ax.set_xlabel(unit)
    ax.set_ylabel("fraction of samples")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def throughput_chart(path: str, runs: list[dict[str, Any]]) -> str:
    fig, ax = plt.subplots(figsize=(7, 4))
    for url in dict.fromkeys(r["url"] for r in runs):
        points = sorted(
            (r["concurrency"], r["output_tok_per_s"])
            for r in runs
            if r["url"] == url and "concurrency" in r
        )
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=url)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Throughput versus concurrency")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def gantt_chart(path: str, spans: list[tuple[str, float, float]], title: str) -> str:
    """Spans (lane, start_s, end_s) as horizontal bars, one lane per stage."""
    lanes = list(dict.fromkeys(lane for lane, _, _ in spans))
    fig, ax = plt.subplots(figsize=(10, 1 + 0.6 * len(lanes)))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, lane in enumerate(lanes):
        bars = [(start, end - start) for name, start, end in spans if name == lane]
        ax.broken_barh(bars, (i - 0.35, 0.7), facecolors=colors[i % len(colors)])
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_xlabel("seconds")
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def serve_report(
    directory: str, report: dict[str, Any], samples: dict[str, dict[str, list[float]]]
) -> list[str]:
    """TTFT and ITL CDFs (one curve per run) and throughput versus concurrency."""
    os.makedirs(directory, exist_ok=True)
    return [
        cdf_chart(
            os.path.join(directory, "ttft_cdf.png"), "Time to first token", samples["ttft_ms"]
        ),
        cdf_chart(os.path.join(directory, "itl_cdf.png"), "Inter-token latency", samples["itl_ms"]),
        throughput_chart(os.path.join(directory, "throughput.png"), report["runs"]),
    ]
