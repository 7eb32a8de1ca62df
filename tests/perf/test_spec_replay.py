"""`pipeline-bench spec --ceiling`'s replay: a greedy output walked the way schedule drafts it."""

from __future__ import annotations

import numpy as np
import pytest

from perf import spec_bench
from perf.spec_replay import Replay, linear_cost, replay, replay_all, with_prefill
from stages.speculation import SuffixCache
from stages.speculative_config import SpeculativeConfig

NGRAM = SpeculativeConfig.parse(
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
    '"prompt_lookup_max": 5}'
)


def ids(values) -> np.ndarray:
    return np.asarray(list(values), np.int32)


def test_a_faithful_copy_drafts_k_after_the_first_bigram_and_the_tail_what_max_tokens_leaves():
    prompt = ids(range(1, 41))
    output = ids(range(11, 31))  # 20 tokens copied from the prompt
    result = replay(NGRAM, prompt, output, linear_cost(2.0, 4))
    # Output 11 (the prefill's) follows 40: no earlier bigram, one token; then (11, 12) proposes
    # 13-16, all accepted, three times; the last step has room for 2 drafts (max_tokens).
    assert (result.steps, result.tokens) == (5, 19)
    assert (result.proposed_steps, result.drafted, result.accepted) == (4, 14, 14)
    assert result.cost == pytest.approx(1 + 3 * 2.0 + 1.5)
    assert result.ratio == pytest.approx(19 / 8.5)
    assert result.oracle_cost == result.cost  # every draft accepted: nothing to save


def test_drafts_past_a_divergence_are_rejected_and_the_perfect_policy_would_not_draft_them():
    prompt = ids(range(1, 41))
    output = ids([*range(11, 19), 900, 901, 902, 903, 904, 905])  # copies 8, then writes anew
    result = replay(NGRAM, prompt, output, linear_cost(2.0, 4))
    assert result.tokens == len(output) - 1
    assert result.accepted < result.drafted
    assert result.oracle_cost < result.cost and result.oracle_ratio > result.ratio


def test_text_with_nothing_to_look_up_takes_a_step_per_token_at_plain_cost():
    result = replay(NGRAM, ids(range(1, 30)), ids(range(100, 120)), linear_cost(2.0, 4))
    assert (result.steps, result.tokens, result.drafted) == (19, 19, 0)
    assert result.ratio == result.oracle_ratio == 1.0


def test_suffix_decoding_replays_recent_outputs_in_order():
    spec = SpeculativeConfig.parse('{"method": "suffix", "num_speculative_tokens": 8}')
    answer = ids(range(100, 140))
    first = (ids(range(1, 20)), answer)
    second = (ids(range(200, 220)), answer)  # another prompt, the same answer
    cost = linear_cost(1.5, 8)
    alone = replay(spec, *second, cost)
    assert alone.drafted == 0  # its own tokens never repeat
    cache = SuffixCache(10)
    cache.add([int(t) for t in answer])
    after = replay(spec, *second, cost, cache)
    # Every draft is right (the cached answer is this one); drafts grow with the match (the
    # spec factor of 1 allows as many as the tokens matched).
    assert after.accepted == after.drafted > 20 and after.tokens / after.steps > 3
    both = replay_all(spec, [first, second], cost)
    expected = Replay()
    expected.add(replay(spec, *first, cost))
    expected.add(after)
    assert both == expected


def test_a_draft_model_has_nothing_to_replay(tmp_path):
    spec = SpeculativeConfig.parse(spec_bench.draft_model_config(str(tmp_path), 4))
    with pytest.raises(ValueError, match="draft model"):
        replay(spec, ids(range(5)), ids(range(5)), linear_cost(2.0, 4))


def test_the_ceiling_table_sets_each_case_beside_its_goal():
    row = {
        "workload": "grounded",
        "concurrency": 1,
        "verify_decode_steps": 1.4,
        "steps_with_proposal": 0.41,
        "acceptance_rate": 0.69,
        "tokens_per_step": 2.41,
        "ratio": 2.27,
        "oracle_ratio": 2.31,
    }
    eight = {**row, "concurrency": 8}
    row |= {"prefill_share": 0.1, "ratio_with_prefill": 2.01, "oracle_ratio_with_prefill": 2.05}
    table = spec_bench.format_ceiling({"rows": [row, eight]})
    assert (
        "| grounded | 1 | 1.40 | 41% | 69% | 2.41 | 2.27x | 2.31x (goal 2.5x) "
        "| 2.01x / 2.05x (TTFT 10% of the time off) |" in table
    )
    assert "| grounded | 8 | 1.40 | 41% | 69% | 2.41 | 2.27x | 2.31x (goal 1.8x) | - |" in table


def test_the_prefill_both_servers_pay_bounds_the_ratio_as_output_tok_s_counts_it():
    # 20 tokens after the first, 20 plain steps off; 10 decode steps' cost on (8 perfectly)
    half = Replay(steps=5, tokens=20, cost=10.0, oracle_cost=8.0)
    assert with_prefill([half], [(0.0, 1.0)]) == pytest.approx(half.ratio) == 2.0
    assert with_prefill([half], [(0.0, 1.0)], oracle=True) == pytest.approx(half.oracle_ratio)
    # 0.2 s to the first token, 0.8 s of decoding that halves: 1.0 / 0.6
    assert with_prefill([half], [(0.2, 1.0)]) == pytest.approx(1 / 0.6)
    # Requests weigh by their time: a long one that does not speed up pulls the ratio to 1.
    plain = Replay(steps=10, tokens=10, cost=10.0, oracle_cost=10.0)
    assert with_prefill([half, plain], [(0.0, 1.0), (0.0, 9.0)]) == pytest.approx(10 / 9.5)


def test_the_greedy_outputs_are_read_from_the_stream_with_their_timings():
    import asyncio
    import json
    import time

    chunks = [
        {"prompt_token_ids": [1, 2, 3], "choices": [{"index": 0, "token_ids": []}]},
        {"choices": [{"index": 0, "token_ids": [7]}]},
        {"choices": [{"index": 0, "token_ids": [8, 9]}]},
        {"choices": [], "usage": {"completion_tokens": 3}},
    ]

    class Content:
        def __aiter__(self):
            return self.lines()

        async def lines(self):
            for chunk in chunks:
                await asyncio.sleep(0.01)
                yield f"data: {json.dumps(chunk)}\n".encode()
                yield b"\n"
            yield b"data: [DONE]\n"

    class Response:
        content = Content()

    started = time.perf_counter()
    out = asyncio.run(spec_bench._read_stream(Response(), started))
    assert out.prompt_ids.tolist() == [1, 2, 3] and out.output_ids.tolist() == [7, 8, 9]
    assert 0.015 <= out.ttft_s < out.e2e_s  # the first token came with the second chunk
    chunks[2] = {"error": {"message": "stage failed", "code": 500}}
    with pytest.raises(RuntimeError, match="stage failed"):
        asyncio.run(spec_bench._read_stream(Response(), time.perf_counter()))


def test_spec_refuses_options_it_would_not_honour(tmp_path):
    from perf import cli

    with pytest.raises(SystemExit, match="runs once"):
        cli.main(["spec", "--ceiling", "--repeats", "2"])
    with pytest.raises(SystemExit, match="draft model"):
        cli.main(["spec", "--ceiling", "--draft-model", str(tmp_path)])
    with pytest.raises(SystemExit, match="goes with --ceiling"):
        cli.main(["spec", "--ceiling-weights", "bf16"])
    with pytest.raises(SystemExit, match="goes with --draft-model"):
        cli.main(["spec", "--num-speculative-tokens", "4"])
