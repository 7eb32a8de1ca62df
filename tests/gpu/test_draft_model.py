"""Speculative decoding with a draft model in the runner: the draft proposes inside the step, sees
every token the target computes (chunked prefill included), and rejection sampling against its q
keeps plain decoding's tokens (greedy) and distribution (sampled)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from gpu.runner import ModelRunner, RunnerConfig, StepBatch
from gpu.sampler import SamplingArrays, TokenHistory, rejection_sample, sample
from tests.gpu.paged import BlockPool, PagedSequence, build_step
from tests.gpu.test_runner import Request, generate, sampling_rows


def perturbed_copy(source: Path, target: Path, scale: float, seed: int = 0) -> Path:
    """A copy of a checkpoint with noise on every weight: a draft that mostly agrees."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    weights = load_file(str(target / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    noisy = {
        name: w + scale * w.std() * torch.randn(w.shape, generator=generator)
        for name, w in weights.items()
    }
    save_file(noisy, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


@pytest.fixture(scope="module")
def drafts(tiny_models, tmp_path_factory) -> dict[str, Path]:
    """Drafts for the tiny llama: itself, a near copy, and another architecture entirely."""
    near = perturbed_copy(tiny_models["llama"], tmp_path_factory.mktemp("near") / "m", 0.3)
    return {"same": tiny_models["llama"], "near": near, "other": tiny_models["qwen2"]}


def runner_with(tiny_models, draft: Path | None, seed: int = 3) -> ModelRunner:
    runner = ModelRunner.from_path(
        str(tiny_models["llama"]),
        RunnerConfig(kv_cache_bytes=1 << 20, block_size=4, threads=1, seed=seed),
    )
    if draft is not None:
        runner.attach_drafter(str(draft))
    return runner


def speculate(
    runner: ModelRunner,
    req: Request,
    k: int,
    prefill_chunk: int = 64,
    draft_every: int = 1,
    forced: dict[int, int] | None = None,  # output index -> the token forced there
) -> list[tuple[int, int]]:
    """Decode req as schedule plans it with a draft model: the prompt in chunks, then steps of
    the input token and k placeholder drafts (-1) that the runner's drafter fills in (on every
    `draft_every`-th step; plain decodes between). `forced` tokens are forced as execute forces
    a thinking budget's close tag: the row's next one in its sampling, those after its drafts
    through forced_along. Returns (drafted, accepted) per verifying step."""
    pool = BlockPool(runner.num_kv_blocks, runner.kv_cache.block_size, seed=1)
    seq = PagedSequence(list(req.prompt))
    prompt_len = len(req.prompt)
    steps = []
    while len(req.outputs) < req.max_new_tokens:
        left = prompt_len - seq.num_cached
        if left > 0:  # a prefill chunk; the last one samples
            drafts, count = 0, min(prefill_chunk, left)
        else:
            drafts = min(k, req.max_new_tokens - len(req.outputs) - 1)
            if len(req.outputs) % draft_every:
                drafts = 0
            count = 1 + drafts
        seq.token_ids = list(req.prompt) + req.outputs + [-1] * drafts
        step = build_step(pool, [(seq, count)])
        samples = seq.num_cached >= prompt_len
        sampling = sampling_rows([req])
        along = None
        if forced:
            done = len(req.outputs)
            sampling.forced_token_ids[0] = forced.get(done, -1)

            def along(row: int, ds: list[int], done: int = done) -> list[int]:
                return [forced.get(done + j, -1) for j in range(len(ds) + 1)]

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
                sample=np.array([samples]),
                sampling=sampling,
                prompt_logprobs=np.full(1, -1, np.int32),
                num_draft=np.array([drafts], np.int32),
                forced_along=along,
            )
        )
        if not samples:
            continue
        emitted = out.token_ids[: int(out.num_tokens[0])].tolist()
        assert -1 not in emitted
        req.results.extend(
            {"token": t, "logprob": float(out.logprobs[i])} for i, t in enumerate(emitted)
        )
        if left <= 0 and drafts:
            steps.append((drafts, len(emitted) - 1))
        req.outputs.extend(emitted)
        seq.num_cached = prompt_len + len(req.outputs) - 1  # rejected drafts' KV is rewritten
    return steps


