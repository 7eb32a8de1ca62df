"""The beam search selection on hand-made distributions: survivors, hypotheses, length penalty and
early stopping, as transformers decides them."""

from __future__ import annotations

import math

import numpy as np
import pytest

from stages.beam_search import BeamSearch, candidates_per_beam, penalised

EOS = 0


def run(search: BeamSearch, model, stop_ids=(EOS,)) -> list[tuple[int, ...]]:
    """Drive a search with `model(tokens) -> {token: prob}` until it is done."""
    while not search.done:
        rows = [model(tokens) for tokens in search.running]
        k = search.num_candidates
        ids = np.full((len(rows), k), -1, np.int64)
        lps = np.full((len(rows), k), -np.inf, np.float32)
        for b, dist in enumerate(rows):
            best = sorted(dist.items(), key=lambda kv: -kv[1])[:k]
            ids[b, : len(best)] = [t for t, _ in best]
            lps[b, : len(best)] = [math.log(p) for _, p in best]
        search.step(ids, lps, np.isin(ids, stop_ids))
    return [h.tokens for h in search.results()]


def test_candidates_per_beam_follows_the_stop_ids():
    assert candidates_per_beam(4, 1) == 8
    assert candidates_per_beam(4, 0) == 8
    assert candidates_per_beam(3, 2) == 9


def test_width_one_is_greedy():
    def model(tokens):
        return {1: 0.6, 2: 0.4} if len(tokens) < 3 else {EOS: 0.9, 1: 0.1}

    search = BeamSearch(width=1, max_new_tokens=10)
    assert run(search, model) == [(1, 1, 1, EOS)]


def test_beam_finds_a_sequence_greedy_misses():
    # Greedy takes 1 (0.6) and then has 0.5 at best; 2 (0.4) is followed by a sure 3: 0.4 > 0.3.
    table = {(): {1: 0.6, 2: 0.4}, (1,): {4: 0.5, 5: 0.5}, (2,): {3: 1.0 - 1e-6, 6: 1e-6}}

    def model(tokens):
        return table.get(tokens, {EOS: 1.0 - 1e-6, 7: 1e-6})

    best = run(BeamSearch(width=2, max_new_tokens=3, early_stopping=True), model)
    assert best[0] == (2, 3, EOS)


def test_length_penalty_trades_probability_for_length():
    # A short ending (0.3) against a long one (0.7 * 0.6 * 0.6 * 0.9 ~ 0.23 over 4 tokens).
    def model(tokens):
        if not tokens:
            return {EOS: 0.3, 1: 0.7}
        return {1: 0.6, EOS: 0.4} if len(tokens) < 3 else {EOS: 0.9, 1: 0.1}

    short = run(BeamSearch(width=2, max_new_tokens=8, length_penalty=0.0), model)
    long = run(BeamSearch(width=2, max_new_tokens=8, length_penalty=2.0), model)
    assert short[0] == (EOS,)  # log 0.3 > log 0.23
    assert long[0] == (1, 1, 1, EOS)  # log 0.23 / 4 ** 2 beats log 0.3 / 1


def test_only_the_top_width_candidates_may_finish():
    # The second beam's EOS ranks below `width` candidates: it is a backup, never a hypothesis.
    search = BeamSearch(width=2, max_new_tokens=5)
    ids = np.array([[1, 2, EOS, 3]])
    lps = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))
    assert search.step(ids, lps, ids == EOS) == [(0, 1), (0, 2)]
    assert search.finished == []
    ids = np.array([[EOS, 4, 5, 6], [7, 8, 9, EOS]])
    lps = np.log(np.array([[0.9, 0.05, 0.03, 0.02], [0.5, 0.3, 0.1, 0.1]], np.float32))
    chosen = search.step(ids, lps, ids == EOS)
    assert [h.tokens for h in search.finished] == [(1, EOS)]
    assert chosen == [(1, 7), (1, 8)]  # the ended candidate never runs on
    assert search.finished[0].score == pytest.approx(math.log(0.45) / 2, rel=1e-6)


def test_early_stopping_true_ends_once_width_hypotheses_are_found():
    def model(tokens):
        return {EOS: 0.5, 1: 0.3, 2: 0.2}

    eager = BeamSearch(width=2, max_new_tokens=50, early_stopping=True)
    run(eager, model)
    assert eager.num_generated == 2 and len(eager.finished) == 2
    patient = BeamSearch(width=2, max_new_tokens=50, early_stopping="never", length_penalty=2.0)
    run(patient, model)
    assert patient.num_generated > eager.num_generated


def test_the_length_limit_finishes_the_best_running_beams():
    search = BeamSearch(width=3, max_new_tokens=2)
    out = run(search, lambda tokens: {1: 0.5, 2: 0.3, 3: 0.2}, stop_ids=())
    assert out == [(1, 1), (1, 2), (2, 1)]
    assert not any(h.stopped for h in search.results())


def test_a_stop_string_ends_beams_until_none_run():
    # Every candidate "ends" (as a stop string would): the hypotheses are the first step's best.
    search = BeamSearch(width=2, max_new_tokens=9)
    ids = np.array([[1, 2, 3, 4]])
    lps = np.log(np.array([[0.4, 0.3, 0.2, 0.1]], np.float32))
    assert search.step(ids, lps, np.ones_like(ids, bool)) == []
    assert search.done and [h.tokens for h in search.results()] == [(1,), (2,)]
    assert all(h.stopped for h in search.results())


def test_a_finished_search_refuses_more_steps():
    search = BeamSearch(width=1, max_new_tokens=1)
    ids = np.array([[1, 2]])
    search.step(ids, np.zeros((1, 2), np.float32), ids < 0)
    with pytest.raises(RuntimeError):
        search.step(ids, np.zeros((1, 2), np.float32), ids < 0)


def test_any_length_penalty_scores_without_raising():
    search = BeamSearch(width=1, max_new_tokens=2, length_penalty=1e6)
    ids = np.array([[3, 4]])
    search.step(ids, np.log(np.array([[0.6, 0.4]], np.float32)), ids < 0)
    search.step(ids, np.log(np.array([[0.6, 0.4]], np.float32)), ids < 0)
    assert search.done and search.results()[0].score == 0.0  # -0.36 / 2 ** 1e6
    assert math.isinf(penalised(-1.0, 2, -1e6))
