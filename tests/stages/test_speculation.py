"""Speculative decoding's parts on their own: the config, prompt lookup, the draft policy, and the
scheduler's drafted steps (KV given back, stops and limits inside a draft, planned a step ahead)."""

from __future__ import annotations

import numpy as np
import pytest

from stages import draft_policy
from stages.draft_policy import StepCost, plan_drafts, update_acceptance
from stages.rings import common as m
from stages.scheduler import Scheduler, SchedulerConfig, Status
from stages.speculation import SuffixCache, propose_ngram, propose_suffix
from stages.speculative_config import SpeculativeConfig, SuffixParams
from tests.stages.test_scheduler import seq

# -- config ----------------------------------------------------------------------------------------


def test_config_takes_vllms_json_and_defaults():
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)  # vLLM's defaults
    one = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    )
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (4, 4)
    old = SpeculativeConfig.parse('{"model": "[ngram]", "num_speculative_tokens": 2}')
    assert old.method == "ngram"


def test_config_takes_a_draft_model(tmp_path):
    text = f'{{"method": "draft_model", "model": "{tmp_path}", "num_speculative_tokens": 3}}'
    config = SpeculativeConfig.parse(text)
    assert (config.method, config.model, config.num_speculative_tokens) == (
        "draft_model",
        str(tmp_path),
        3,
    )
    assert config.drafts_with_a_model
    # vLLM reads a bare model as a draft model
    bare = SpeculativeConfig.parse(f'{{"model": "{tmp_path}", "num_speculative_tokens": 2}}')
    assert bare.method == "draft_model" and bare.drafts_with_a_model
    assert not SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2}').model


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("not json", "not JSON"),
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 99}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
         '"prompt_lookup_max": 2}', "must be <="),
        ('{"method": "draft_model", "model": "x", "num_speculative_tokens": 2}',
         "not a model directory"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', 'needs "model"'),
        ('{"method": "draft_model", "model": ".", "draft_tensor_parallel_size": 2, '
         '"num_speculative_tokens": 2}', "must be 1"),
        ('{"method": "draft_model", "model": ".", "num_speculative_tokens": 2, '
         '"quantization": "fp8"}', "not supported"),
        ('{"method": "draft_model", "model": "."}', "num_speculative_tokens"),
        ('{"method": "eagle", "model": ".", "num_speculative_tokens": 2}', "not supported"),
        ('{"method": "medusa2", "num_speculative_tokens": 2}', "unknown"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "speculative_token_tree": "x"}',
         "not supported"),
    ],
)  # fmt: skip
def test_config_refuses_what_it_cannot_honour(text, says):
    with pytest.raises(ValueError, match=says):
        SpeculativeConfig.parse(text)


# -- prompt lookup ---------------------------------------------------------------------------------


def _ids(*tokens: int) -> np.ndarray:
    return np.array(tokens, np.int32)


def test_prompt_lookup_follows_vllms_example():
    # vLLM's docstring: [4, 2, 3] has no earlier match, [2, 3] does; three tokens follow it.
    assert propose_ngram(_ids(1, 2, 3, 4, 2, 3), 2, 3, 4).tolist() == [4, 2, 3]


def test_prompt_lookup_prefers_the_longest_then_the_earliest_match():
    tokens = _ids(9, 2, 3, 50, 1, 2, 3, 60, 1, 2, 3, 70, 1, 2, 3)
    # [1, 2, 3] occurs at 4 and 8; [2, 3] alone also at 1: the longest wins, then the earliest
    assert propose_ngram(tokens, 1, 3, 2).tolist() == [60, 1]
    assert propose_ngram(tokens, 1, 2, 2).tolist() == [50, 1]  # n capped at 2: earliest [2, 3]
    assert propose_ngram(tokens, 4, 5, 2).tolist() == []  # nothing of length 4 matches


def test_prompt_lookup_without_a_match_or_room_proposes_nothing():
    assert propose_ngram(_ids(1, 2, 3, 4), 1, 3, 4).tolist() == []
    assert propose_ngram(_ids(5, 5), 1, 1, 0).tolist() == []
    assert propose_ngram(_ids(5), 1, 1, 3).tolist() == []
    assert propose_ngram(_ids(5, 5, 5), 1, 2, 3).tolist() == [5]  # overlap: what follows [5, 5]


