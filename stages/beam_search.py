"""Beam search selection: which candidates survive a step, the finished hypotheses, the length
penalty and early stopping, scored exactly as transformers' `generate(num_beams=...)` scores them.
Pure: each step's top candidates in, the surviving (parent, token) pairs out."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# transformers' stand-in for "no score": an empty finished slot, a beam that may not run on.
_NONE_SCORE = -1.0e9


def candidates_per_beam(width: int, num_stop_ids: int) -> int:
    """Candidates a step needs from each beam: transformers keeps max(2, 1 + #EOS ids) * width of
    the whole step, so that `width` of them can still run on after every stop token is taken, and
    the best K over all beams are among the best K of each beam."""
    return max(2, 1 + num_stop_ids) * width


def penalised(logprob: float, length: int, length_penalty: float) -> float:
    """logprob / length ** length_penalty, in float64 that overflows to inf rather than raising
    (a client may send any length_penalty)."""
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        return float(logprob / np.float64(length) ** length_penalty)


@dataclass(slots=True, frozen=True)
class Hypothesis:
    tokens: tuple[int, ...]  # the generated tokens, the one that ended it included
    logprob: float  # cumulative log-probability
    score: float  # logprob / len(tokens) ** length_penalty
    stopped: bool  # ended on a stop token or string (else on the length limit)


@dataclass(slots=True)
class BeamSearch:
    """One request's search. `step` takes the top candidates of each running beam, in the order of
    `running`, and returns the beams of the next step as (parent index, token) pairs, best first.

    As transformers: the best K = `candidates_per_beam` continuations over all beams are taken by
    cumulative log-probability; those of them in the first `width` that end (a stop, or the
    length limit) become hypotheses scored logprob / length ** length_penalty, the length counting
    generated tokens with the last; the best `width` that do not end run on. The search stops when
    no running beam can beat the worst of `width` hypotheses (early_stopping False: judged at the
    current length; "never": at the longest length when length_penalty > 0), when `width`
    hypotheses are found (early_stopping True), or when every candidate ends.
    """

    width: int
    max_new_tokens: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never"
    num_candidates: int = 0  # K; 0: candidates_per_beam(width, 1)
    running: list[tuple[int, ...]] = field(default_factory=lambda: [()])
    logprobs: list[float] = field(default_factory=lambda: [0.0])  # of each running beam
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most width
    num_generated: int = 0
    improvable: bool = True  # transformers' is_early_stop_heuristic_unsatisfied
    done: bool = False

    def __post_init__(self) -> None:
        if not self.num_candidates:
            self.num_candidates = candidates_per_beam(self.width, 1)

    def step(
        self,
        top_ids: np.ndarray,  # [B, K'] int64, each running beam's best tokens, -1 padded
        top_logprobs: np.ndarray,  # [B, K'] float32, their log-probabilities
        stops: np.ndarray,  # [B, K'] bool, whether the token ends its beam (stop id or string)
    ) -> list[tuple[int, int]]:
        if self.done:
            raise RuntimeError("the search is over")
        if len(top_ids) != len(self.running):
            raise ValueError(f"{len(top_ids)} rows of candidates for {len(self.running)} beams")
        totals = np.asarray(self.logprobs, np.float64)[:, None] + top_logprobs.astype(np.float64)
        totals = np.where(top_ids >= 0, totals, -np.inf).ravel()
        order = np.argsort(-totals, kind="stable")[: self.num_candidates]
        order = order[np.isfinite(totals[order])]
        parents = order // top_ids.shape[1]
        tokens = top_ids.ravel()[order].tolist()
        scores = totals[order].tolist()
        stopped = stops.ravel()[order].tolist()
        length = self.num_generated + 1
        at_limit = length >= self.max_new_tokens
        ends = [stop or at_limit for stop in stopped]

        full = len(self.finished) == self.width
        if self.improvable and not (self.early_stopping is True and full):
            new = [
                Hypothesis(
                    self.running[p] + (t,),
                    s,
                    penalised(s, length, self.length_penalty),
                    stop and not at_limit,
                )
                for p, t, s, stop in zip(
                    parents[: self.width].tolist(),
                    tokens[: self.width],
                    scores[: self.width],
                    stopped[: self.width],
                    strict=True,
                )
                if stop or at_limit
            ]
            merged = sorted(self.finished + new, key=lambda h: h.score, reverse=True)
            self.finished = merged[: self.width]

        keep = [i for i, end in enumerate(ends) if not end][: self.width]
        chosen = [(int(parents[i]), tokens[i]) for i in keep]
        self.running = [self.running[p] + (t,) for p, t in chosen]
        self.logprobs = [scores[i] for i in keep]
        self.num_generated = length
        if self.running:
            longest = self.early_stopping == "never" and self.length_penalty > 0
            best_length = self.max_new_tokens if longest else self.num_generated
            best = penalised(self.logprobs[0], best_length, self.length_penalty)
            worst = self.finished[-1].score if len(self.finished) == self.width else _NONE_SCORE
            self.improvable = self.improvable and best > worst
        all_found = self.early_stopping is True and len(self.finished) == self.width
        self.done = not self.improvable or all_found or all(ends) or not self.running
        return chosen

    def results(self) -> list[Hypothesis]:
        """The hypotheses, best first (the search is over)."""
        return list(self.finished)