PROMPT = [5, 9, 5, 9, 2, 5, 9, 3, 17, 40, 41]


def plain_outputs(tiny_models, knobs: dict, max_new_tokens: int = 20) -> Request:
    plain = Request(1, PROMPT, max_new_tokens, dict(knobs))
    generate(runner_with(tiny_models, None), [plain])
    return plain


@pytest.mark.parametrize("prefill_chunk", [64, 3])
def test_a_draft_equal_to_the_target_is_always_accepted(tiny_models, drafts, prefill_chunk):
    want = plain_outputs(tiny_models, {"temperature": 0.0}).outputs
    req = Request(2, PROMPT, 20, {"temperature": 0.0})
    steps = speculate(runner_with(tiny_models, drafts["same"]), req, 4, prefill_chunk)
    assert req.outputs == want
    # every draft accepted: the draft saw every prompt token, chunk by chunk, and every accepted
    # token, the last draft of a fully accepted step included
    assert all(accepted == drafted for drafted, accepted in steps)
    assert len(steps) == 4  # 19 tokens after the prefill's: 4 drafts and a bonus a step


def test_the_draft_catches_up_on_the_tokens_of_steps_without_drafts(tiny_models, drafts):
    """Between drafting steps the draft computes nothing; when a request drafts again, it feeds
    the tokens it missed first, so an equal draft is still always accepted."""
    want = plain_outputs(tiny_models, {"temperature": 0.0}, 30).outputs
    req = Request(2, PROMPT, 30, {"temperature": 0.0})
    steps = speculate(runner_with(tiny_models, drafts["same"]), req, 2, draft_every=4)
    assert req.outputs == want
    assert steps and all(accepted == drafted for drafted, accepted in steps)


KNOBS = [
    {"temperature": 0.0},
    {"temperature": 0.0, "repetition_penalty": 1.8, "frequency_penalty": 0.7},
    {"temperature": 0.0, "logit_bias_ids": [7, 9], "logit_bias_values": [4.0, -100.0]},
    {"temperature": 0.0, "bad_token_ids": [2], "min_tokens": 6, "stop_token_ids": [3, 4]},
]


@pytest.mark.parametrize("draft", ["near", "other"])
@pytest.mark.parametrize("knobs", KNOBS)
def test_greedy_with_another_draft_emits_plain_decodings_tokens(tiny_models, drafts, draft, knobs):
    want = [r for r in plain_outputs(tiny_models, {**knobs, "num_logprobs": 2}).results
            if r["token"] >= 0]  # fmt: skip
    req = Request(2, PROMPT, 20, {**knobs, "num_logprobs": 2})
    steps = speculate(runner_with(tiny_models, drafts[draft]), req, 3)
    assert req.outputs == [r["token"] for r in want]
    # a token emitted in place of a rejected draft has the target's logprob, as plain decoding's
    assert [r["logprob"] for r in req.results] == pytest.approx(
        [r["logprob"] for r in want], abs=1e-4
    )
    if draft == "near":  # a near copy agrees often; a random other model seldom does
        assert sum(a for _, a in steps) > 0


@pytest.mark.parametrize("draft", ["same", "near"])
def test_a_seeded_request_gives_plain_decodings_text_wherever_drafts_fall(
    tiny_models, drafts, draft
):
    """A seeded draft draws with the target's noise at each output index: its text is the one
    plain decoding gives the seed, however many drafts each step carried."""
    knobs = {"temperature": 1.0, "seed": 11, "top_k": 20, "presence_penalty": 0.5}
    want = plain_outputs(tiny_models, knobs, 24).outputs
    for runner_seed, k, every in ((1, 3, 1), (2, 2, 3)):  # the runner's own generator differs
        req = Request(2, PROMPT, 24, dict(knobs))
        steps = speculate(runner_with(tiny_models, drafts[draft], runner_seed), req, k, 64, every)
        assert req.outputs == want
        if draft == "same":  # the same noise and the same q: every draft is the target's sample
            assert all(accepted == drafted for drafted, accepted in steps)


