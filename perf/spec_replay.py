"""The most speculation can give on a workload: the model's own greedy outputs, replayed.

`pipeline-bench spec` measures speculation on against off. Its ratio is bounded by two things no
scheduling changes: how much of what the model writes the proposer finds in the tokens before it
(the model's and the workload's doing), and what a step verifying d drafts costs against a plain
decode step (the hardware's). `replay` walks a request's greedy output the way schedule drafts it:
at each step the method proposes from the tokens known so far, the drafts are accepted while they
equal the output, and the step emits them and one token more. Priced with a verification cost in
decode steps (measured on the model, `pipeline-bench spec --ceiling`), the tokens over the cost is
the on/off ratio with no pipeline costs at all (no step waiting for its predecessor's tokens, no
scheduling), drafting every proposal; `oracle_cost` prices a perfect draft-length policy, one that
drafts only the tokens that will be accepted. Greedy outputs are what speculation emits at
temperature 0, so the replay is exact for the drafts, and only the costs are modelled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from stages.speculation import SuffixCache, propose
from stages.speculative_config import SpeculativeConfig


@dataclass(slots=True)
class Replay:
    steps: int = 0  # decode steps after the first output token (which the prefill samples)
    tokens: int = 0  # the tokens those steps emit
    proposed_steps: int = 0  # steps whose request had a proposal
    drafted: int = 0  # draft tokens, every proposal drafted
    accepted: int = 0
    cost: float = 0.0  # in decode steps, every proposal drafted
    oracle_cost: float = 0.0  # in decode steps, only the drafts that are accepted

    def add(self, other: Replay) -> None:
        for name in Replay.__slots__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def ratio(self) -> float:
        """Output tokens per unit of time against plain decoding's one per decode step."""
        return self.tokens / self.cost if self.cost else 1.0

    @property
    def oracle_ratio(self) -> float:
        return self.tokens / self.oracle_cost if self.oracle_cost else 1.0

    def summary(self) -> dict[str, float]:
        return {
            "steps": self.steps,
            "tokens": self.tokens,
            "tokens_per_step": self.tokens / self.steps if self.steps else 1.0,
            "steps_with_proposal": self.proposed_steps / self.steps if self.steps else 0.0,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "ratio": self.ratio,
            "oracle_ratio": self.oracle_ratio,
        }


def linear_cost(verify_decode_steps: float, k: int) -> Callable[[int], float]:
    """A step verifying d drafts, in decode steps, on the line through no drafts (1) and k drafts
    (the measured `verify_decode_steps`): each drafted row costs the same share."""
    per_draft = (verify_decode_steps - 1.0) / k
    return lambda d: 1.0 + per_draft * d


def replay(
    spec: SpeculativeConfig,
    prompt_ids: np.ndarray,  # [P] int32
    output_ids: np.ndarray,  # [O] int32, the request's greedy output
    step_cost: Callable[[int], float],  # decode steps a step verifying d drafts costs
    suffix_cache: SuffixCache | None = None,  # recent outputs (suffix); this one is not added
) -> Replay:
    """One request's decode steps under speculation, drafting every proposal as the proposer
    makes it (up to num_speculative_tokens and what max_tokens leaves, as schedule caps it)."""
    if spec.drafts_with_a_model:
        raise ValueError("a draft model's proposals come from the model: no replay")
    result = Replay()
    tokens = np.concatenate([prompt_ids, output_ids]).astype(np.int32)
    prompt_len, total = len(prompt_ids), len(output_ids)
    i = 1  # outputs known
    while i < total:
        room = min(spec.num_speculative_tokens, total - i - 1)
        drafts = propose(spec, tokens[: prompt_len + i], room, suffix_cache)
        future = output_ids[i : i + len(drafts)]
        matches = np.flatnonzero(drafts != future)
        accepted = int(matches[0]) if len(matches) else len(drafts)
        result.steps += 1
        result.tokens += 1 + accepted
        result.proposed_steps += len(drafts) > 0
        result.drafted += len(drafts)
        result.accepted += accepted
        result.cost += step_cost(len(drafts))
        result.oracle_cost += step_cost(accepted)
        i += 1 + accepted
    return result


def replay_each(
    spec: SpeculativeConfig,
    requests: list[tuple[np.ndarray, np.ndarray]],  # (prompt ids, greedy output ids), in order
    step_cost: Callable[[int], float],
) -> list[Replay]:
    """Requests one after another; with suffix decoding each output joins the recent outputs
    the next ones look in, as a finished request's does in schedule."""
    cache = None
    if spec.suffix is not None and spec.suffix.max_cached_requests > 0:
        cache = SuffixCache(spec.suffix.max_cached_requests)
    each = []
    for prompt_ids, output_ids in requests:
        each.append(replay(spec, prompt_ids, output_ids, step_cost, cache))
        if cache is not None:
            cache.add(output_ids.tolist())
    return each


def replay_all(
    spec: SpeculativeConfig,
    requests: list[tuple[np.ndarray, np.ndarray]],
    step_cost: Callable[[int], float],
) -> Replay:
    """replay_each's requests, summed."""
    return summed(replay_each(spec, requests, step_cost))


def summed(replays: list[Replay]) -> Replay:
    total = Replay()
    for one in replays:
        total.add(one)
    return total


def with_prefill(
    replays: list[Replay],
    timings: list[tuple[float, float]],  # per request, without speculation: (TTFT, E2E) seconds
    oracle: bool = False,
) -> float:
    """The on/off ratio of requests run one after another (c=1), prefill included, as the
    bench's output tok/s counts it: both servers take each request's measured time to its first
    token, and speculation scales the decoding after it, measured without speculation (a step
    per token), by the replay's cost per token. The prefill is work speculation cannot shorten."""
    off = on = 0.0
    for one, (ttft, e2e) in zip(replays, timings, strict=True):
        decoding = max(e2e - ttft, 0.0)
        cost = one.oracle_cost if oracle else one.cost
        off += ttft + decoding
        on += ttft + (decoding * cost / one.tokens if one.tokens else decoding)
    return off / on if on else 1.0
