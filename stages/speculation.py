"""Speculative decoding's model-free proposers, which schedule runs on each request's known tokens:
prompt lookup (vLLM's `ngram`) and SuffixDecoding (vLLM's `suffix`, over the request's tokens and the outputs of recent requests).
A draft model (vLLM's `draft_model`) proposes in execute instead (gpu/drafter.py).

Execute verifies the drafts (gpu/sampler.py `verify`, `rejection_sample`): a step checks 1 + k
positions of a request at once, and every token it emits is distributed exactly as plain
decoding's would be. The configuration is in stages/speculative_config.py.
"""

from __future__ import annotations

import numpy as np

from stages.speculative_config import SpeculativeConfig, SuffixParams


def _match_lengths(
    haystack: np.ndarray,  # [H] int32, where occurrences may end (-1: a boundary nothing matches)
    context: np.ndarray,  # [N] int32, whose suffix is looked for
    max_n: int,
    before: int | None = None,  # occurrences must end before this position
) -> tuple[np.ndarray, np.ndarray]:  # ([E] end positions in haystack, [E] match lengths)
    """Where the context's last token occurs in the haystack, and how many of the context's
    last tokens (up to max_n) match backwards from each occurrence."""
    ends = np.flatnonzero(haystack[:before] == context[-1])
    length = np.ones(len(ends), np.int64)
    alive = np.ones(len(ends), bool)
    for back in range(1, min(max_n, len(context))):
        at = ends - back
        ok = alive & (at >= 0)
        ok[ok] = haystack[at[ok]] == context[len(context) - 1 - back]
        alive = ok
        if not alive.any():
            break
        length += alive
    return ends, length


def propose_ngram(
    tokens: np.ndarray,  # tokens: [N] int32, the request's prompt and outputs
    min_n: int,
    max_n: int,
    k: int,
) -> np.ndarray:  # -> [<= k] int32
    """Prompt lookup, with vLLM's semantics: the longest n-gram (min_n <= n <= max_n) that ends the
    tokens and occurs earlier in them, at its earliest occurrence among the longest; up to k of the
    tokens that followed it. Empty when none matches.

    Vectorised over the candidate ends: O(N * max_n) numpy work, microseconds for a few thousand
    tokens (vLLM runs a KMP pass under numba for the same answer)."""
    total = len(tokens)
    if total < min_n + 1 or k <= 0:
        return tokens[:0]
    # An earlier occurrence of the n-gram ends before the last token.
    ends, length = _match_lengths(tokens, tokens, max_n, before=total - 1)
    best = int(length.max(initial=0))
    if best < min_n:
        return tokens[:0]
    end = int(ends[np.argmax(length == best)])  # the earliest of the longest
    return tokens[end + 1 : end + 1 + k]


def propose_suffix(
    haystack: np.ndarray,  # [H] int32: tokens to look in, -1 between separate sequences
    context: np.ndarray,  # [N] int32: the request's tokens, whose continuation is proposed
    k: int,
    params: SuffixParams,
    before: int | None = None,  # occurrences end before this (the context itself: N - 1)
) -> tuple[np.ndarray, float]:  # ([<= k] int32 drafts, their expected accepted count)
    """SuffixDecoding (Oliaro et al., arXiv 2411.04975; Arctic Inference): the longest suffix of
    the context found in the haystack picks the occurrences to follow; from there each draft is
    the most frequent next token among the occurrences still matching, with probability its share
    of them, times the drafts' before it. Drafting stops below min_token_prob, at
    max_spec_factor times the match's length, or at the tree depth.

    The suffix tree's counts are the occurrence counts computed here on demand (numpy over the
    haystack, no tree kept): the same proposal, at O(H * depth) per call."""
    if len(context) == 0 or k <= 0 or len(haystack) == 0:
        return context[:0], 0.0
    ends, length = _match_lengths(haystack, context, params.max_tree_depth - 1, before)
    best = int(length.max(initial=0))
    if best == 0:
        return context[:0], 0.0
    room = min(k, int(params.max_spec_factor * best), params.max_tree_depth - best)
    at = ends[length == best]  # occurrences of the longest match, by where they end
    drafts: list[int] = []
    probability, expected = 1.0, 0.0
    while len(drafts) < room:
        at = at[at + 1 < len(haystack)]
        following = haystack[at + 1]
        following = following[following >= 0]
        if not len(following):
            break
        values, counts = np.unique(following, return_counts=True)
        pick = int(np.argmax(counts))
        probability *= counts[pick] / len(at)
        if probability < params.min_token_prob:
            break
        token = int(values[pick])
        drafts.append(token)
        expected += probability
        at = at[haystack[at + 1] == token] + 1
    return np.asarray(drafts, np.int32), expected


def propose(
    spec: SpeculativeConfig,
    tokens: np.ndarray,  # [N] int32: the request's prompt and outputs
    room: int,  # drafts at most
    suffix_cache: SuffixCache | None = None,  # recent outputs, for suffix decoding
) -> np.ndarray:  # -> [<= room] int32
    """A model-free method's proposal for the tokens after `tokens` (what schedule drafts, and
    what `pipeline-bench spec --ceiling` replays): prompt lookup for ngram; for suffix, the
    better of what the request's own tokens and what recent outputs propose."""
    if room <= 0:
        return tokens[:0]
    if spec.suffix is None:
        return propose_ngram(tokens, spec.prompt_lookup_min, spec.prompt_lookup_max, room)
    own, own_score = propose_suffix(tokens, tokens, room, spec.suffix, before=len(tokens) - 1)
    if suffix_cache is None or not len(suffix_cache.tokens):
        return own
    past, past_score = propose_suffix(suffix_cache.tokens, tokens, room, spec.suffix)
    return past if past_score > own_score else own


class SuffixCache:
    """The outputs of recent requests, for suffix decoding to look in beside a request's own
    tokens: FIFO, at most `max_cached_requests`, kept as one array with -1 between outputs."""

    def __init__(self, max_cached_requests: int) -> None:
        self.max_cached_requests = max_cached_requests
        self._outputs: list[np.ndarray] = []
        self._joined: np.ndarray | None = np.zeros(0, np.int32)

    def add(self, output_ids: list[int]) -> None:
        if self.max_cached_requests <= 0 or not output_ids:
            return
        self._outputs.append(np.asarray(output_ids, np.int32))
        if len(self._outputs) > self.max_cached_requests:
            del self._outputs[0]
        self._joined = None

    @property
    def tokens(self) -> np.ndarray:  # [H] int32, outputs separated by -1
        if self._joined is None:
            pieces = []
            for output in self._outputs:
                pieces += [output, np.full(1, -1, np.int32)]
            self._joined = np.concatenate(pieces) if pieces else np.zeros(0, np.int32)
        return self._joined