def test_prompt_lookup_matches_a_brute_force_search():
    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens = rng.integers(0, 4, rng.integers(1, 40)).astype(np.int32)
        low = int(rng.integers(1, 4))
        high = low + int(rng.integers(0, 3))
        want: list[int] = []
        for n in range(high, low - 1, -1):
            if n >= len(tokens):
                continue
            suffix = tokens[len(tokens) - n :].tolist()
            ends = [
                e
                for e in range(n - 1, len(tokens) - 1)
                if tokens[e - n + 1 : e + 1].tolist() == suffix
            ]
            if ends:
                want = tokens[ends[0] + 1 : ends[0] + 1 + 3].tolist()
                break
        assert propose_ngram(tokens, low, high, 3).tolist() == want, (tokens.tolist(), low, high)


# -- the draft policy ------------------------------------------------------------------------------


def test_cost_fit_recovers_fixed_and_per_token_time():
    cost = StepCost()
    for tokens in [1, 5, 2, 9, 1, 3] * 10:
        cost.observe(tokens, 0.004 + 0.0015 * tokens)
    assert cost.fixed_s == pytest.approx(0.004, rel=1e-6)
    assert cost.per_token_s == pytest.approx(0.0015, rel=1e-6)


def test_steps_of_one_size_do_not_refit_what_a_token_costs():
    cost = StepCost()
    for tokens in [1, 6] * 20:
        cost.observe(tokens, 0.006 + 0.004 * tokens)
    assert cost.per_token_s == pytest.approx(0.004, rel=1e-3)
    rng = np.random.default_rng(0)
    for _ in range(200):  # 32 streams decoding: sizes 32-33, times noisy by a few percent
        tokens = 32 + int(rng.integers(0, 2))
        cost.observe(tokens, (0.006 + 0.004 * tokens) * rng.uniform(0.95, 1.05))
    assert cost.per_token_s == pytest.approx(0.004, rel=0.1)  # the noise does not set the slope
    assert cost.step_s(32) == pytest.approx(0.006 + 0.004 * 32, rel=0.05)


def test_drafts_go_where_they_pay_and_not_where_steps_are_compute_bound():
    memory_bound = StepCost(fixed_s=0.010, per_token_s=0.0005)
    # one stream that accepts most drafts: take them all
    assert plan_drafts(memory_bound, 1, 1, [(0.9, 4)]) == [4]
    # two streams: the promising one drafts deeper than the poor one
    counts = plan_drafts(memory_bound, 2, 2, [(0.9, 4), (0.2, 4)])
    assert counts[0] == 4 and counts[1] < 4
    # a stream whose drafts are never accepted gets none
    assert plan_drafts(memory_bound, 1, 1, [(0.01, 4)]) == [0]
    # compute-bound: 32 streams where each token costs as much as the whole fixed part
    compute_bound = StepCost(fixed_s=0.002, per_token_s=0.005)
    assert plan_drafts(compute_bound, 32, 32, [(0.6, 4)] * 32) == [0] * 32
    assert plan_drafts(compute_bound, 1, 1, []) == []


def test_acceptance_follows_what_steps_accept():
    a = draft_policy.PRIOR_ACCEPTANCE
    high = a
    for _ in range(10):
        high = update_acceptance(high, 4, 4)
    assert high > 0.95
    low = a
    for _ in range(10):
        low = update_acceptance(low, 4, 0)
    assert low == draft_policy.MIN_ACCEPTANCE  # never zero
    assert update_acceptance(0.3, 0, 0) == 0.3
    # steps with a proposal and no drafts bring it back toward the prior: it is tried again
    cpu = StepCost(fixed_s=0.008, per_token_s=0.004)  # tokens cost much
    assert plan_drafts(cpu, 1, 1, [(a, 4)]) != [0]  # the prior tries
    waited = 0
    while plan_drafts(cpu, 1, 1, [(low, 4)]) == [0]:
        low = draft_policy.undrafted(low)
        waited += 1
    assert 5 < waited < 60


# -- the scheduler ---------------------------------------------------------------------------------

SPEC = SpeculativeConfig("ngram", 4, 1, 3)


def make(num_blocks=64, budget=32, block_size=4, max_len=512) -> Scheduler:
    return Scheduler(SchedulerConfig(8, budget, max_len, num_blocks, block_size, speculative=SPEC))


def repeating(handle: int, max_tokens: int = 100):
    """A request whose prompt repeats: prompt lookup proposes what followed its last tokens."""
    return seq(handle, 12, max_tokens, prompt=np.array([5, 6, 7, 8] * 3, np.int32))