@pytest.mark.parametrize("knobs", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 5}])
def test_a_forced_token_inside_the_drafts_is_taken_there(tiny_models, drafts, knobs):
    """A thinking budget's close tag forced at a position a draft model drafted for: the
    position takes it (an equal draft, which proposed the model's own token there, is rejected
    at it) and the text is plain decoding's with the same tokens forced."""
    forced = {5: 60, 6: 61, 13: 62}
    plain = Request(1, PROMPT, 20, dict(knobs))
    speculate(runner_with(tiny_models, None), plain, 0, forced=forced)
    want = plain.outputs
    assert [want[i] for i in forced] == list(forced.values())
    req = Request(2, PROMPT, 20, dict(knobs))
    steps = speculate(runner_with(tiny_models, drafts["same"]), req, 4, forced=forced)
    assert req.outputs == want
    assert any(accepted < drafted for drafted, accepted in steps)  # the forced ones refused


def test_sampled_drafts_of_an_equal_draft_are_all_accepted(tiny_models, drafts):
    """min(1, p / q) is 1 where q is p: a verifier that used q only as one-hot (accept when the
    draft equals a sample of p) would accept a draft with probability p(draft) instead."""
    req = Request(2, PROMPT, 40, {"temperature": 1.0})
    steps = speculate(runner_with(tiny_models, drafts["same"]), req, 4)
    drafted, accepted = (sum(column) for column in zip(*steps, strict=True))
    assert accepted >= 0.95 * drafted


def test_free_forgets_the_drafts_cache_positions(tiny_models, drafts):
    runner = runner_with(tiny_models, drafts["same"])
    req = Request(5, PROMPT, 6, {"temperature": 0.0})
    speculate(runner, req, 2)
    assert runner.drafter is not None and 5 in runner.drafter._lengths
    runner.free([5])
    assert 5 not in runner.drafter._lengths and runner.tracked_handles == frozenset()


def test_a_draft_with_another_vocabulary_size_is_refused(tiny_models, tmp_path):
    import json

    other = shutil.copytree(tiny_models["llama"], tmp_path / "draft")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 96}))
    with pytest.raises(ValueError, match="96 logits"):
        runner_with(tiny_models, other)


# -- the distribution of drafts a model sampled ----------------------------------------------------

VOCAB = 6
SAMPLES = 30_000
# Markov chains as the models: the logits of the next token depend on the last one.
TARGET = torch.tensor(np.random.default_rng(4).normal(0, 1.2, (VOCAB, VOCAB)), dtype=torch.float32)
DRAFT = TARGET + torch.tensor(np.random.default_rng(5).normal(0, 1.0, (VOCAB, VOCAB)))


def _history(j: int) -> TokenHistory:
    return TokenHistory(j, np.zeros(0, np.int64), np.zeros(0, np.int64))


