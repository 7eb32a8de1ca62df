"""Summaries of latency samples: percentiles in one shape every mode of pipeline-bench reports."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PERCENTILES = (50, 90, 99)


def percentiles_ms(samples_s: Sequence[float]) -> dict[str, float]:
    """{"p50", "p90", "p99", "mean"} in milliseconds; zeros when there is no sample."""
    if len(samples_s) == 0:
        return {f"p{p}": 0.0 for p in PERCENTILES} | {"mean": 0.0}
    values = np.asarray(samples_s, dtype=np.float64) * 1e3
    out = {
        f"p{p}": float(v)
        for p, v in zip(PERCENTILES, np.percentile(values, PERCENTILES), strict=True)
    }
    out["mean"] = float(values.mean())
    return out
