"""pipeline-bench serve's statistics against a fake server whose timings are known."""

from __future__ import annotations

import asyncio
import json
import threading

import aiohttp
import pytest
from aiohttp import web

from perf.cli import main
from perf.serve_bench import Client, RequestResult, Slo, summarize

TTFT_S, ITL_S, TOKENS = 0.060, 0.020, 6
ASKED: list[dict] = []  # the chat bodies the fake server got


def fake_app() -> web.Application:
    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"count": 2 * len(body["prompt"].split()), "tokens": []})

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        ASKED.append(body)
        if body["messages"][0]["content"].startswith("FAIL"):
            return web.json_response({"error": {"message": "no"}}, status=400)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(TTFT_S)
        for i in range(TOKENS):
            if i:
                await asyncio.sleep(ITL_S)
            chunk = {"choices": [{"index": 0, "delta": {"content": f"t{i}"}}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {
            "choices": [],
            "usage": {"prompt_tokens": 10, "completion_tokens": TOKENS},
            "metrics": {"stage_time_ms": {"render": 1.5, "queue": 0.5, "decode": 100.0}},
        }
        await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/chat/completions", chat)
    return app


@pytest.fixture(scope="module")
def fake_url():
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(fake_app())
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.run_until_complete(runner.cleanup())
    loop.close()


def test_measures_the_fake_servers_known_timings(fake_url, tmp_path):
    out = tmp_path / "serve.json"
    code = main(
        [
            "serve",
            "--url",
            fake_url,
            "--concurrency",
            "1,4",
            "--num-requests",
            "8",
            "--max-tokens",
            "6",
            "--json",
            str(out),
            "--report",
            str(tmp_path / "charts"),
            "--slo",
            "ttft=500,itl=200",
        ]
    )
    assert code == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["concurrency"] for r in runs] == [1, 4]
    # The fake server sleeps for known times, so a figure is never below its sleep (less 2 ms of
    # clock granularity): a figure in seconds, or one that left out an interval, fails. How far
    # above it a figure lands depends on the machine's load, which no test bounds; the
    # statistics over exact timings are test_summary_of_known_timings's.
    e2e = (TTFT_S + (TOKENS - 1) * ITL_S) * 1e3
    for run in runs:
        assert run["completed"] == 8 and run["errors"] == 0
        assert run["ttft_ms"]["p50"] >= TTFT_S * 1e3 - 2, run["ttft_ms"]
        assert run["itl_ms"]["p50"] >= ITL_S * 1e3 - 2, run["itl_ms"]
        assert run["tpot_ms"]["p50"] >= ITL_S * 1e3 - 2, run["tpot_ms"]
        assert run["e2e_ms"]["p50"] >= e2e - 2, run["e2e_ms"]
        assert run["itl_ms"]["p50"] < run["ttft_ms"]["p50"] < run["e2e_ms"]["p50"]
        assert run["mean_output_tokens"] == TOKENS and run["slo_attainment"] == 1.0
        assert run["request_stage_ms"]["render"]["mean"] == pytest.approx(1.5)
        assert run["request_stage_ms"]["decode"]["p50"] == pytest.approx(100.0)
    assert {p.name for p in (tmp_path / "charts").iterdir()} == {
        "ttft_cdf.png",
        "itl_cdf.png",
        "throughput.png",
    }


def test_compare_runs_both_servers_and_prints_ratios(fake_url, capsys):
    assert (
        main(
            [
                "serve",
                "--url",
                fake_url,
                "--compare",
                fake_url,
                "--num-requests",
                "4",
                "--max-tokens",
                "6",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.count(fake_url[-24:]) >= 2  # one row per server
    assert f"c=1: {fake_url} / {fake_url}:" in out and "x output tok/s" in out


def test_open_loop_and_errors_are_counted(fake_url, tmp_path):
    data = tmp_path / "reqs.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "FAIL" if i % 2 else "hi"}], "max_tokens": 6}
        for i in range(6)
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "open.json"
    main(
        [
            "serve",
            "--url",
            fake_url,
            "--request-rate",
            "50",
            "--dataset",
            str(data),
            "--json",
            str(out),
            "--warmup",
            "0",
        ]
    )
    run = json.loads(out.read_text())["runs"][0]
    assert run["request_rate"] == 50 and run["completed"] == 3 and run["errors"] == 3


def test_summary_of_known_timings():
    """Percentiles in milliseconds of each request's own intervals; throughput over the wall."""
    results = [
        RequestResult(
            ok=True,
            start_s=0,
            ttft_s=0.05 * (i + 1),
            e2e_s=0.05 * (i + 1) + 0.08,
            itl_s=[0.02] * 4,
            output_tokens=5,
        )
        for i in range(3)
    ]
    summary = summarize(results, wall_s=2.0, cpu_s=0.1, slo=None)
    assert summary["completed"] == 3 and summary["request_per_s"] == pytest.approx(1.5)
    assert summary["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert summary["itl_ms"]["p50"] == pytest.approx(20.0)
    assert summary["tpot_ms"]["p50"] == pytest.approx(20.0)
    assert summary["e2e_ms"]["p50"] == pytest.approx(180.0)
    assert summary["output_tok_per_s"] == pytest.approx(7.5)


def test_goodput_counts_only_requests_within_the_slo():
    fast = RequestResult(
        ok=True, start_s=0, ttft_s=0.1, e2e_s=0.5, itl_s=[0.05] * 4, output_tokens=5
    )
    slow = RequestResult(
        ok=True, start_s=0, ttft_s=2.0, e2e_s=3.0, itl_s=[0.05] * 4, output_tokens=5
    )
    summary = summarize([fast, slow], wall_s=1.0, cpu_s=0.1, slo=Slo.parse("ttft=1000"))
    assert summary["goodput_req_per_s"] == 1.0 and summary["slo_attainment"] == 0.5
    assert summary["tpot_ms"]["p50"] == pytest.approx((100.0 + 250.0) / 2)  # decode time / 4 tokens
    with pytest.raises(ValueError):
        Slo.parse("latency=3")


def test_grounded_requests_end_at_eos_and_random_ones_run_to_max_tokens(fake_url):
    asked = {}
    for workload in ("random", "grounded"):
        ASKED.clear()
        args = ["serve", "--url", fake_url, "--num-requests", "8", "--workload", workload]
        assert main(args) == 0
        asked[workload] = [body.get("ignore_eos", False) for body in ASKED]
    assert len(asked["grounded"]) == 9 and not any(asked["grounded"])  # the warm-up's too
    assert len(asked["random"]) == 9 and all(asked["random"])
    ASKED.clear()
    assert main(["serve", "--url", fake_url, "--num-requests", "8", "--no-ignore-eos"]) == 0
    assert not any(body.get("ignore_eos", False) for body in ASKED)


def test_requests_are_greedy_unless_a_temperature_is_given(fake_url):
    ASKED.clear()
    assert main(["serve", "--url", fake_url, "--num-requests", "8"]) == 0
    assert {body["temperature"] for body in ASKED} == {0.0}
    ASKED.clear()
    assert main(["serve", "--url", fake_url, "--num-requests", "8", "--temperature", "0.8"]) == 0
    assert {body["temperature"] for body in ASKED} == {0.8}


def test_a_request_written_to_a_connection_the_server_closed_goes_again_once(fake_url):
    """An interleaved --compare leaves pooled keep-alive connections idle past llama-server's 5 s:
    writing the next request on one fails before the server sees it, and the client sends it
    again on a fresh connection (once); any other failure counts as the request's error."""

    async def run(failures: list[Exception]) -> tuple[RequestResult, int]:
        async with aiohttp.ClientSession() as session:
            real_post, calls = session.post, []

            def post(*args, **kwargs):
                calls.append(1)
                if failures:
                    raise failures.pop(0)
                return real_post(*args, **kwargs)

            session.post = post  # type: ignore[method-assign]
            client = Client(session, fake_url, "fake", None, True)
            result = await client.chat([{"role": "user", "content": "hi"}], TOKENS)
            return result, len(calls)

    def stale() -> Exception:
        return aiohttp.ClientOSError(None, f"Can not write request body for {fake_url}")

    result, calls = asyncio.run(run([stale()]))
    assert result.ok and result.output_tokens == TOKENS and calls == 2
    result, calls = asyncio.run(run([stale(), stale()]))  # twice: an error, not a loop
    assert not result.ok and "Can not write request body" in result.error and calls == 2
    refused = aiohttp.ClientOSError(111, "Connect call failed")
    result, calls = asyncio.run(run([refused]))
    assert not result.ok and calls == 1