def complete(s: Scheduler, step, tokens_per_row: list[list[int]], drafted: list[int] | None = None):
    """Apply a step's tokens as execute returns them; `drafted`: the drafts it filled into each
    row's reserved positions (all of them unless given)."""
    handles = np.array([x.seq.handle for x in step.seqs])
    counts = np.array([len(t) for t in tokens_per_row], np.int32)
    flat = np.array([t for row in tokens_per_row for t in row], np.int64)
    filled = np.array([x.num_draft for x in step.seqs] if drafted is None else drafted, np.int32)
    # a step's time as on a CPU: 10 ms, and 0.5 ms more per token
    took_ns = 10_000_000 + 500_000 * sum(x.num_tokens for x in step.seqs)
    return s.complete(
        step.step_id, handles, flat, counts, 1_000, 1_000 + took_ns, num_drafted=filled
    )[0]


def test_a_decode_carries_drafts_and_rejected_ones_give_their_kv_back():
    s = make()
    r = repeating(1)
    s.add(r)
    step = s.schedule()  # the prompt; it samples the first output
    complete(s, step, [[5]])
    assert s.max_in_flight == 2  # drafting costs no overlap
    r.acceptance = 0.9  # as after steps that accepted most drafts: the policy drafts all four
    step = s.schedule()
    planned = step.seqs[0]
    # after [..., 7, 8, 5] lookup proposes four (6, 7, 8, 5): four positions for execute to fill
    assert planned.draft.tolist() == [-1] * 4 and planned.num_tokens == 5
    assert r.num_computed == 12 + 5 and len(r.blocks) == 5  # KV for the drafts, 17 tokens
    # the model agrees with two drafts, then samples 9: three tokens out
    out = complete(s, step, [[6, 7, 9]])
    assert [t for _, t in out] == [6, 7, 9]
    assert r.output_ids == [5, 6, 7, 9]
    assert r.num_computed == 12 + 3  # the rejected drafts' positions are free to rewrite
    assert len(r.blocks) == 4  # the block only they used is given back
    assert (r.spec_steps, r.spec_drafted, r.spec_accepted) == (1, 4, 2)
    assert r.spec_histogram[2] == 1 and s.accepted_per_pos[:3] == [1, 1, 0]
    assert s.blocks.num_free == 64 - 4


def test_max_tokens_and_stop_ids_inside_a_draft_end_the_output_there():
    s = make()
    r = repeating(1, max_tokens=3)
    s.add(r)
    complete(s, s.schedule(), [[5]])
    step = s.schedule()
    assert step.seqs[0].num_draft == 1  # no draft could be emitted past max_tokens - 1
    complete(s, step, [[6, 7]])
    assert r.output_ids == [5, 6, 7] and r.status == Status.FINISHED and r.finish == m.FINISH_LENGTH

    s = make()
    r = repeating(2)
    r.stop_ids = frozenset({7})
    s.add(r)
    complete(s, s.schedule(), [[5]])
    step = s.schedule()
    out = complete(s, step, [[6, 7, 8, 5, 6]])  # every draft accepted and a bonus; 7 is a stop id
    assert [t for _, t in out] == [6, 7]
    assert r.finish == m.FINISH_STOP and s.blocks.num_free == 64


def test_a_preempted_or_aborted_request_with_drafts_in_flight_frees_everything():
    s = make()
    r = repeating(1)
    s.add(r)
    complete(s, s.schedule(), [[5]])
    step = s.schedule()
    assert step.seqs[0].num_draft
    s.abort(1)
    assert complete(s, step, [[6, 7, 8]]) == []
    assert s.blocks.num_free == 64 and not s.by_handle


def test_without_proposals_steps_stay_two_in_flight():
    s = make()
    s.add(seq(1, 6))  # a prompt that never repeats
    complete(s, s.schedule(), [[900]])
    step = s.schedule()
    assert step.seqs[0].draft is None and step.seqs[0].num_tokens == 1


