"""How many draft tokens each request gets in the next step, so that speculation never costs.

A draft token costs the step one more token of compute and pays only if it is accepted. On a CPU
(or a GPU under load) a step's time grows with its tokens, so the policy learns that growth from
the steps it sees, `step_s ~ fixed_s + per_token_s * tokens`, and each request's chance that a draft
is accepted (`acceptance`, a decaying average). Drafting costs no overlap: a plan with drafts is
made a step ahead like any other (stages/draft_rows.py).

For one step it adds draft positions, most promising first (draft j of a request with acceptance a
is accepted with probability a^j), while they raise the step's expected output tokens per second,
and drafts only if that beats no drafts by REQUIRED_GAIN (what the straight-line fit can resolve);
an unpromising request, a compute-bound step or a crowded one gets none. Plain numbers in, plain
numbers out: schedule feeds it, and it is tested on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

# A request's acceptance starts here, optimistic (a proposal is an n-gram that did occur), so that
# a new request tries speculation even where a step's tokens cost much, and learns its own.
PRIOR_ACCEPTANCE = 0.75
ACCEPTANCE_DECAY = 0.7  # weight of the past in each update: about the last three steps count
# Acceptance never falls below this; and each step a request has a proposal but drafts none, it
# drifts back toward the prior (RETRY_RATE of the way), so a request that stopped matching is
# tried again every few dozen steps (its proposals change as the text goes on).
MIN_ACCEPTANCE = 0.05
RETRY_RATE = 0.05
COST_DECAY = 0.97  # the step-time fit remembers about the last 30 steps
# The slope is refitted only once step sizes spread this much (standard deviation over mean):
# steps all of about one size (32 streams decoding) say little about what a token more costs.
MIN_TOKEN_SPREAD = 0.25
# Drafts must promise this much more output per second than none: the cost model is a straight
# line through noisy steps, and a small promised gain is within its error.
REQUIRED_GAIN = 0.10


@dataclass(slots=True)
class StepCost:
    """A least-squares fit of step time against tokens, with exponential forgetting."""

    fixed_s: float = 0.010  # a guess until steps are seen: a small model's step on a CPU
    per_token_s: float = 0.002
    _n: float = 0.0
    _sx: float = 0.0
    _sy: float = 0.0
    _sxx: float = 0.0
    _sxy: float = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        d = COST_DECAY
        self._n = d * self._n + 1.0
        self._sx = d * self._sx + tokens
        self._sy = d * self._sy + seconds
        self._sxx = d * self._sxx + tokens * tokens
        self._sxy = d * self._sxy + tokens * seconds
        spread = self._n * self._sxx - self._sx * self._sx  # n^2 * variance of the sizes
        if spread > (MIN_TOKEN_SPREAD * self._sx) ** 2:  # sizes have varied enough: fit both
            slope = (self._n * self._sxy - self._sx * self._sy) / spread
            self.per_token_s = max(slope, 1e-7)
            self.fixed_s = max(self._sy / self._n - self.per_token_s * self._sx / self._n, 0.0)
        else:  # one step size so far: keep the guess's proportions, at the observed scale
            scale = (self._sy / self._n) / self.step_s(round(self._sx / self._n))
            self.fixed_s *= scale
            self.per_token_s *= scale

    def step_s(self, tokens: int) -> float:
        return self.fixed_s + self.per_token_s * tokens


def update_acceptance(acceptance: float, num_drafted: int, num_accepted: int) -> float:
    """A request's acceptance after a step that verified num_drafted drafts and accepted the first
    num_accepted: each accepted draft is a success, the first rejected one a failure."""
    if num_drafted <= 0:
        return acceptance
    trials = num_accepted + (1 if num_accepted < num_drafted else 0)
    observed = num_accepted / trials
    weight = ACCEPTANCE_DECAY**trials
    return max(MIN_ACCEPTANCE, weight * acceptance + (1.0 - weight) * observed)


def undrafted(acceptance: float) -> float:
    """A request's acceptance after a step in which it had a proposal and drafted none."""
    return acceptance + RETRY_RATE * (PRIOR_ACCEPTANCE - acceptance)


def plan_drafts(
    cost: StepCost,
    base_tokens: int,  # tokens the step carries without drafts (decodes, prefill chunks)
    base_outputs: int,  # tokens it emits without drafts (one per row that samples)
    candidates: list[tuple[float, int]],  # per request that can draft: (acceptance, proposal len)
) -> list[int]:
    """Draft tokens for each candidate, in order: the choice that maximises the step's expected
    output tokens per second, drafts added most likely first."""
    counts = [0] * len(candidates)
    if not candidates:
        return counts
    # Every (request, draft position): the expected tokens it adds, a^j. Within a request these
    # fall with j, so taking them in descending order never takes draft j before draft j - 1.
    units = sorted(
        ((acceptance**j, i) for i, (acceptance, length) in enumerate(candidates)
         for j in range(1, length + 1)),
        reverse=True,
    )  # fmt: skip
    base_s = cost.step_s(base_tokens)
    best_rate = (1.0 + REQUIRED_GAIN) * base_outputs / base_s if base_s > 0 else 0.0
    best_taken = 0
    gained = 0.0
    for taken, (gain, _) in enumerate(units, start=1):
        gained += gain
        rate = (base_outputs + gained) / (base_s + cost.per_token_s * taken)
        if rate > best_rate:
            best_rate, best_taken = rate, taken
    for _, i in units[:best_taken]:
        counts[i] += 1
    return counts
