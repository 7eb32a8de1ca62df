"""vLLM's thinking_token_budget: how many tokens a request may spend inside its think tags before
the end tag is forced on it. Torch-free: render resolves the tags to token ids (`ThinkingBudget`),
execute follows each such request's tokens (`ThinkingTracker`) and makes the sampler write the end
tag's tokens once the budget is spent, as vLLM's ThinkingTokenBudgetLogitsProcessor does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import msgspec
import numpy as np


class ThinkingBudget(msgspec.Struct, frozen=True, array_like=True):
    """One request's budget and its think tags as tokens; render builds it, execute follows it."""

    budget: int  # tokens allowed inside the tags
    start_ids: tuple[int, ...]  # the open tag's tokens
    end_ids: tuple[int, ...]  # the close tag's tokens, forced when the budget is spent
    inside: bool  # the output begins inside the tags
    count: int = 0  # thinking tokens the prompt already holds after its open tag

    @classmethod
    def of(
        cls,
        budget: int,
        start_ids: Sequence[int],
        end_ids: Sequence[int],
        prompt_ids: Sequence[int],
        implied: bool,  # the parser's rule: the output begins in reasoning (DeepSeek-R1)
    ) -> ThinkingBudget:
        """As vLLM reads the prompt: inside when its last open tag comes after its last close
        tag, and the tokens after that open tag count already."""
        last_start = _last_index(prompt_ids, start_ids)
        last_end = _last_index(prompt_ids, end_ids)
        opened = last_start > last_end
        count = len(prompt_ids) - (last_start + len(start_ids)) if opened else 0
        return cls(budget, tuple(start_ids), tuple(end_ids), opened or implied, count)


class ThinkingTracker:
    """Follows one request's sampled tokens: inside the tags or not, how many it thought, and the
    end tag's tokens still to force."""

    __slots__ = ("_end", "_forcing", "_start", "_tail", "budget", "count", "inside")

    def __init__(self, spec: ThinkingBudget) -> None:
        self.budget = spec.budget
        self._start, self._end = spec.start_ids, spec.end_ids
        self.inside = spec.inside
        self.count = spec.count
        self._forcing = -1  # index into the end tag being forced; -1: not forcing
        self._tail: deque[int] = deque(maxlen=max(len(self._start), len(self._end), 1))

    def forced(self) -> int:
        """The token the next sample must be (-1: any). Call once per sampled step."""
        if self._forcing < 0 and self.inside and self.count >= self.budget and self._end:
            self._forcing = 0
        return self._end[self._forcing] if self._forcing >= 0 else -1

    def consume(self, token: int) -> None:
        """The token sampled (or forced) for the request."""
        self._tail.append(token)
        if self._forcing >= 0:
            self._forcing += 1
            if self._forcing == len(self._end):
                self._forcing, self.inside, self.count = -1, False, 0
            return
        if _ends_with(self._tail, self._end):
            self.inside, self.count = False, 0
        elif _ends_with(self._tail, self._start):
            self.inside, self.count = True, 0
        elif self.inside:
            self.count += 1


def _ends_with(tail: deque[int], tag: Sequence[int]) -> bool:
    return bool(tag) and len(tail) >= len(tag) and list(tail)[-len(tag) :] == list(tag)


def _last_index(ids: Sequence[int], tag: Sequence[int]) -> int:
    """Where the last occurrence of `tag` starts in `ids`; -1 if nowhere."""
    if not tag:
        return -1
    array = np.asarray(ids, np.int64)  # [P]
    for start in np.flatnonzero(array == tag[0])[::-1].tolist():
        if array[start : start + len(tag)].tolist() == list(tag):
            return int(start)
    return -1
