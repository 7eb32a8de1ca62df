"""Speculative decoding's configuration (vLLM's `--speculative-config` JSON) and its model-free
proposers, which schedule runs on each request's known tokens: prompt lookup (vLLM's `ngram`) and
SuffixDecoding (vLLM's `suffix`, over the request's tokens and the outputs of recent requests).
A draft model (vLLM's `draft_model`) proposes in execute instead (gpu/drafter.py).

Execute verifies the drafts (gpu/sampler.py `verify`, `rejection_sample`): a step checks 1 + k
positions of a request at once, and every token it emits is distributed exactly as plain
decoding's would be.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

# The acceptance counters have a slot per draft position: speculation deeper than this is refused.
MAX_SPECULATIVE_TOKENS = 16
METHODS = ("ngram", "suffix", "draft_model")
# vLLM's methods that this server does not run yet: refused by name rather than misread.
_NOT_YET = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp")
_COMMON_KEYS = {
    "method",
    "num_speculative_tokens",
    "adaptive_draft_length",  # this server's: false drafts every proposal, as vLLM does
}
_KEYS = {
    "ngram": {"prompt_lookup_min", "prompt_lookup_max"},
    "suffix": {
        "suffix_decoding_max_tree_depth",
        "suffix_decoding_max_cached_requests",
        "suffix_decoding_max_spec_factor",
        "suffix_decoding_min_token_prob",
    },
    # vLLM's draft tensor parallelism: only 1 here (one execute process runs both models).
    "draft_model": {"model", "draft_tensor_parallel_size"},
}
# vLLM keys that change nothing for a model-free method, accepted so that configs carry over.
_IGNORABLE = {"disable_logprobs", "disable_log_stats"}


@dataclass(frozen=True, slots=True)
class SuffixParams:
    """vLLM's `suffix_decoding_*` settings, with its defaults."""

    max_tree_depth: int = 24  # bounds the match plus the speculation
    max_cached_requests: int = 10000  # past outputs looked up (FIFO); 0: the request's own only
    max_spec_factor: float = 1.0  # speculate at most this times the match's length
    min_token_prob: float = 0.1  # stop once the continuation's estimated probability is below


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str  # "ngram", "suffix" or "draft_model"
    num_speculative_tokens: int
    prompt_lookup_min: int = 5  # ngram
    prompt_lookup_max: int = 5
    # Draft only where it pays (stages/draft_policy.py); False: every proposal, up to
    # num_speculative_tokens, whatever the load (vLLM's behaviour, for comparison and tests).
    adaptive_draft_length: bool = True
    suffix: SuffixParams | None = None  # suffix
    # draft_model: the draft's checkpoint (a Hugging Face directory or a GGUF file), with the
    # target's vocabulary; it runs in execute beside the target, on the same block tables.
    model: str | None = None

    @property
    def proposes_in_execute(self) -> bool:
        """Drafts come from a model in execute: schedule reserves their positions only."""
        return self.method == "draft_model"

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """vLLM's JSON; ValueError with the reason for anything it cannot honour."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"--speculative-config is not JSON: {error}") from None
        if not isinstance(raw, dict):
            raise ValueError("--speculative-config must be a JSON object")
        method = raw.get("method")
        if method is None and raw.get("model") in ("ngram", "[ngram]"):  # vLLM's older spelling
            method = "ngram"
            raw = {k: v for k, v in raw.items() if k != "model"}
        if method == "[ngram]":
            method = "ngram"
        if method is None and isinstance(raw.get("model"), str):
            method = "draft_model"  # vLLM's reading of a bare draft model
        if method in _NOT_YET:
            raise ValueError(
                f"speculative method {method!r} is not supported; use 'ngram', 'suffix' or "
                "'draft_model'"
            )
        if method not in METHODS:
            raise ValueError(
                f"speculative method {method!r} is unknown; use 'ngram', 'suffix' or 'draft_model'"
            )
        unknown = set(raw) - _COMMON_KEYS - _KEYS[method] - _IGNORABLE
        if unknown:
            raise ValueError(f"--speculative-config keys not supported: {sorted(unknown)}")
        adaptive = raw.get("adaptive_draft_length", True)
        if not isinstance(adaptive, bool):
            raise ValueError("adaptive_draft_length must be true or false")
        if method == "suffix":
            suffix = _suffix_params(raw)
            # vLLM's default for suffix: the tree depth (capped here at the counters' width)
            k = raw.get(
                "num_speculative_tokens", min(suffix.max_tree_depth, MAX_SPECULATIVE_TOKENS)
            )
            return cls(method, _draft_count(k), adaptive_draft_length=adaptive, suffix=suffix)
        if method == "draft_model":
            return cls(
                method,
                _draft_count(raw.get("num_speculative_tokens")),
                adaptive_draft_length=adaptive,
                model=_draft_model_path(raw),
            )
        given_low, given_high = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
        # vLLM's defaults: 5 and 5, or the one given for both.
        low = _positive("prompt_lookup_min", given_low if given_low is not None else given_high)
        high = _positive("prompt_lookup_max", given_high if given_high is not None else given_low)
        if low > high:
            raise ValueError(f"prompt_lookup_min={low} must be <= prompt_lookup_max={high}")
        return cls(method, _draft_count(raw.get("num_speculative_tokens")), low, high, adaptive)


def _draft_count(k: object) -> int:
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(
            f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}]"
        )
    return k


def _draft_model_path(raw: dict[str, Any]) -> str:
    path = raw.get("model")
    if not isinstance(path, str) or not path:
        raise ValueError('draft_model needs "model": the path of the draft checkpoint')
    if not (os.path.isdir(path) or (os.path.isfile(path) and path.endswith(".gguf"))):
        raise ValueError(
            f"draft model {path!r} is not a model directory or a .gguf file (nothing is downloaded)"
        )
    parallel = raw.get("draft_tensor_parallel_size", 1)
    if parallel != 1 or isinstance(parallel, bool):
        raise ValueError("draft_tensor_parallel_size must be 1")
    return path


def _suffix_params(raw: dict[str, Any]) -> SuffixParams:
    defaults = SuffixParams()
    depth = raw.get("suffix_decoding_max_tree_depth", defaults.max_tree_depth)
    cached = raw.get("suffix_decoding_max_cached_requests", defaults.max_cached_requests)
    factor = raw.get("suffix_decoding_max_spec_factor", defaults.max_spec_factor)
    min_prob = raw.get("suffix_decoding_min_token_prob", defaults.min_token_prob)
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 2:
        raise ValueError("suffix_decoding_max_tree_depth must be an integer of at least 2")
    if not isinstance(cached, int) or isinstance(cached, bool) or cached < 0:
        raise ValueError("suffix_decoding_max_cached_requests must be a non-negative integer")
    if not isinstance(factor, int | float) or isinstance(factor, bool) or factor <= 0:
        raise ValueError("suffix_decoding_max_spec_factor must be a positive number")
    if (
        not isinstance(min_prob, int | float)
        or isinstance(min_prob, bool)
        or not 0 <= min_prob <= 1
    ):
        raise ValueError("suffix_decoding_min_token_prob must be in [0, 1]")
    return SuffixParams(depth, cached, float(factor), float(min_prob))


def _positive(name: str, value: object) -> int:
    if value is None:
        return 5
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer")
    return value


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
