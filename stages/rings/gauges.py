"""The gauges schedule publishes on its control block (pipeline/control.py) for the server's
/metrics: these names, in this order, then one accepted-token count per draft position."""

from __future__ import annotations

GAUGES = (
    "num_requests_running",
    "num_requests_waiting",
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
