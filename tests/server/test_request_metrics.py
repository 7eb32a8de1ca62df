"""Per-request metrics derived from the stages' stamps."""

from __future__ import annotations

import pytest

from server.metrics import ServerMetrics
from server.request_metrics import request_metrics_body
from stages.api import RequestMetrics

MS = 1_000_000


def stamps(**overrides: object) -> RequestMetrics:
    fields: dict[str, object] = dict(
        arrival_ns=1,
        render_start_ns=1,
        rendered_ns=2 * MS + 1,
        scheduled_ns=5 * MS + 1,
        first_token_ns=20 * MS + 1,
        last_token_ns=110 * MS + 1,
        finished_ns=125 * MS + 1,
        detokenize_ns=1 * MS,
        num_generated_tokens=10,
    )
    fields.update(overrides)
    return RequestMetrics(**fields)  # type: ignore[arg-type]


def test_timings() -> None:
    body = request_metrics_body(stamps())
    # vLLM's definitions: the first token counted from scheduling, the rate over scheduling to
    # the last token
    assert body["time_to_first_token_ms"] == pytest.approx(15.0)
    assert body["generation_time_ms"] == pytest.approx(90.0)
    assert body["mean_itl_ms"] == pytest.approx(10.0)
    assert body["queue_time_ms"] == pytest.approx(3.0)
    assert body["tokens_per_second"] == pytest.approx(10 / 0.105)
    assert body["e2e_latency_ms"] == pytest.approx(125.0)
    assert body["stage_time_ms"] == pytest.approx(
        {"render": 2.0, "queue": 3.0, "prefill": 15.0, "decode": 90.0, "detokenize": 1.0}
    )
    assert "speculative_decoding" not in body


def test_single_token_has_no_itl() -> None:
    body = request_metrics_body(stamps(num_generated_tokens=1, last_token_ns=20 * MS))
    assert "mean_itl_ms" not in body  # as vLLM leaves it out


def test_speculative_decoding() -> None:
    body = request_metrics_body(
        stamps(
            spec_num_steps=4,
            spec_num_draft_tokens=12,
            spec_num_accepted_tokens=9,
            spec_acceptance_histogram=(1, 0, 1, 2),
        )
    )
    assert body["speculative_decoding"] == {
        "num_spec_steps": 4,
        "num_draft_tokens": 12,
        "num_accepted_draft_tokens": 9,
        "draft_acceptance_rate": 0.75,
        "mean_acceptance_length": 3.25,
        "acceptance_histogram": [1, 0, 1, 2],
        "num_spec_tokens": 3,
    }


def test_itl_histogram_spreads_a_merged_output_over_its_tokens() -> None:
    metrics = ServerMetrics(lambda: {}, "m")
    metrics.observe_tokens(1, None)  # the first output has no gap
    metrics.observe_tokens(3, 0.03)  # three tokens that arrived together, 10 ms each
    metrics.observe_tokens(1, 0.005)  # on a bucket's bound: counted in that bucket (le)
    lines = metrics.render().decode().splitlines()
    bucket = 'vllm:inter_token_latency_seconds_bucket{{le="{}",model_name="m"}} {}'
    assert bucket.format("0.001", "0.0") in lines
    assert bucket.format("0.005", "1.0") in lines
    assert bucket.format("0.01", "4.0") in lines
    assert bucket.format("+Inf", "4.0") in lines
    (total,) = [line for line in lines if line.startswith("vllm:inter_token_latency_seconds_sum")]
    assert float(total.split()[-1]) == pytest.approx(0.035)
    assert 'vllm:generation_tokens_total{model_name="m"} 5.0' in lines


def test_under_data_parallel_each_count_is_the_serving_replicas() -> None:
    gauges = {  # as the data-parallel engine reports its replicas' (stages/data_parallel.py)
        f"{name}{{engine={rank}}}": 0.0
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
        for rank in (0, 1)
    }
    metrics = ServerMetrics(lambda: gauges, "m", num_engines=2)
    metrics.observe_first_output(7, 0.02, engine=1)
    metrics.observe_tokens(1, None, engine=1)
    metrics.observe_tokens(2, 0.02, engine=1)
    metrics.observe_finish("stop", 0.1, 7, 3, stamps(), max_tokens=16, engine=1)
    metrics.observe_request(1, 3, engine=1)
    lines = metrics.render().decode().splitlines()
    for name, served in (
        ("vllm:prompt_tokens_total", "7.0"),
        ("vllm:generation_tokens_total", "3.0"),
        ("vllm:inter_token_latency_seconds_count", "2.0"),
        ("vllm:time_to_first_token_seconds_count", "1.0"),
        ("vllm:e2e_request_latency_seconds_count", "1.0"),
        ("vllm:request_prefill_time_seconds_count", "1.0"),
        ("vllm:request_params_max_tokens_count", "1.0"),
        ("vllm:request_params_n_count", "1.0"),
    ):
        assert f'{name}{{engine="1",model_name="m"}} {served}' in lines, name
        # the replica that served nothing has its series, at zero
        assert f'{name}{{engine="0",model_name="m"}} 0.0' in lines, name
    assert 'vllm:request_success_total{engine="1",finished_reason="stop",model_name="m"} 1.0' in (
        lines
    )
    assert not [line for line in lines if line.startswith("vllm:") and 'engine="' not in line]


def test_an_engine_histogram_is_served_as_one() -> None:
    # engine.stats() carries a histogram as cumulative `le` buckets and a `_sum` (stages/rings/
    # gauges.py); /metrics must serve vLLM's histogram, per data-parallel replica when labelled.
    stats = {
        "iteration_tokens_total{engine=0,le=1}": 3.0,
        "iteration_tokens_total{engine=0,le=8}": 4.0,
        "iteration_tokens_total{engine=0,le=+Inf}": 5.0,
        "iteration_tokens_total_sum{engine=0}": 40.0,
        "iteration_tokens_total{engine=1,le=1}": 0.0,
        "iteration_tokens_total{engine=1,le=8}": 1.0,
        "iteration_tokens_total{engine=1,le=+Inf}": 1.0,
        "iteration_tokens_total_sum{engine=1}": 8.0,
    }
    text = ServerMetrics(lambda: stats, "m").render().decode()
    assert "# TYPE vllm:iteration_tokens_total histogram" in text
    assert 'vllm:iteration_tokens_total_bucket{engine="0",le="8.0",model_name="m"} 4.0' in text
    assert 'vllm:iteration_tokens_total_count{engine="0",model_name="m"} 5.0' in text
    assert 'vllm:iteration_tokens_total_sum{engine="1",model_name="m"} 8.0' in text
    assert "engine gauge iteration" not in text and "engine counter iteration" not in text
