"""Sampler semantics: each knob changes the outcome the way the OpenAI/vLLM parameter says."""

from __future__ import annotations

import math

import numpy as np
import torch

from gpu.sampler import INVERSE_CDF_BLOCK, SamplingArrays, TokenHistory, inverse_cdf, sample

VOCAB = 50


def histories(num_rows: int, output: list[int] | None = None, prompt: list[int] | None = None):
    return [TokenHistory.of(prompt or [1, 2], output or []) for _ in range(num_rows)]


def ids(rows: list[list[int]]) -> np.ndarray:
    width = max(len(r) for r in rows)
    return np.array([r + [-1] * (width - len(r)) for r in rows], dtype=np.int32)


def probs_logits(probs: list[float], num_rows: int = 1) -> torch.Tensor:
    row = torch.full((VOCAB,), -1e9)
    row[: len(probs)] = torch.log(torch.tensor(probs))
    return row.repeat(num_rows, 1)


def test_greedy_is_argmax_of_raw_logits():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0))
    asked = np.array([0, 0, 0, -1, 0, 0], np.int32)  # row 3 wants no logprobs
    out = sample(logits, SamplingArrays.defaults(6, num_logprobs=asked), histories(6))
    assert out.token_ids.tolist() == logits.argmax(dim=1).tolist()
    assert out.ranks.tolist() == [1, 1, 1, 0, 1, 1]
    expected = torch.log_softmax(logits, dim=1).max(dim=1).values
    torch.testing.assert_close(out.logprobs[asked >= 0], expected[asked >= 0])
    assert out.logprobs[3].isnan()  # not computed for a row that did not ask


def test_top_k_one_equals_greedy_at_any_temperature():
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(1))
    params = SamplingArrays.defaults(
        8, temperature=np.full(8, 5.0, np.float32), top_k=np.ones(8, np.int32)
    )
    out = sample(logits, params, histories(8), torch.Generator().manual_seed(0))
    assert out.token_ids.tolist() == logits.argmax(dim=1).tolist()


def test_min_tokens_masks_stop_ids_until_reached():
    logits = torch.zeros(2, VOCAB)
    logits[:, 7] = 10.0  # the EOS id is by far the likeliest
    logits[:, 3] = 5.0
    params = SamplingArrays.defaults(
        2, min_tokens=np.array([3, 3], np.int32), stop_token_ids=ids([[7], [7]])
    )
    short = [TokenHistory.of([1], [4, 4]), TokenHistory.of([1], [4, 4, 4])]
    out = sample(logits, params, short)
    assert out.token_ids.tolist() == [3, 7]


def test_seed_reproducible_and_independent_of_batch():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(2))
    hot = SamplingArrays.defaults(1, temperature=np.array([1.5], np.float32), seed=np.array([42]))

    def alone(step: int) -> int:
        return int(sample(logits, hot, histories(1, [5] * step)).token_ids[0])

    def in_batch(step: int) -> int:
        others = torch.randn(3, VOCAB)
        batch_logits = torch.cat([others[:2], logits, others[2:]])
        params = SamplingArrays.defaults(
            4,
            temperature=np.array([1.0, 0.7, 1.5, 2.0], np.float32),
            seed=np.array([-1, 7, 42, -1]),
        )
        hist = [*histories(2, [9]), *histories(1, [5] * step), *histories(1)]
        return int(
            sample(batch_logits, params, hist, torch.Generator().manual_seed(step)).token_ids[2]
        )

    solo = [alone(step) for step in range(12)]
    assert solo == [alone(step) for step in range(12)]
    assert solo == [in_batch(step) for step in range(12)]
    assert len(set(solo)) > 1  # the seed varies per output index: not one token repeated


def test_different_seeds_differ():
    logits = torch.zeros(2, VOCAB)
    params = SamplingArrays.defaults(2, temperature=np.ones(2, np.float32), seed=np.array([1, 2]))
    draws = [sample(logits, params, histories(2, [0] * s)).token_ids.tolist() for s in range(10)]
    assert [a for a, _ in draws] != [b for _, b in draws]


def test_frequency_penalty_scales_with_count():
    logits = torch.full((2, VOCAB), -5.0)
    logits[:, 0], logits[:, 1] = 2.0, 1.5
    params = SamplingArrays.defaults(2, frequency_penalty=np.array([0.3, 0.2], np.float32))
    out = sample(logits, params, histories(2, [0, 0]))
    assert out.token_ids.tolist() == [1, 0]  # 2.0 - 2 * 0.3 = 1.4 < 1.5; 2.0 - 2 * 0.2 = 1.6