def _first_two_tokens(verifier, seed: int) -> tuple[np.ndarray, float]:
    """([SAMPLES, 2] the first two tokens emitted after token 0, the acceptance rate) when each
    sample's step verifies two drafts sampled from DRAFT's q, at temperature 1."""
    generator = torch.Generator().manual_seed(seed)
    ones = np.ones(SAMPLES, np.float32)
    params = SamplingArrays.defaults(SAMPLES, temperature=ones)
    d1 = sample(DRAFT[torch.zeros(SAMPLES, dtype=torch.long)], params, [_history(0)] * SAMPLES,
                generator, keep_probs=True)  # fmt: skip
    d2 = sample(DRAFT[d1.token_ids], params, [_history(1)] * SAMPLES, generator, keep_probs=True)
    # the step's positions: after token 0, after d1, after d2
    contexts = torch.stack([torch.zeros(SAMPLES, dtype=torch.long), d1.token_ids, d2.token_ids], 1)
    rows = 3 * SAMPLES
    target = sample(
        TARGET[contexts.reshape(-1)],
        SamplingArrays.defaults(rows, temperature=np.ones(rows, np.float32)),
        [_history(j) for j in (0, 1, 2)] * SAMPLES,
        generator,
        keep_probs=True,
    )
    assert d1.probs is not None and d2.probs is not None and target.probs is not None
    q = torch.stack([d1.probs, d2.probs, torch.zeros_like(d1.probs)], 1).reshape(rows, VOCAB)
    drafted = torch.stack([d1.token_ids, d2.token_ids, torch.full_like(d1.token_ids, -1)], 1)
    tokens = target.token_ids.numpy().copy()
    accepted = verifier(
        target.probs,
        tokens,
        q,
        drafted.reshape(-1).numpy(),
        np.full(SAMPLES, 3),
        np.zeros(rows, bool),
        generator,
    )
    first = tokens[0::3]
    second = np.where(accepted >= 1, tokens[1::3], -1)
    redo = np.flatnonzero(second < 0)  # rows that emitted one token take a plain step after it
    if len(redo):
        params = SamplingArrays.defaults(len(redo), temperature=np.ones(len(redo), np.float32))
        plain = sample(TARGET[torch.from_numpy(first[redo])], params, [_history(1)] * len(redo),
                       generator)  # fmt: skip
        second[redo] = plain.token_ids.numpy()
    return np.stack([first, second], axis=1), float(accepted.sum()) / (2 * SAMPLES)


def _exact() -> np.ndarray:  # [V, V]: p(x1, x2) = p(x1 | 0) p(x2 | x1)
    p1 = torch.softmax(TARGET[0], 0)
    return (p1[:, None] * torch.softmax(TARGET, 1)).numpy()


def _total_variation(pairs: np.ndarray, exact: np.ndarray) -> float:
    counts = np.zeros((VOCAB, VOCAB))
    np.add.at(counts, (pairs[:, 0], pairs[:, 1]), 1)
    return 0.5 * float(np.abs(counts / len(pairs) - exact).sum())


def _naive(p, tokens, q, drafts, per_row, seeded, generator):
    """A wrong verifier: accept a draft if a fresh sample of p equals it; at the first rejection
    emit another fresh sample (the draft is then emitted too often: q p + (1 - sum q p) p)."""
    accepted = np.zeros(len(per_row), np.int64)
    fresh = torch.multinomial(p, 2, replacement=True, generator=generator).numpy()
    for row in range(len(per_row)):
        accepted[row] = 2
        for j in range(2):
            at = 3 * row + j
            if fresh[at, 0] != drafts[at]:
                tokens[at] = fresh[at, 1]
                accepted[row] = j
                break
    return accepted


def test_rejection_sampling_keeps_the_targets_distribution_and_a_naive_verifier_does_not():
    exact = _exact()
    # the bound: five times the sampling noise of SAMPLES draws over VOCAB^2 cells
    bound = 5 * 0.5 * np.sqrt(2 / (np.pi * SAMPLES)) * np.sqrt(exact).sum()
    pairs, acceptance = _first_two_tokens(rejection_sample, seed=1)
    assert _total_variation(pairs, exact) < bound
    naive_pairs, naive_acceptance = _first_two_tokens(_naive, seed=1)
    assert _total_variation(naive_pairs, exact) > bound
    # and q is used: min(1, p / q) accepts more than "a sample of p equals the draft" does
    assert acceptance > naive_acceptance


