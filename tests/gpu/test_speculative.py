"""Speculative verification changes nothing but speed: the runner emits plain decoding's tokens with
every knob applied at every verified position, and sampled drafts keep the model's distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu.runner import ModelRunner, RunnerConfig, StepBatch
from gpu.sampler import SamplingArrays, TokenHistory, sample, verify
from tests.gpu.paged import BlockPool, PagedSequence, build_step
from tests.gpu.test_runner import Request, generate, sampling_rows


@pytest.fixture(scope="module")
def runner(tiny_models) -> ModelRunner:
    return ModelRunner.from_path(
        str(tiny_models["llama"]), RunnerConfig(dtype="float32", kv_cache_bytes=8 << 20, seed=3)
    )


def speculate(runner: ModelRunner, req: Request, drafts_for) -> list[tuple[int, int]]:
    """Decode req with the drafts `drafts_for(outputs so far)` proposes at each step; req.outputs
    gets what the runner emitted. Returns (drafted, accepted) per step."""
    pool = BlockPool(runner.num_kv_blocks, runner.kv_cache.block_size, seed=1)
    seq = PagedSequence(list(req.prompt))
    prompt_len = len(req.prompt)
    steps = []
    while len(req.outputs) < req.max_new_tokens:
        draft = [] if not req.outputs else list(drafts_for(req.outputs))
        draft = draft[: req.max_new_tokens - len(req.outputs) - 1]
        seq.token_ids = list(req.prompt) + req.outputs + draft
        step = build_step(pool, [(seq, len(seq.token_ids) - seq.num_cached)])
        out = runner.step(
            StepBatch(
                handles=np.array([req.handle], np.int64),
                input_ids=step.input_ids,
                positions=step.positions,
                query_start_loc=step.query_start_loc,
                context_lens=step.context_lens,
                block_tables=step.block_tables,
                slot_mapping=step.slot_mapping,
                prompt_lens=np.array([prompt_len], np.int32),
                sample=np.ones(1, bool),
                sampling=sampling_rows([req]),
                prompt_logprobs=np.full(1, -1, np.int32),
                num_draft=np.array([len(draft)], np.int32),
            )
        )
        emitted = out.token_ids[: int(out.num_tokens[0])].tolist()
        assert len(emitted) == int(out.num_tokens[0]) == len(out.token_ids)
        steps.append((len(draft), len(emitted) - 1))
        req.outputs.extend(emitted)
        seq.num_cached = prompt_len + len(req.outputs) - 1  # rejected drafts' KV is rewritten
    return steps


KNOBS = [
    {"temperature": 0.0},
    {"temperature": 0.0, "repetition_penalty": 1.8, "frequency_penalty": 0.7},
    {"temperature": 1.0, "seed": 11, "top_k": 20, "top_p": 0.9, "presence_penalty": 0.5},
    {"temperature": 0.7, "seed": 5, "min_p": 0.05, "min_tokens": 6, "stop_token_ids": [3, 4, 5]},
    {"temperature": 0.0, "logit_bias_ids": [7, 9], "logit_bias_values": [4.0, -100.0]},
    {"temperature": 0.0, "bad_token_ids": [2]},
]


@pytest.mark.parametrize("knobs", KNOBS)
def test_verified_runs_emit_plain_decodings_tokens(runner, knobs):
    prompt = [1, 5, 9, 5, 9, 2, 5, 9]
    plain = Request(1, prompt, 14, dict(knobs))
    generate(runner, [plain])
    runner.free([1])
    want = plain.outputs

    # drafts that are right: everything accepted, k + 1 tokens a step
    right = Request(2, prompt, 14, dict(knobs))
    steps = speculate(runner, right, lambda out: want[len(out) : len(out) + 4])
    runner.free([2])
    assert right.outputs == want
    assert all(accepted == drafted for drafted, accepted in steps)
    assert len(steps) < len(want) // 2  # far fewer steps than tokens

    # drafts wrong from their second token on: one accepted, then the model's own token
    def wrong(out):
        truth = want[len(out) : len(out) + 4]
        return truth[:1] + [(t + 1) % 64 for t in truth[1:]]

    partly = Request(3, prompt, 14, dict(knobs))
    steps = speculate(runner, partly, wrong)
    runner.free([3])
    assert partly.outputs == want
    assert all(accepted == min(drafted, 1) for drafted, accepted in steps)


def test_logprobs_of_each_accepted_token_are_plain_decodings(runner):
    prompt = [3, 8, 3, 8, 3]
    knobs = {"temperature": 0.0, "num_logprobs": 3}
    plain = Request(4, prompt, 8, dict(knobs))
    generate(runner, [plain])
    runner.free([4])
    want = [(r["token"], r["logprob"], r["top_ids"]) for r in plain.results if r["token"] >= 0]
    fast = Request(5, prompt, 8, dict(knobs))
    outputs = plain.outputs
    pool = BlockPool(runner.num_kv_blocks, runner.kv_cache.block_size, seed=2)
    seq = PagedSequence(prompt + outputs[:1] + outputs[1:5])  # prefill, then verify 4 drafts
    got = []
    for count, drafts in ((len(prompt), 0), (5, 4)):
        step = build_step(pool, [(seq, count)])
        out = runner.step(
            StepBatch(
                handles=np.array([5], np.int64),
                input_ids=step.input_ids,
                positions=step.positions,
                query_start_loc=step.query_start_loc,
                context_lens=step.context_lens,
                block_tables=step.block_tables,
                slot_mapping=step.slot_mapping,
                prompt_lens=np.array([len(prompt)], np.int32),
                sample=np.ones(1, bool),
                sampling=sampling_rows([fast]),
                prompt_logprobs=np.full(1, -1, np.int32),
                num_draft=np.array([drafts], np.int32),
            )
        )
        for i in range(int(out.num_tokens[0])):
            got.append((int(out.token_ids[i]), float(out.logprobs[i]), out.top_ids[i].tolist()))
    runner.free([5])
    assert [g[0] for g in got] == [w[0] for w in want[:6]]
    for (_, lp, top), (_, want_lp, want_top) in zip(got, want[:6], strict=True):
        assert lp == pytest.approx(want_lp, abs=1e-4)
        assert top == list(want_top)


# -- the distribution of sampled drafts ------------------------------------------------------------

VOCAB = 6
SAMPLES = 40_000
# A Markov chain as the "model": the logits of the next token depend on the last one.
CHAIN = torch.tensor(np.random.default_rng(4).normal(0, 1.2, (VOCAB, VOCAB)), dtype=torch.float32)


def _first_two_tokens(accept_rule, start: int, drafts: tuple[int, int], seed: int) -> np.ndarray:
    """[SAMPLES, 2]: the first two tokens emitted after `start` when each step verifies `drafts`
    (a one-hot proposal, as prompt lookup makes) with accept_rule, at temperature 1."""
    generator = torch.Generator().manual_seed(seed)
    rows = 3 * SAMPLES  # per sample: the input's position and each draft's
    contexts = torch.tensor([start, drafts[0], drafts[1]] * SAMPLES)
    params = SamplingArrays.defaults(rows, temperature=np.ones(rows, np.float32))
    history = [TokenHistory(j, np.zeros(0, np.int64), np.zeros(0, np.int64)) for j in [0, 1, 2]]
    sampled = sample(CHAIN[contexts], params, history * SAMPLES, generator).token_ids.numpy()
    draft_of = np.tile(np.array([drafts[0], drafts[1], -1]), SAMPLES)
    accepted = accept_rule(sampled, draft_of, np.full(SAMPLES, 3), generator)
    first = sampled[0::3]
    second = np.where(accepted >= 1, sampled[1::3], -1)
    # a row that accepted no draft takes its second token from a plain step after its first
    redo = np.flatnonzero(second < 0)
    if len(redo):
        params = SamplingArrays.defaults(len(redo), temperature=np.ones(len(redo), np.float32))
        history = [TokenHistory(1, np.zeros(0, np.int64), np.zeros(0, np.int64))] * len(redo)
        plain = sample(CHAIN[torch.from_numpy(first[redo])], params, history, generator)
        second[redo] = plain.token_ids.numpy()
    return np.stack([first, second], axis=1)


def _exact(start: int) -> np.ndarray:  # [V, V]: p(x1, x2) = p(x1 | start) p(x2 | x1)
    p1 = torch.softmax(CHAIN[start], 0)
    return (p1[:, None] * torch.softmax(CHAIN, 1)).numpy()


def _total_variation(pairs: np.ndarray, exact: np.ndarray) -> float:
    counts = np.zeros((VOCAB, VOCAB))
    np.add.at(counts, (pairs[:, 0], pairs[:, 1]), 1)
    return 0.5 * float(np.abs(counts / len(pairs) - exact).sum())


def _naive(sampled, drafts, per_row, generator):
    """A wrong verifier: accept a draft if a fresh sample equals it, and on rejection emit another
    fresh sample (so the drafted token is emitted with p + (1 - p) p instead of p)."""
    accepted = verify(sampled, drafts, per_row)
    rejected = np.flatnonzero(accepted == 0)
    redraw = torch.multinomial(
        torch.softmax(CHAIN[0], 0), len(rejected), replacement=True, generator=generator
    )
    sampled[3 * rejected] = redraw.numpy()
    return accepted


@pytest.mark.parametrize("ranks", [(0, 0), (2, 1)])  # likely drafts; drafts often rejected
def test_sampled_speculation_keeps_the_models_distribution(ranks):
    exact = _exact(start=0)
    first = int(torch.argsort(CHAIN[0], descending=True)[ranks[0]])
    drafts = (first, int(torch.argsort(CHAIN[first], descending=True)[ranks[1]]))
    # the bound: five times the sampling noise of SAMPLES draws over VOCAB^2 cells
    bound = 5 * 0.5 * np.sqrt(2 / (np.pi * SAMPLES)) * np.sqrt(exact).sum()

    def ours(sampled, draft_of, per_row, _):
        return verify(sampled, draft_of, per_row)

    assert _total_variation(_first_two_tokens(ours, 0, drafts, seed=1), exact) < bound
    # the same test tells a wrong verifier: it makes the drafted token too likely
    assert _total_variation(_first_two_tokens(_naive, 0, drafts, seed=1), exact) > bound


def test_verify_counts_leading_matches_per_row():
    sampled = np.array([5, 6, 9, 1, 4, 4, 4])
    drafts = np.array([5, 7, -1, 1, 4, 4, -1])
    # row 0 (3 positions): draft 5 matches, draft 7 does not; row 1 (1 position): no drafts;
    # row 2 (3 positions): both drafts match, the last sample is the bonus
    assert verify(sampled, drafts, np.array([3, 1, 3])).tolist() == [1, 0, 2]