def test_presence_penalty_ignores_count():
    logits = torch.full((2, VOCAB), -5.0)
    logits[:, 0], logits[:, 1] = 2.0, 1.5
    params = SamplingArrays.defaults(2, presence_penalty=np.array([0.6, 0.4], np.float32))
    out = sample(logits, params, histories(2, [0, 0, 0]))
    assert out.token_ids.tolist() == [1, 0]  # 2.0 - 0.6 < 1.5 < 2.0 - 0.4, whatever the count


def test_presence_and_frequency_ignore_prompt_tokens():
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, 0], logits[0, 1] = 2.0, 1.5
    params = SamplingArrays.defaults(1, presence_penalty=np.array([2.0], np.float32))
    assert sample(logits, params, histories(1, [], prompt=[0, 0])).token_ids.tolist() == [0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.full((2, VOCAB), -9.0)
    logits[0, 0], logits[0, 1] = 2.0, 1.5  # 2.0 / 1.5 = 1.33 < 1.5
    logits[1, 0], logits[1, 1] = -1.0, -1.2  # -1.0 * 1.5 = -1.5 < -1.2
    params = SamplingArrays.defaults(2, repetition_penalty=np.full(2, 1.5, np.float32))
    out = sample(logits, params, histories(2, [], prompt=[0]))
    assert out.token_ids.tolist() == [1, 1]
    unpenalised = sample(logits, SamplingArrays.defaults(2), histories(2, [], prompt=[0]))
    assert unpenalised.token_ids.tolist() == [0, 0]


def test_logit_bias_forces_and_bans():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    top = logits.argmax(dim=1)
    weakest = logits.argmin(dim=1)
    params = SamplingArrays.defaults(
        2,
        temperature=np.array([0.0, 1.0], np.float32),
        logit_bias_ids=np.stack([top.numpy(), weakest.numpy()], axis=1).astype(np.int32),
        logit_bias_values=np.array([[-100.0, 0.0], [0.0, 100.0]], np.float32),
        num_logprobs=np.zeros(2, np.int32),
    )
    for seed in range(5):
        out = sample(logits, params, histories(2), torch.Generator().manual_seed(seed))
        assert out.token_ids[0] == logits[0].sort(descending=True).indices[1]
        assert out.token_ids[1] == weakest[1]
    # Logprobs stay those of the raw distribution: the forced token ranks last.
    assert out.ranks[1] == VOCAB
    assert math.isclose(
        out.logprobs[1].item(), torch.log_softmax(logits[1], 0)[weakest[1]].item(), rel_tol=1e-6
    )


def test_allowed_and_bad_token_ids():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(4))
    params = SamplingArrays.defaults(
        3,
        temperature=np.array([0.0, 1.0, 0.0], np.float32),
        allowed_token_ids=ids([[11, 12], [5], [-1]]),
        bad_token_ids=ids([[12], [-1], [int(logits[2].argmax())]]),
    )
    out = sample(logits, params, histories(3), torch.Generator().manual_seed(0))
    assert out.token_ids[0] == 11
    assert out.token_ids[1] == 5
    assert out.token_ids[2] == logits[2].sort(descending=True).indices[1]


def test_top_p_and_min_p_cut_the_tail():
    rows = 400
    logits = probs_logits([0.5, 0.3, 0.2], rows)
    gen = torch.Generator().manual_seed(5)
    hot = np.ones(rows, np.float32)
    top_p = sample(
        logits,
        SamplingArrays.defaults(rows, temperature=hot, top_p=np.full(rows, 0.6, np.float32)),
        histories(rows),
        gen,
    )
    assert set(top_p.token_ids.tolist()) == {0, 1}
    only_first = sample(
        logits,
        SamplingArrays.defaults(rows, temperature=hot, top_p=np.full(rows, 0.4, np.float32)),
        histories(rows),
        gen,
    )
    assert set(only_first.token_ids.tolist()) == {0}
    min_p = sample(
        logits,
        SamplingArrays.defaults(rows, temperature=hot, min_p=np.full(rows, 0.5, np.float32)),
        histories(rows),
        gen,
    )
    assert set(min_p.token_ids.tolist()) == {0, 1}
    top_k = sample(
        logits,
        SamplingArrays.defaults(rows, temperature=hot, top_k=np.full(rows, 2, np.int32)),
        histories(rows),
        gen,
    )
    assert set(top_k.token_ids.tolist()) == {0, 1}