def test_a_request_verifying_drafts_is_planned_a_step_ahead_as_if_all_were_accepted():
    """The next step is planned while drafts are verified: from where every draft accepted
    would leave the request, with the KV blocks that needs; the result moves it back by those
    rejected, and the step in flight (execute moved it back too) agrees again."""
    s = make()
    a, b = repeating(1), seq(2, 6)
    a.acceptance = 0.9
    s.add(a)
    s.add(b)
    complete(s, s.schedule(), [[5], [900]])
    step2 = s.schedule()  # a verifies four drafts; b decodes
    assert [x.num_draft for x in step2.seqs] == [4, 0]
    assert a.num_computed == 12 + 5
    step3 = s.schedule()  # planned while step 2 runs: a too, its input and drafts unknown
    row = {x.seq.handle: x for x in step3.seqs}[1]
    assert row.start == 12 + 5 and a.token_at(row.start) == -1
    assert row.num_draft == 4 and a.num_computed == 12 + 5 + 5
    assert len(a.blocks) * 4 >= 12 + 10  # room for both steps had every draft been accepted
    assert s.max_in_flight == 2  # (the schedule stage plans no third)
    complete(s, step2, [[6, 7, 9], [901]])  # two of a's drafts accepted: two positions back
    assert a.output_ids == [5, 6, 7, 9] and a.num_computed == 12 + 3 + 5
    # execute filled one of step 3's four positions for a, and it was accepted
    complete(s, step3, [[8, 5], [902]], drafted=[1, 0])
    assert a.output_ids == [5, 6, 7, 9, 8, 5]
    assert a.num_computed == a.num_tokens - 1  # exactly its next input left to compute
    assert (a.spec_steps, a.spec_drafted, a.spec_accepted) == (2, 5, 3)
    assert len(a.blocks) == s.blocks.blocks_for(a.num_computed + 1)
    step4 = s.schedule()
    assert {x.seq.handle: x for x in step4.seqs}[1].start == a.num_prompt + 6 - 1


def test_positions_execute_had_no_draft_for_count_as_nothing_verified():
    s = make()
    r = repeating(1)
    r.acceptance = 0.9
    s.add(r)
    complete(s, s.schedule(), [[5]])
    step = s.schedule()
    assert step.seqs[0].num_draft == 4
    before = r.acceptance
    complete(s, step, [[6]], drafted=[0])
    assert (r.spec_steps, r.spec_drafted) == (0, 0) and s.num_spec_drafts == 0
    assert r.acceptance == before and r.num_computed == 12 + 1
    assert s.blocks.num_free == 64 - s.blocks.blocks_for(14)


def test_a_draft_model_gets_k_placeholder_positions_and_their_kv_back(tmp_path):
    spec = SpeculativeConfig("draft_model", 3, model=str(tmp_path), adaptive_draft_length=False)
    s = Scheduler(SchedulerConfig(8, 32, 512, 64, 4, speculative=spec))
    r = seq(1, 6, max_tokens=5)  # a prompt that never repeats: a draft model drafts anyway
    s.add(r)
    complete(s, s.schedule(), [[900]])
    step = s.schedule()
    # execute's draft model fills in the drafts: schedule only reserves their positions
    assert step.seqs[0].draft.tolist() == [-1, -1, -1] and r.num_computed == 6 + 1 + 3
    out = complete(s, step, [[901, 902]])  # one draft accepted
    assert [t for _, t in out] == [901, 902] and r.num_computed == 6 + 2
    step = s.schedule()
    assert step.seqs[0].draft.tolist() == [-1]  # no draft past max_tokens - 1
    complete(s, step, [[903, 904]])
    assert r.status == Status.FINISHED and s.blocks.num_free == 64
    assert (r.spec_steps, r.spec_drafted, r.spec_accepted) == (2, 4, 2)


# -- suffix decoding -------------------------------------------------------------------------------


def _reference_suffix(haystack, context, k, params):
    """A depth-limited suffix trie, built as SuffixDecoding builds it (a node per substring of at
    most max_tree_depth tokens, counting its occurrences), then walked as it walks it."""
    depth = params.max_tree_depth
    root: dict = {"n": 0, "kids": {}}
    tokens = list(haystack)
    for i in range(len(tokens)):
        node = root
        for t in tokens[i : i + depth]:
            if t < 0:
                break
            node = node["kids"].setdefault(t, {"n": 0, "kids": {}})
            node["n"] += 1
    context = list(context)
    best, node = 0, None
    for length in range(min(depth - 1, len(context)), 0, -1):
        walk = root
        for t in context[len(context) - length :]:
            walk = walk["kids"].get(t)
            if walk is None:
                break
        if walk is not None:
            best, node = length, walk
            break
    if node is None:
        return [], 0.0
    room = min(k, int(params.max_spec_factor * best), depth - best)
    drafts, probability, expected = [], 1.0, 0.0
    while len(drafts) < room and node["kids"]:
        # the most frequent next token; ties to the smallest id, as np.unique orders them
        token = max(sorted(node["kids"]), key=lambda t: node["kids"][t]["n"])
        child = node["kids"][token]
        probability *= child["n"] / node["n"]
        if probability < params.min_token_prob:
            break
        drafts.append(token)
        expected += probability
        node = child
    return drafts, expected