def _batch(prompt: list[int], rows: int, drafts: int, sampling: SamplingArrays) -> StepBatch:
    """`rows` requests of one prompt, each prefilled in one step that samples and verifies
    `drafts` placeholder drafts after it; request r owns blocks 4r..4r+3 (block size 4)."""
    length = len(prompt) + drafts
    positions = np.tile(np.arange(length), rows)
    tables = np.arange(rows * 4, dtype=np.int32).reshape(rows, 4)
    owner = np.repeat(np.arange(rows), length)
    return StepBatch(
        handles=np.arange(rows, dtype=np.int64),
        input_ids=np.tile(np.array(prompt + [-1] * drafts, np.int64), rows),
        positions=positions,
        query_start_loc=(np.arange(rows + 1) * length).astype(np.int32),
        context_lens=np.full(rows, length, np.int32),
        block_tables=tables,
        slot_mapping=(tables[owner, positions // 4] * 4 + positions % 4).astype(np.int64),
        prompt_lens=np.full(rows, len(prompt), np.int32),
        sample=np.ones(rows, bool),
        sampling=sampling,
        prompt_logprobs=np.full(rows, -1, np.int32),
        num_draft=np.full(rows, drafts, np.int32),
    )


def test_sampled_tokens_through_the_runner_follow_plain_decodings_distribution(tiny_models, drafts):
    """Thousands of requests verify two drafts of a near model each (top_k 3, temperature 1):
    the first two tokens they emit follow the target's exact distribution."""
    from tests.gpu.test_model import reference_logits

    rows, prompt = 6000, PROMPT[:9]
    runner = ModelRunner.from_path(
        str(tiny_models["llama"]),
        RunnerConfig(kv_cache_bytes=rows * 4 * 2048, block_size=4, threads=1, seed=9),
    )
    runner.attach_drafter(str(drafts["near"]))
    sampling = SamplingArrays.defaults(
        rows, temperature=np.ones(rows, np.float32), top_k=np.full(rows, 3, np.int32)
    )
    out = runner.step(_batch(prompt, rows, 2, sampling))
    counts = out.num_tokens.astype(np.int64)
    starts = np.cumsum(counts) - counts
    first = out.token_ids[starts]
    second = np.where(
        counts >= 2, out.token_ids[np.minimum(starts + 1, len(out.token_ids) - 1)], -1
    )
    redo = np.flatnonzero(counts == 1)  # a plain step after the first token
    tables = np.arange(rows * 4, dtype=np.int32).reshape(rows, 4)[redo]
    position = len(prompt)
    again = runner.step(
        StepBatch(
            handles=redo.astype(np.int64),
            input_ids=first[redo].astype(np.int64),
            positions=np.full(len(redo), position, np.int64),
            query_start_loc=np.arange(len(redo) + 1, dtype=np.int32),
            context_lens=np.full(len(redo), position + 1, np.int32),
            block_tables=tables,
            slot_mapping=(tables[:, position // 4] * 4 + position % 4).astype(np.int64),
            prompt_lens=np.full(len(redo), len(prompt), np.int32),
            sample=np.ones(len(redo), bool),
            sampling=sampling.select(redo),
            prompt_logprobs=np.full(len(redo), -1, np.int32),
        )
    )
    second[redo] = again.token_ids
    accepted = float((counts - 1).sum()) / (2 * rows)

    def top3(logits: torch.Tensor) -> torch.Tensor:  # [V] -> [V], top_k 3 at temperature 1
        kept = torch.full_like(logits, float("-inf"))
        values, ids = logits.topk(3)
        kept[ids] = values
        return torch.softmax(kept, 0)

    p1 = top3(reference_logits(tiny_models["llama"], prompt)[-1])
    exact: dict[tuple[int, int], float] = {}
    for x1 in torch.nonzero(p1).flatten().tolist():
        p2 = top3(reference_logits(tiny_models["llama"], [*prompt, x1])[-1])
        for x2 in torch.nonzero(p2).flatten().tolist():
            exact[(x1, x2)] = float(p1[x1] * p2[x2])
    observed: dict[tuple[int, int], int] = {}
    for pair in zip(first.tolist(), second.tolist(), strict=True):
        observed[pair] = observed.get(pair, 0) + 1
    assert set(observed) <= set(exact)
    variation = 0.5 * sum(abs(observed.get(c, 0) / rows - p) for c, p in exact.items())
    bound = 5 * 0.5 * np.sqrt(2 / (np.pi * rows)) * sum(np.sqrt(p) for p in exact.values())
    assert variation < bound
    assert 0.2 < accepted < 0.95  # some drafts accepted, some replaced