def test_temperature_sampling_follows_the_distribution():
    rows = 4000
    logits = probs_logits([0.5, 0.3, 0.2], rows)
    out = sample(
        logits,
        SamplingArrays.defaults(rows, temperature=np.ones(rows, np.float32)),
        histories(rows),
        torch.Generator().manual_seed(6),
    )
    freq = np.bincount(out.token_ids.numpy(), minlength=3)[:3] / rows
    assert np.allclose(freq, [0.5, 0.3, 0.2], atol=0.03)
    sharp = sample(
        logits,
        SamplingArrays.defaults(rows, temperature=np.full(rows, 0.25, np.float32)),
        histories(rows),
        torch.Generator().manual_seed(6),
    )
    sharp_freq = np.bincount(sharp.token_ids.numpy(), minlength=3)[:3] / rows
    expected = np.array([0.5, 0.3, 0.2]) ** 4
    assert np.allclose(sharp_freq, expected / expected.sum(), atol=0.03)


def test_a_draw_follows_its_distribution_across_blocks_and_never_takes_a_masked_token():
    """inverse_cdf over a vocabulary of many blocks (and a last one cut short): the frequencies
    are the weights', and no uniform in (0, 1], however close to either end, draws a token of
    weight 0, wherever the zeros sit (a block's start, its end, whole blocks)."""
    vocab = INVERSE_CDF_BLOCK * 5 + 77
    weights = torch.zeros(vocab)
    heavy = [3, INVERSE_CDF_BLOCK - 1, INVERSE_CDF_BLOCK * 3, vocab - 2]  # around block edges
    weights[heavy] = torch.tensor([0.4, 0.3, 0.2, 0.1])
    rows = 20000
    uniforms = 1.0 - torch.rand(
        rows, dtype=torch.float64, generator=torch.Generator().manual_seed(3)
    )
    drawn = inverse_cdf(weights.repeat(rows, 1), uniforms)
    freq = np.bincount(drawn.numpy(), minlength=vocab)
    assert set(np.flatnonzero(freq)) == set(heavy)
    assert np.allclose(freq[heavy] / rows, [0.4, 0.3, 0.2, 0.1], atol=0.015)
    # the ends of (0, 1] and a point inside each token's share
    extremes = torch.tensor([1.0, 1.0 - 2**-52, 2**-53, 0.2, 0.55, 0.8, 0.95], dtype=torch.float64)
    edge = inverse_cdf(weights.repeat(len(extremes), 1), extremes).tolist()
    assert edge == [vocab - 2, vocab - 2, 3, 3, heavy[1], heavy[2], vocab - 2]
    # many small weights, most masked: what is drawn always has weight
    rng = np.random.default_rng(0)
    sparse = torch.from_numpy(rng.random((64, vocab)).astype(np.float32))
    sparse[torch.from_numpy(rng.random((64, vocab)) < 0.97)] = 0.0
    draws = inverse_cdf(sparse, 1.0 - torch.rand(64, dtype=torch.float64))
    assert (sparse[torch.arange(64), draws] > 0).all()


def test_logprobs_top_k_and_ranks_come_from_raw_logits():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(7))
    params = SamplingArrays.defaults(
        3,
        temperature=np.array([0.3, 2.0, 0.0], np.float32),
        num_logprobs=np.array([5, 2, 0], np.int32),
        presence_penalty=np.array([0.0, 0.0, 3.0], np.float32),
    )
    out = sample(
        logits, params, histories(3, [int(logits[2].argmax())]), torch.Generator().manual_seed(1)
    )
    raw = torch.log_softmax(logits, dim=1)
    assert out.top_ids.shape == (3, 5)
    torch.testing.assert_close(out.top_logprobs, raw.topk(5, dim=1).values)
    assert torch.allclose(raw.exp().sum(dim=1), torch.ones(3))
    for row in range(3):
        token = int(out.token_ids[row])
        assert math.isclose(out.logprobs[row].item(), raw[row, token].item(), rel_tol=1e-6)
        assert int(out.ranks[row]) == int((raw[row] > raw[row, token]).sum()) + 1
    assert int(out.ranks[2]) == 2  # the presence penalty moved greedy off the raw argmax


def test_bad_words_ban_their_last_token_after_the_rest():
    logits = torch.zeros(3, 10)
    logits[:, 6] = 5.0  # everyone's favourite
    bad_words = np.empty(3, object)
    bad_words[0] = ((5, 6),)  # its output ends with 5: 6 is banned
    bad_words[1] = ((4, 5, 6), (9, 6))  # ends with 4, 5: banned by the first word
    bad_words[2] = ((5, 6),)  # ends with 4: 6 stays allowed
    params = SamplingArrays.defaults(3, bad_words=bad_words)
    history = [
        TokenHistory.of([1, 2], [3, 5]),
        TokenHistory.of([1], [4, 5]),
        TokenHistory.of([1], [5, 4]),
    ]
    assert sample(logits, params, history).token_ids.tolist()[0] != 6
    assert sample(logits, params, history).token_ids.tolist()[1] != 6
    assert sample(logits, params, history).token_ids.tolist()[2] == 6


