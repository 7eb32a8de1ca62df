"""pipeline-bench's speculative-decoding pieces: the grounded workload, acceptance from /metrics,
and the on/off goal table."""

from __future__ import annotations

import pytest

from perf import serve_bench, spec_bench

METRICS = """# HELP vllm:spec_decode_num_drafts engine counter
vllm:spec_decode_num_drafts_total{model_name="m"} 10.0
vllm:spec_decode_num_draft_tokens_total{model_name="m"} 40.0
vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 30.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 9.0
vllm:generation_tokens_total{model_name="m"} 400.0
"""


def test_grounded_prompts_ask_to_copy_a_function_of_the_project():
    work = serve_bench.grounded(6, 128, seed=3)
    again = serve_bench.grounded(6, 128, seed=3)
    assert work == again and work.max_tokens == [128] * 6
    text = work.prompts[0][0]["content"]
    assert text.startswith("Copy this Python function exactly") and "def " in text
    assert serve_bench.grounded(6, 128, seed=4) != work
    sources = serve_bench._functions_of_the_project()
    assert any(source in text for source in sources)


def test_the_draft_model_method_gets_its_json(tmp_path):
    from stages.speculative_config import SpeculativeConfig

    config = SpeculativeConfig.parse(spec_bench.draft_model_config(str(tmp_path), 4))
    assert (config.method, config.model, config.num_speculative_tokens) == (
        "draft_model",
        str(tmp_path),
        4,
    )


def test_acceptance_comes_from_the_counters_deltas():
    before = serve_bench.parse_spec_counters(METRICS)
    assert before == {
        "vllm:spec_decode_num_drafts_total": 10.0,
        "vllm:spec_decode_num_draft_tokens_total": 40.0,
        "vllm:spec_decode_num_accepted_tokens_total": 30.0,
    }
    after = {name: value * 3 for name, value in before.items()}
    summary = serve_bench.spec_summary(before, after)
    assert summary["acceptance_rate"] == 60 / 80
    assert summary["mean_acceptance_length"] == 1 + 60 / 20
    assert serve_bench.parse_spec_counters("vllm:generation_tokens_total 3.0\n") is None


def _run(tok_s: float, itl_p50: float, spec: dict | None = None) -> dict:
    run = {
        "output_tok_per_s": tok_s,
        "ttft_ms": {"p50": 100.0},
        "itl_ms": {"p50": itl_p50, "p99": 2 * itl_p50},
        "errors": 0,
    }
    if spec:
        run["speculative_decoding"] = spec
    return run


def test_the_table_compares_each_case_with_its_goal():
    spec = {"acceptance_rate": 0.8, "mean_acceptance_length": 3.5, "num_draft_tokens": 100.0}
    met = spec_bench._row("grounded", 1, "output_tok_per_s", 2.5, _run(300, 4, spec), _run(100, 10))
    missed = spec_bench._row("random", 32, "output_tok_per_s", 0.97, _run(90, 10), _run(100, 10))
    itl = spec_bench._row("random", 1, "itl_p50", 1.0, _run(100, 11), _run(100, 10))
    assert met["met"] and met["ratio"] == 3.0 and met["acceptance_rate"] == 0.8
    assert not missed["met"] and missed["ratio"] == 0.9
    assert not itl["met"] and itl["ratio"] == 1.1  # ITL may not grow
    table = spec_bench.format_table({"rows": [met, missed, itl]})
    assert "| grounded | 1 | output_tok_per_s | 3.00 | >= 2.5 |" in table
    assert "0.90 (missed)" in table and "1.10 (missed) | <= 1" in table


def test_a_server_that_cannot_start_is_reported_with_its_log_in_a_new_log_dir(tmp_path):
    """`--log-dir` may name a folder that does not exist yet; a server that exits at start is an
    error naming its log, which holds the reason."""
    log_path = tmp_path / "new" / "logs" / "spec-on.log"
    with (
        pytest.raises(RuntimeError, match="pipeline-serve exited"),
        spec_bench._server(["--no-such-flag"], 8699, str(log_path)),
    ):
        pass
    assert "--no-such-flag" in log_path.read_text()


@pytest.mark.parametrize(("fresh", "pairs_started"), [(True, 3), (False, 1)])
def test_each_repeat_runs_on_a_fresh_pair_of_servers(monkeypatch, tmp_path, fresh, pairs_started):
    """Two server processes differ for their whole lives: by default every repeat starts a new
    pair (the last one stopped first), and each pair is compared in alternating order."""
    import contextlib

    events: list[str] = []

    @contextlib.contextmanager
    def fake_server(args, port, log_path):
        name = f"{'on' if '--speculative-config' in args else 'off'}{len(events)}"
        events.append(f"start {name}")
        yield name
        events.append(f"stop {name}")

    orders = []

    async def fake_run_serve(args):
        orders.append(args.urls)
        runs = [{**_run(100, 5), "url": url} for url in args.urls]
        return {"runs": runs}, None

    monkeypatch.setattr(spec_bench, "_server", fake_server)
    monkeypatch.setattr(serve_bench, "run_serve", fake_run_serve)
    report = spec_bench.run_spec_bench(
        spec_bench.SpecBenchArgs(repeats=3, fresh_servers=fresh), str(tmp_path)
    )
    assert len(report["rows"]) == 3 * len(spec_bench.CASES)
    assert sum(e.startswith("start on") for e in events) == pairs_started
    assert len([e for e in events if e.startswith("stop")]) == 2 * pairs_started
    if fresh:  # a pair stops before the next starts
        assert events[2:6] == ["stop off1", "stop on0", "start on4", "start off5"]
    first_of_each_repeat = [orders[i * len(spec_bench.CASES)] for i in range(3)]
    assert [urls[0].startswith("on") for urls in first_of_each_repeat] == [True, False, True]
