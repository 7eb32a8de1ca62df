"""Per-request timing and speculative-decoding metrics for the response body, from the stamps
the stages took (`RequestMetrics`)."""

from __future__ import annotations

from typing import Any

from stages.api import RequestMetrics

_NS_PER_MS = 1e6


def request_metrics_body(metrics: RequestMetrics) -> dict[str, Any]:
    """vLLM's per-request fields (its build_per_request_timing_metrics) plus where the request
    spent its time, stage by stage.

    time_to_first_token_ms: first scheduled to the first output token (the prefill; vLLM's).
    generation_time_ms: first to last output token.
    queue_time_ms: rendered to first scheduled.
    mean_itl_ms: generation_time_ms over the gaps between output tokens (absent with fewer than
        two tokens, as vLLM leaves it out).
    tokens_per_second: output tokens over first scheduled to the last token (vLLM's inference
        interval, prefill included).
    e2e_latency_ms and stage_time_ms: arrival to finish, and its parts.
    """
    num_tokens = metrics.num_generated_tokens
    generation_ns = max(metrics.last_token_ns - metrics.first_token_ns, 0)
    inference_ns = max(metrics.last_token_ns - metrics.scheduled_ns, 0)
    e2e_ns = max(metrics.finished_ns - metrics.arrival_ns, 0)
    body: dict[str, Any] = {
        "time_to_first_token_ms": metrics.prefill_s * 1e3,
        "generation_time_ms": generation_ns / _NS_PER_MS,
        "e2e_latency_ms": e2e_ns / _NS_PER_MS,
        "queue_time_ms": metrics.queue_s * 1e3,
        "tokens_per_second": num_tokens / (inference_ns / 1e9) if inference_ns > 0 else 0.0,
        "num_generated_tokens": num_tokens,
        "num_cached_prompt_tokens": metrics.num_cached_prompt_tokens,
        "num_preemptions": metrics.num_preemptions,
        "stage_time_ms": {
            "render": metrics.render_s * 1e3,
            "queue": metrics.queue_s * 1e3,
            "prefill": metrics.prefill_s * 1e3,
            "decode": metrics.decode_s * 1e3,
            "detokenize": metrics.detokenize_s * 1e3,
        },
    }
    if num_tokens > 1:
        body["mean_itl_ms"] = generation_ns / _NS_PER_MS / (num_tokens - 1)
    if metrics.spec_num_steps or metrics.spec_num_draft_tokens:
        steps = metrics.spec_num_steps
        drafted = metrics.spec_num_draft_tokens
        accepted = metrics.spec_num_accepted_tokens
        body["speculative_decoding"] = {
            "num_spec_steps": steps,
            "num_draft_tokens": drafted,
            "num_accepted_draft_tokens": accepted,
            "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
            # vLLM counts the bonus token: every verification step yields accepted + 1 tokens
            "mean_acceptance_length": 1.0 + accepted / steps if steps else 0.0,
            "acceptance_histogram": list(metrics.spec_acceptance_histogram),
            # k: the histogram counts steps that accepted 0..k drafts
            "num_spec_tokens": max(len(metrics.spec_acceptance_histogram) - 1, 0),
        }
    return body
