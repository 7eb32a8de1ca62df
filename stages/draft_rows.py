"""Drafts planned a step ahead of their request's tokens (vLLM's async scheduling with
speculative decoding), as execute takes them.

Schedule plans step N+1 while step N runs, also for a request whose row in N verifies drafts. It
cannot know how many of them N accepts, so it plans N+1 as if all were (positions, KV blocks,
length limits), and reserves N+1's drafts as placeholders (-1): nobody can propose them before
N's tokens are known. Execute, which has N's tokens when N+1 arrives:
- moves each such row back onto what its request's last step kept (`Behind.rebase`: positions,
  slots and context length, by the drafts N rejected), where the block table already has room;
- fills the placeholders (a model-free proposer here, the draft model in the runner) and drops
  those it has no draft for (`trim`), so that no step computes a position nobody proposed.

Schedule learns N's outcome from its results and moves its own count back by as many
(`Scheduler._verified`): the two agree again at every result. A row schedule planned after N's
results already starts where N left its request, and is left as it is.
"""

from __future__ import annotations

import numpy as np

from stages.speculation import SuffixCache, propose
from stages.speculative_config import SpeculativeConfig


class Behind:
    """Per request whose last step rejected drafts: where schedule, not knowing that yet, would
    start its next row, and how many positions before that it really starts."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._behind: dict[int, tuple[int, int]] = {}  # handle -> (planned start, short by)

    def verified(self, handle: int, first_position: int, reserved: int, accepted: int) -> None:
        """A row that started at first_position, had `reserved` draft positions planned and
        accepted `accepted` drafts (of those filled)."""
        if accepted < reserved:
            self._behind[handle] = (first_position + 1 + reserved, reserved - accepted)
        else:
            self._behind.pop(handle, None)

    def forget(self, handle: int) -> None:
        self._behind.pop(handle, None)

    def __bool__(self) -> bool:
        return bool(self._behind)

    def rebase(
        self,
        handles: np.ndarray,  # [B] int64
        query_start_loc: np.ndarray,  # [B + 1]
        positions: np.ndarray,  # [T] int64, moved in place
        slot_mapping: np.ndarray,  # [T] int64, moved in place
        context_lens: np.ndarray,  # [B] int32, moved in place
        block_tables: np.ndarray,  # [B, W] int32
    ) -> None:
        """Move back each row planned before its request's last result."""
        if not self._behind:
            return
        size = self.block_size
        for row, handle in enumerate(handles.tolist()):
            behind = self._behind.pop(handle, None)
            if behind is None:
                continue
            planned, short = behind
            lo, hi = int(query_start_loc[row]), int(query_start_loc[row + 1])
            if positions[lo] != planned:
                continue  # planned on that result: it starts where the request is
            moved = positions[lo:hi] - short
            positions[lo:hi] = moved
            context_lens[row] -= short
            table = block_tables[row].astype(np.int64)
            slot_mapping[lo:hi] = table[moved // size] * size + moved % size


def trim(
    query_start_loc: np.ndarray,  # [B + 1]
    token_arrays: list[np.ndarray],  # each [T]: input ids, positions, slots
    context_lens: np.ndarray,  # [B]
    num_draft: np.ndarray,  # [B]: each row's last num_draft inputs are draft positions
    kept: np.ndarray,  # [B]: of those, the first `kept` have drafts
) -> tuple[np.ndarray, list[np.ndarray], np.ndarray, np.ndarray]:
    """The step without the draft positions nobody filled: (query_start_loc, token arrays,
    context_lens, num_draft), each new."""
    dropped = (num_draft - kept).astype(np.int64)
    ends = query_start_loc[1:].astype(np.int64)
    keep = np.ones(int(query_start_loc[-1]), bool)
    for row in np.flatnonzero(dropped).tolist():
        keep[ends[row] - dropped[row] : ends[row]] = False
    lengths = np.diff(query_start_loc).astype(np.int64) - dropped
    starts = np.zeros(len(lengths) + 1, query_start_loc.dtype)
    np.cumsum(lengths, out=starts[1:])
    return (
        starts,
        [values[keep] for values in token_arrays],
        (context_lens - dropped).astype(context_lens.dtype),
        kept.astype(num_draft.dtype),
    )


class _Tokens:
    """One request's tokens by position, in an array that grows by doubling."""

    def __init__(self, known: np.ndarray, num_prompt: int) -> None:
        self.ids = np.zeros(max(2 * len(known), 64), np.int32)
        self.ids[: len(known)] = known
        self.length = len(known)
        self.num_prompt = num_prompt

    def extend(self, tokens: list[int]) -> None:
        end = self.length + len(tokens)
        if end > len(self.ids):
            grown = np.zeros(2 * end, np.int32)
            grown[: self.length] = self.ids[: self.length]
            self.ids = grown
        self.ids[self.length : end] = tokens
        self.length = end


class Proposer:
    """Execute's model-free proposals (ngram, suffix): each request's tokens as execute knows
    them (sent with its first step, then each token it emits), and for suffix decoding the
    outputs of recent requests (as execute emitted them: a step planned ahead of a stop may have
    added a few after it)."""

    def __init__(self, spec: SpeculativeConfig) -> None:
        self.spec = spec
        self.suffix_cache = (
            SuffixCache(spec.suffix.max_cached_requests) if spec.suffix is not None else None
        )
        self._tokens: dict[int, _Tokens] = {}

    def admit(self, handle: int, known: np.ndarray, num_prompt: int) -> None:
        """A request's known tokens (prompt, then any outputs) when execute first sees it."""
        self._tokens[handle] = _Tokens(known, num_prompt)

    def emitted(self, handle: int, tokens: list[int]) -> None:
        entry = self._tokens.get(handle)
        if entry is not None:
            entry.extend(tokens)

    def forget(self, handle: int) -> None:
        entry = self._tokens.pop(handle, None)
        if entry is not None and self.suffix_cache is not None:
            self.suffix_cache.add(entry.ids[entry.num_prompt : entry.length].tolist())

    def fill(
        self,
        handles: np.ndarray,  # [B] int64
        query_start_loc: np.ndarray,  # [B + 1]
        input_ids: np.ndarray,  # [T] int64: a row's last num_draft are placeholders, filled here
        num_draft: np.ndarray,  # [B]
    ) -> np.ndarray:  # -> [B] int64, drafts filled into each row's placeholders (the first ones)
        """Propose each drafting row's drafts on its request's tokens (its input token last)."""
        kept = np.zeros(len(handles), np.int64)
        for row in np.flatnonzero(num_draft).tolist():
            entry = self._tokens.get(int(handles[row]))
            if entry is None:
                continue
            room = int(num_draft[row])
            drafts = propose(self.spec, entry.ids[: entry.length], room, self.suffix_cache)
            first = int(query_start_loc[row + 1]) - room
            input_ids[first : first + len(drafts)] = drafts
            kept[row] = len(drafts)
        return kept
