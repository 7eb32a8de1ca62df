"""The gauges schedule publishes on its control block (pipeline/control.py) for the server's
/metrics, in this order: GAUGES by name (the waiting requests split by vLLM's reasons when read);
the engine steps by their tokens, the prompt tokens each computed and the tokens it made (vLLM's
iteration_tokens_total histogram: a count per bucket, then the tokens' sum); and one
accepted-token count per draft position."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pipeline.control import NUM_GAUGES
from stages.speculative_config import MAX_SPECULATIVE_TOKENS

GAUGES = (
    "num_requests_running",
    "num_requests_waiting",
    # of those, the ones a transient constraint holds back (vLLM's 'deferred' reason): their
    # grammar's matcher being built, or no adapter slot free (--max-loras)
    "num_requests_waiting_deferred",
    "kv_cache_usage_perc",
    "num_free_blocks",
    "num_preemptions_total",
    "num_blocks",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "spec_decode_num_drafts_total",
    "spec_decode_num_draft_tokens_total",
    "spec_decode_num_accepted_tokens_total",
)
# vLLM's ITERATION_TOKENS_BUCKETS: powers of two up to a large step's token budget
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
ITERATION_TOKENS = "iteration_tokens_total"
_HISTOGRAM_AT = len(GAUGES)
_PER_POSITION_AT = _HISTOGRAM_AT + len(ITERATION_TOKENS_BUCKETS) + 2
assert _PER_POSITION_AT + MAX_SPECULATIVE_TOKENS <= NUM_GAUGES, "the control row is too small"


@dataclass(slots=True)
class StepTokens:
    """Engine steps counted by their tokens (prompt tokens computed + tokens made), per bucket
    (not cumulative)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(ITERATION_TOKENS_BUCKETS) + 1))
    total: int = 0

    def observe(self, tokens: int) -> None:
        self.counts[bisect_left(ITERATION_TOKENS_BUCKETS, tokens)] += 1
        self.total += tokens


def pack_gauges(
    stats: Mapping[str, float], steps: StepTokens, accepted_per_pos: Sequence[int]
) -> list[float]:
    return [
        *(float(stats[name]) for name in GAUGES),
        *map(float, steps.counts),
        float(steps.total),
        *map(float, accepted_per_pos),
    ]


def unpack_gauges(values: Sequence[float], num_speculative_tokens: int) -> dict[str, float]:
    """The engine's stats: GAUGES by name, the step histogram as cumulative
    `iteration_tokens_total{le=...}` counts and its `_sum`, and each draft position's accepted
    count under a `position` label."""
    stats = dict(zip(GAUGES, values[:_HISTOGRAM_AT], strict=True))
    deferred = stats.pop("num_requests_waiting_deferred")
    stats["num_requests_waiting_by_reason{reason=capacity}"] = (
        stats["num_requests_waiting"] - deferred
    )
    stats["num_requests_waiting_by_reason{reason=deferred}"] = deferred
    counts = values[_HISTOGRAM_AT : _PER_POSITION_AT - 1]
    cumulative = 0.0
    for bound, count in zip((*map(str, ITERATION_TOKENS_BUCKETS), "+Inf"), counts, strict=True):
        cumulative += count
        stats[f"{ITERATION_TOKENS}{{le={bound}}}"] = cumulative
    stats[f"{ITERATION_TOKENS}_sum"] = values[_PER_POSITION_AT - 1]
    per_pos = values[_PER_POSITION_AT : _PER_POSITION_AT + num_speculative_tokens]
    for position, value in enumerate(per_pos):
        stats[f"spec_decode_num_accepted_tokens_per_pos_total{{position={position}}}"] = value
    return stats
