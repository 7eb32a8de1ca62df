"""Speculative decoding with a draft model through the four processes, on tiny random models: the
same tokens as without it, drafts counted, and every KV block free after stops, limits, aborts,
preemption and prefix-cache hits."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import pytest

from stages.config import EngineConfig
from stages.engine import Engine
from stages.speculative_config import SpeculativeConfig
from tests.gpu.test_draft_model import perturbed_copy
from tests.stages.conftest import LoopThread
from tests.stages.test_engine import collect, request
from tests.stages.test_speculation_engine import PROMPTS, _config, _tokens, _wait_idle
from tests.stages.tiny import build_tiny_chat_model


def _draft_config(model: str, draft: str, k: int = 3) -> EngineConfig:
    # Every step drafts k: on a tiny model the adaptive policy rightly drafts little.
    spec = SpeculativeConfig.parse(
        f'{{"method": "draft_model", "model": "{draft}", "num_speculative_tokens": {k}, '
        '"adaptive_draft_length": false}'
    )
    return _config(model, spec)


@pytest.fixture(scope="module")
def engines(tiny_chat_model, tmp_path_factory):
    """(plain engine, one drafting with the target itself, one with a near copy, loop thread)."""
    runner = LoopThread()
    near = perturbed_copy(Path(tiny_chat_model), tmp_path_factory.mktemp("near") / "m", 0.3)
    plain = Engine(_config(tiny_chat_model, None))
    same = Engine(_draft_config(tiny_chat_model, tiny_chat_model))
    close = Engine(_draft_config(tiny_chat_model, str(near)))
    for engine in (plain, same, close):
        runner.run(engine.start())
    yield plain, same, close, runner
    for engine in (close, same, plain):
        runner.run(engine.stop())
    runner.close()


def _delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after[name] - before[name]


def test_a_draft_equal_to_the_target_is_always_accepted(engines):
    plain, same, _, loop = engines
    before = _wait_idle(same)
    kwargs = dict(temperature=0, max_tokens=30, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        want = loop.run(collect(plain, request(prompt, rid=f"p{i}", **kwargs)))
        got = loop.run(collect(same, request(prompt, rid=f"s{i}", **kwargs)))
        assert _tokens(got) == _tokens(want), prompt
        assert got[-1].num_output_tokens == 30
    after = _wait_idle(same)
    drafted = _delta(before, after, "spec_decode_num_draft_tokens_total")
    assert drafted > 0
    assert _delta(before, after, "spec_decode_num_accepted_tokens_total") == drafted
    assert after["kv_cache_usage_perc"] == 0


def test_another_draft_keeps_greedy_tokens_stops_and_limits(engines):
    plain, _, close, loop = engines
    base = dict(temperature=0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        want = loop.run(collect(plain, request(prompt, rid=f"q{i}", max_tokens=30, **base)))
        got = loop.run(collect(close, request(prompt, rid=f"c{i}", max_tokens=30, **base)))
        assert _tokens(got) == _tokens(want), prompt
    want = _tokens(loop.run(collect(plain, request(PROMPTS[0], rid="ref", max_tokens=30, **base))))
    for limit in (1, 2, 3, 5, 8):  # nothing after the limit is emitted or counted
        outs = loop.run(
            collect(close, request(PROMPTS[0], rid=f"l{limit}", max_tokens=limit, **base))
        )
        assert _tokens(outs) == want[:limit] and outs[-1].num_output_tokens == limit
    stop_id = want[7]
    outs = loop.run(
        collect(
            close, request(PROMPTS[0], rid="stop", max_tokens=30, stop_token_ids=[stop_id], **base)
        )
    )
    assert _tokens(outs) == want[: want.index(stop_id) + 1] and outs[-1].finish_reason == "stop"
    assert _wait_idle(close)["kv_cache_usage_perc"] == 0


def test_a_seeded_request_gives_the_same_text_every_run(engines):
    """The same text as plain decoding gives the seed, so the same on every run, whichever steps
    carried drafts (the first decode is planned before the prefill's result, or after it)."""
    plain, _, close, loop = engines
    kwargs = dict(temperature=0.9, top_p=0.95, seed=7, max_tokens=30, ignore_eos=True)
    want = loop.run(collect(plain, request(PROMPTS[1], rid="seed-plain", **kwargs)))
    for i in range(3):
        got = loop.run(collect(close, request(PROMPTS[1], rid=f"seed{i}", **kwargs)))
        assert _tokens(got) == _tokens(want)
        assert "".join(o.text for o in got) == "".join(o.text for o in want)


def test_per_request_metrics_count_the_draft_models_steps(engines):
    _, _, close, loop = engines
    before = _wait_idle(close)
    finals = []
    for i, prompt in enumerate(PROMPTS):
        kwargs = dict(temperature=0, max_tokens=20, ignore_eos=True)
        finals.append(loop.run(collect(close, request(prompt, rid=f"m{i}", **kwargs)))[-1].metrics)
    after = _wait_idle(close)
    assert (
        sum(m.spec_num_steps for m in finals)
        == _delta(before, after, "spec_decode_num_drafts_total")
        > 0
    )
    assert sum(m.spec_num_draft_tokens for m in finals) == _delta(
        before, after, "spec_decode_num_draft_tokens_total"
    )
    accepted = sum(m.spec_num_accepted_tokens for m in finals)
    assert accepted == _delta(before, after, "spec_decode_num_accepted_tokens_total")
    per_pos = [
        _delta(before, after, f"spec_decode_num_accepted_tokens_per_pos_total{{position={p}}}")
        for p in range(3)
    ]
    assert sum(per_pos) == accepted
    for m in finals:  # 19 tokens after the prefill's: at most 3 drafts a step, all counted
        assert m.spec_num_draft_tokens <= 3 * m.spec_num_steps
        assert sum(m.spec_acceptance_histogram) == m.spec_num_steps


def test_a_grammars_drafts_are_sampled_under_it_and_verified_exactly(engines):
    """Structured outputs with a draft model: each draft is sampled under the grammar as it
    stands after the drafts before it, so a draft equal to the target has every draft accepted
    (unmasked, its argmax would often be a token the grammar refuses), and the text is plain
    decoding's, greedy or seeded."""
    from stages.api import StructuredOutput

    plain, same, close, loop = engines
    grammar = StructuredOutput("regex", "[a-z ]{80}")
    before = _wait_idle(same)
    greedy = dict(temperature=0, max_tokens=30, ignore_eos=True, structured=grammar)
    seeded = dict(greedy, temperature=0.9, top_p=0.95, seed=11)
    for i, prompt in enumerate(PROMPTS):
        for kind, kwargs in (("g", greedy), ("s", seeded)):
            want = loop.run(collect(plain, request(prompt, rid=f"gp{kind}{i}", **kwargs)))
            text = "".join(o.text for o in want)
            assert len(_tokens(want)) == 30 and re.fullmatch(r"[a-z ]+", text), text
            for engine, tag in ((same, "gs"), (close, "gc")):
                got = loop.run(collect(engine, request(prompt, rid=f"{tag}{kind}{i}", **kwargs)))
                assert _tokens(got) == _tokens(want), (tag, kind, prompt)
    after = _wait_idle(same)
    drafted = _delta(before, after, "spec_decode_num_draft_tokens_total")
    assert drafted > 0
    assert _delta(before, after, "spec_decode_num_accepted_tokens_total") == drafted
    assert after["kv_cache_usage_perc"] == 0


def test_aborts_preemption_prefix_hits_and_grammars_leave_every_block_free(engines):
    """64 blocks of 16 tokens and 20 requests sharing a 5-block prefix, each wanting 5 more
    blocks: preemption, prefix-cache hits (whose blocks hold the draft's KV too), aborts
    mid-stream and grammars (drafted under) beside other drafting rows."""
    from stages.api import StructuredOutput

    plain, same, _, loop = engines
    prefix = "Shared instructions for every request in this test, kept long on purpose. " * 5
    before = same.stats()

    async def run(engine: Engine, tag: str):
        async def one(i: int):
            req = request(
                prefix + f"Request {i}.",
                rid=f"{tag}{i}",
                temperature=0,
                max_tokens=80,
                ignore_eos=True,
                logprobs=1,
                structured=StructuredOutput("regex", "[a-z ]{80}") if i % 4 == 0 else None,
            )
            outs = []
            async for out in engine.generate(req):
                outs.append(out)
                if i % 5 == 0 and len(outs) == 3:
                    break  # leaves mid-stream: an abort
            return outs

        return await asyncio.gather(*(one(i) for i in range(20)))

    got = loop.run(run(same, "d"), timeout=300)
    want = loop.run(run(plain, "w"), timeout=300)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if i % 5:
            assert _tokens(g) == _tokens(w), i
            assert all(o.logprobs is not None and len(o.logprobs) == len(o.token_ids) for o in g)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and same.stats()["kv_cache_usage_perc"] > 0:
        time.sleep(0.05)
    stats = same.stats()
    assert stats["num_preemptions_total"] > before["num_preemptions_total"]
    assert any(r[-1].metrics.num_cached_prompt_tokens > 0 for i, r in enumerate(got) if i % 5)
    assert stats["kv_cache_usage_perc"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]


def test_a_draft_with_another_vocabulary_is_refused_at_start(tiny_chat_model, tmp_path):
    other = build_tiny_chat_model(tmp_path / "other", vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary"):
        Engine(_draft_config(tiny_chat_model, str(other)))


@pytest.mark.slow
def test_execute_killed_mid_speculation_resumes_with_plain_decodings_text(engines):
    """The draft model and its cache die with execute; the resumed requests recompute their KV in
    both models, and a greedy and a seeded one write what plain decoding writes."""
    import os
    import signal

    plain, _, close, loop = engines
    greedy = dict(temperature=0, max_tokens=40, ignore_eos=True)
    seeded = dict(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True)

    async def killed_midway():
        streams = [
            close.generate(request(PROMPTS[1], rid="kg", **greedy)),
            close.generate(request(PROMPTS[2], rid="ks", **seeded)),
        ]
        outs = [[await anext(s) for _ in range(3)] for s in streams]
        os.kill(close.supervisor.pids()["execute"], signal.SIGKILL)
        for got, stream in zip(outs, streams, strict=True):
            got += [out async for out in stream]
        return outs

    got = loop.run(killed_midway(), timeout=180)
    want = [
        loop.run(collect(plain, request(PROMPTS[1], rid="pg", **greedy))),
        loop.run(collect(plain, request(PROMPTS[2], rid="ps", **seeded))),
    ]
    for g, w in zip(got, want, strict=True):
        assert _tokens(g) == _tokens(w)
        assert g[-1].metrics is not None and g[-1].metrics.num_recoveries == 1
    assert _wait_idle(close)["kv_cache_usage_perc"] == 0
