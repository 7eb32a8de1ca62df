"""Speculative decoding's configuration: vLLM's `--speculative-config` JSON, read once in the server
and passed to the stages. The proposers that use it are in stages/speculation.py (n-gram and
suffix, in schedule) and gpu/drafter.py (a draft model, in execute).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

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
    def drafts_with_a_model(self) -> bool:
        """Drafts come from a draft model (in the runner), not from a model-free proposer."""
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
