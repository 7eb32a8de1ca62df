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
    end_ids: tuple[int, ...]  # the close tag's tokens (where the model ends its thinking itself)
    inside: bool  # the output begins inside the tags
    count: int = 0  # thinking tokens the prompt already holds after its open tag
    # what is forced when the budget is spent (--reasoning-config's reasoning_end_str: a
    # transition phrase before the close tag, say); () : the close tag itself
    forced_ids: tuple[int, ...] = ()

    @classmethod
    def of(
        cls,
        budget: int,
        start_ids: Sequence[int],
        end_ids: Sequence[int],
        prompt_ids: Sequence[int],
        implied: bool,  # the parser's rule: the output begins in reasoning (DeepSeek-R1)
        forced_ids: Sequence[int] = (),
    ) -> ThinkingBudget:
        """As vLLM reads the prompt: inside when its last open tag comes after its last close
        tag, and the tokens after that open tag count already."""
        last_start = last_index(prompt_ids, start_ids)
        last_end = last_index(prompt_ids, end_ids)
        opened = last_start > last_end
        count = len(prompt_ids) - (last_start + len(start_ids)) if opened else 0
        forced = tuple(forced_ids) if tuple(forced_ids) != tuple(end_ids) else ()
        return cls(budget, tuple(start_ids), tuple(end_ids), opened or implied, count, forced)


class ThinkingTracker:
    """Follows one request's sampled tokens: inside the tags or not, how many it thought, and the
    end tag's tokens still to force."""

    __slots__ = ("_end", "_forced", "_forcing", "_start", "_tail", "budget", "count", "inside")

    def __init__(self, spec: ThinkingBudget) -> None:
        self.budget = spec.budget
        self._start, self._end = spec.start_ids, spec.end_ids
        self._forced = spec.forced_ids or spec.end_ids
        self.inside = spec.inside
        self.count = spec.count
        self._forcing = -1  # index into the end tag being forced; -1: not forcing
        self._tail: deque[int] = deque(maxlen=max(len(self._start), len(self._end), 1))

    def forced(self) -> int:
        """The token the next sample must be (-1: any)."""
        self._begin_forcing()
        return self._forced[self._forcing] if self._forcing >= 0 else -1

    def _begin_forcing(self) -> None:
        """The budget is spent: the end's tokens are forced from the next one on."""
        if self._forcing < 0 and self.inside and self.count >= self.budget and self._forced:
            self._forcing = 0

    def forced_along(self, drafts: Sequence[int]) -> list[int]:
        """The forced token (-1: any) at the next position and after each draft in turn, as if
        the drafts had been taken (speculative decoding verifies them all in one step); the
        tracker itself only moves as forced() does."""
        ahead = [self.forced()]
        if not drafts:
            return ahead
        probe = ThinkingTracker.__new__(ThinkingTracker)
        probe.budget, probe.count, probe.inside = self.budget, self.count, self.inside
        probe._start, probe._end, probe._forcing = self._start, self._end, self._forcing
        probe._forced = self._forced
        probe._tail = deque(self._tail, maxlen=self._tail.maxlen)
        for token in drafts:
            probe.consume(token)
            ahead.append(probe.forced())
        return ahead

    def consume(self, token: int) -> None:
        """The token sampled (or forced) for the request (several a step under speculation,
        with forced() asked only before the first)."""
        self._begin_forcing()
        self._tail.append(token)
        if self._forcing >= 0:
            self._forcing += 1
            if self._forcing == len(self._forced):
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


def last_index(ids: Sequence[int], tag: Sequence[int]) -> int:
    """Where the last occurrence of `tag` starts in `ids`; -1 if nowhere."""
    if not tag:
        return -1
    array = np.asarray(ids, np.int64)  # [P]
    for start in np.flatnonzero(array == tag[0])[::-1].tolist():
        if array[start : start + len(tag)].tolist() == list(tag):
            return int(start)
    return -1
