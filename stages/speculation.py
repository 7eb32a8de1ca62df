"""Speculative decoding's configuration (vLLM's `--speculative-config` JSON) and its model-free
proposer: prompt lookup (vLLM's `ngram`), which schedule runs on each request's known tokens.

Execute verifies the drafts (gpu/sampler.py `verify`): a step checks 1 + k positions of a request
at once, and every token it emits is distributed exactly as plain decoding's would be.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

# The acceptance counters have a slot per draft position: speculation deeper than this is refused.
MAX_SPECULATIVE_TOKENS = 16
METHODS = ("ngram",)
# vLLM's methods that this server does not run yet: refused by name rather than misread.
_NOT_YET = ("suffix", "draft_model", "eagle", "eagle3", "medusa", "mlp_speculator", "mtp")
_NGRAM_KEYS = {
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "adaptive_draft_length",  # this server's: false drafts every proposal, as vLLM does
}
# vLLM keys that change nothing for a model-free method, accepted so that configs carry over.
_IGNORABLE = {"disable_logprobs", "disable_log_stats"}


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    # Draft only where it pays (stages/draft_policy.py); False: every proposal, up to
    # num_speculative_tokens, whatever the load (vLLM's behaviour, for comparison and tests).
    adaptive_draft_length: bool = True

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
        if method in _NOT_YET:
            raise ValueError(f"speculative method {method!r} is not supported; use 'ngram'")
        if method not in METHODS:
            raise ValueError(f"speculative method {method!r} is unknown; use 'ngram'")
        unknown = set(raw) - _NGRAM_KEYS - _IGNORABLE
        if unknown:
            raise ValueError(f"--speculative-config keys not supported: {sorted(unknown)}")
        k = raw.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}]"
            )
        given_low, given_high = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
        # vLLM's defaults: 5 and 5, or the one given for both.
        low = _positive("prompt_lookup_min", given_low if given_low is not None else given_high)
        high = _positive("prompt_lookup_max", given_high if given_high is not None else given_low)
        if low > high:
            raise ValueError(f"prompt_lookup_min={low} must be <= prompt_lookup_max={high}")
        adaptive = raw.get("adaptive_draft_length", True)
        if not isinstance(adaptive, bool):
            raise ValueError("adaptive_draft_length must be true or false")
        return cls(method, k, low, high, adaptive)


def _positive(name: str, value: object) -> int:
    if value is None:
        return 5
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer")
    return value


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
    # An earlier occurrence of the n-gram ends at `end` < total - 1 where tokens[end] == last.
    ends = np.flatnonzero(tokens[: total - 1] == tokens[total - 1])
    length = np.ones(len(ends), np.int64)
    alive = np.ones(len(ends), bool)
    for back in range(1, max_n):
        at = ends - back
        ok = alive & (at >= 0)
        ok[ok] = tokens[at[ok]] == tokens[total - 1 - back]
        alive = ok
        if not alive.any():
            break
        length += alive
    best = int(length.max(initial=0))
    if best < min_n:
        return tokens[:0]
    end = int(ends[np.argmax(length == best)])  # the earliest of the longest
    return tokens[end + 1 : end + 1 + k]