def test_sampling_rows_come_from_the_request_parameters_by_name():
    from gpu.sampler import SCALARS, RequestSampling, gather
    from stages.api import SamplingParams

    plain = RequestSampling.of(SamplingParams(), (0,), ())
    tuned = RequestSampling.of(
        SamplingParams(
            temperature=0.5,
            top_p=0.9,
            top_k=7,
            min_p=0.1,
            presence_penalty=0.2,
            frequency_penalty=0.3,
            repetition_penalty=1.1,
            seed=-1,
            min_tokens=4,
            logprobs=3,
            prompt_logprobs=1,
            logit_bias={5: 2.0, 9: -1.0},
            allowed_token_ids=(5, 9, 11),
        ),
        (0, 2),
        ((4,), (6, 7)),
    )
    arrays = gather([plain, tuned], np.zeros((2, 0), np.int32))
    # every scalar option reaches the sampler under its own name
    for name, attribute, _, none in SCALARS:
        assert getattr(arrays, name)[0] == (
            none if none is not None else getattr(SamplingParams(), attribute)
        )
    assert arrays.temperature[1] == np.float32(0.5) and arrays.top_k[1] == 7
    assert arrays.seed.tolist() == [-1, (1 << 63) - 1]  # a negative seed is still a seed
    assert arrays.num_logprobs.tolist() == [-1, 3] and tuned.prompt_logprobs == 1
    assert arrays.logit_bias_ids.tolist() == [[-1, -1], [5, 9]]
    assert arrays.allowed_token_ids.tolist() == [[-1, -1, -1], [5, 9, 11]]
    assert arrays.stop_token_ids.tolist() == [[0, -1], [0, 2]]
    assert arrays.bad_token_ids.tolist() == [[-1], [4]]
    assert arrays.bad_words[0] is None and arrays.bad_words[1] == ((6, 7),)


def test_logprob_token_ids_take_the_top_k_place():
    """vLLM's logprob_token_ids: a row reports exactly those tokens' logprobs (of the raw
    distribution, in the order given); the other rows keep their top-k."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(5))
    params = SamplingArrays.defaults(
        3,
        num_logprobs=np.array([3, 2, -1], np.int32),
        logprob_token_ids=ids([[9, 2, 4], [], []]),
    )
    out = sample(logits, params, histories(3))
    raw = torch.log_softmax(logits, dim=1)
    assert out.top_ids[0].tolist() == [9, 2, 4]
    torch.testing.assert_close(out.top_logprobs[0], raw[0, [9, 2, 4]])
    assert out.top_ids[1, :2].tolist() == raw[1].topk(2).indices.tolist()
    assert out.token_ids.tolist() == logits.argmax(dim=1).tolist()  # sampling is untouched


def test_a_forced_token_is_taken_with_its_own_logprob():
    """A spent thinking budget forces the end tag's token, whatever the sampler would pick."""
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(6))
    params = SamplingArrays.defaults(
        2,
        num_logprobs=np.array([0, 0], np.int32),
        forced_token_ids=np.array([11, -1], np.int32),
        temperature=np.array([1.0, 0.0], np.float32),
    )
    out = sample(logits, params, histories(2), torch.Generator().manual_seed(0))
    assert out.token_ids.tolist() == [11, int(logits[1].argmax())]
    raw = torch.log_softmax(logits, dim=1)
    torch.testing.assert_close(out.logprobs[0], raw[0, 11])


def test_owned_logits_are_sampled_in_place_with_the_same_result():
    """A caller that no longer needs its logits lets the knobs change them in place; the tokens
    and logprobs are those of sampling a copy, and a caller that keeps them sees them unchanged."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(5))
    params = SamplingArrays.defaults(
        3,
        temperature=np.array([0.0, 0.7, 0.0], np.float32),
        logit_bias_ids=ids([[int(logits[0].argmax())], [1], [2]]),
        logit_bias_values=np.array([[-100.0], [3.0], [50.0]], np.float32),
        frequency_penalty=np.array([0.0, 0.0, 1.5], np.float32),
        num_logprobs=np.zeros(3, np.int32),
    )
    kept = logits.clone()
    copy = sample(logits, params, histories(3, [2, 2]), torch.Generator().manual_seed(1))
    assert torch.equal(logits, kept)
    owned = sample(
        logits, params, histories(3, [2, 2]), torch.Generator().manual_seed(1), owned=True
    )
    assert not torch.equal(logits, kept)  # masked and penalised in place
    for field in ("token_ids", "logprobs", "ranks"):
        assert torch.equal(getattr(copy, field), getattr(owned, field)), field