def test_suffix_proposals_are_the_suffix_tree_walk():
    rng = np.random.default_rng(1)
    for trial in range(200):
        parts = [rng.integers(0, 5, rng.integers(1, 30)) for _ in range(rng.integers(1, 4))]
        haystack = np.concatenate([np.append(p, -1) for p in parts]).astype(np.int32)
        context = rng.integers(0, 5, rng.integers(1, 12)).astype(np.int32)
        params = SuffixParams(
            max_tree_depth=int(rng.integers(3, 9)),
            max_spec_factor=float(rng.choice([0.5, 1.0, 2.0])),
            min_token_prob=float(rng.choice([0.0, 0.1, 0.4])),
        )
        got, score = propose_suffix(haystack, context, 6, params)
        want, want_score = _reference_suffix(haystack, context, 6, params)
        assert got.tolist() == want, (trial, haystack.tolist(), context.tolist(), params)
        assert score == pytest.approx(want_score)


def test_suffix_follows_the_most_frequent_continuation_and_stops_when_unlikely():
    # after [1, 2]: 3 twice, 4 once; after [1, 2, 3]: 7 then 8, once each
    haystack = np.array([1, 2, 3, 7, -1, 1, 2, 3, 8, -1, 1, 2, 4, -1], np.int32)
    context = np.array([9, 1, 2], np.int32)
    drafts, score = propose_suffix(haystack, context, 8, SuffixParams())
    assert drafts.tolist() == [3, 7]  # 2/3, then 2/3 * 1/2 = 1/3 >= 0.1; a match of 2 allows 2
    assert score == pytest.approx(2 / 3 + 1 / 3)
    drafts, _ = propose_suffix(haystack, context, 8, SuffixParams(max_spec_factor=0.5))
    assert drafts.tolist() == [3]  # half the match's length
    drafts, _ = propose_suffix(haystack, context, 8, SuffixParams(min_token_prob=0.5))
    assert drafts.tolist() == [3]  # 1/3 < 0.5
    # the request's own tokens: the suffix itself is not an occurrence
    own = np.array([5, 6, 7, 5, 6], np.int32)
    drafts, _ = propose_suffix(own, own, 4, SuffixParams(), before=len(own) - 1)
    assert drafts.tolist() == [7, 5]


def test_the_suffix_cache_keeps_the_latest_outputs():
    cache = SuffixCache(max_cached_requests=2)
    for output in ([1, 2], [3], [], [4, 5]):
        cache.add(output)
    assert cache.tokens.tolist() == [3, -1, 4, 5, -1]
    assert SuffixCache(0).tokens.tolist() == []


def test_suffix_config_takes_vllms_keys_and_defaults():
    config = SpeculativeConfig.parse('{"method": "suffix"}')
    assert config.suffix == SuffixParams() and config.num_speculative_tokens == 16
    config = SpeculativeConfig.parse(
        '{"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 32,'
        ' "suffix_decoding_max_cached_requests": 0, "suffix_decoding_max_spec_factor": 2.0,'
        ' "suffix_decoding_min_token_prob": 0.05}'
    )
    assert config.suffix == SuffixParams(32, 0, 2.0, 0.05) and config.num_speculative_tokens == 8
    with pytest.raises(ValueError, match="not supported"):
        SpeculativeConfig.parse('{"method": "suffix", "prompt_lookup_min": 2}')
    with pytest.raises(ValueError, match="min_token_prob"):
        SpeculativeConfig.parse('{"method": "suffix", "suffix_decoding_min_token_prob": 2}')


def test_a_suffix_scheduler_drafts_what_an_earlier_request_wrote():
    spec = SpeculativeConfig.parse('{"method": "suffix", "num_speculative_tokens": 4}')
    s = Scheduler(SchedulerConfig(8, 32, 512, 64, 4, speculative=spec))
    first = seq(1, 3, max_tokens=6)
    s.add(first)
    complete(s, s.schedule(), [[40]])
    for token in (41, 42, 43, 44, 45):
        step = s.schedule()
        assert step.seqs[0].draft is None  # nothing to look in yet
        complete(s, step, [[token]])
    assert first.status == Status.FINISHED
    # a second request that starts writing the same thing: its drafts come from the first's
    second = seq(2, 3, max_tokens=20)
    second.acceptance = 0.9
    s.add(second)
    complete(s, s.schedule(), [[40]])
    complete(s, s.schedule(), [[41]])
    step = s.schedule()
    # a match (of 2, spec factor 1.0: two drafts) in the first's output: the room is reserved,
    # and execute fills what it proposes then (test_draft_rows.py)
    assert step.seqs[0].num_draft == 4
