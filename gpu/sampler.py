"""Batched per-request sampling, and the logprobs the OpenAI API returns.

Order, as in vLLM: allowed/banned tokens, min_tokens, logit_bias, then repetition, frequency and
presence penalties; greedy rows (temperature 0) take the argmax there; the others are divided
by their temperature, filtered by top_k, top_p and min_p, and sampled.

Logprobs (sampled token, top-k, ranks, prompt logprobs) are the log_softmax of the model's raw
logits, before any of the above: what the model believes, as OpenAI and vLLM report by default.
A row with vLLM's `logprob_token_ids` gets those tokens' logprobs in place of its top-k. A row
with a forced token (vLLM's thinking_token_budget spent: the end of thinking) takes that token,
with its logprob under the model's distribution.
A request with a seed draws its noise from a generator seeded by (seed, output index), so its
tokens do not depend on which other requests share the batch (nor, with a draft model, on where
drafts were placed: the draft draws with the same noise, `rejection_sample`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from stages.api import SamplingParams

GREEDY_BELOW_TEMPERATURE = 1e-5
_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio multiplier: spreads (seed, step) over the seed space
_SEED_MASK = (1 << 63) - 1


@dataclass(slots=True, frozen=True)
class SamplingArrays:
    """Per-row sampling parameters, one row per sequence that samples this step.

    Id lists are padded with -1. An `allowed_token_ids` row of only -1 allows every token.
    `stop_token_ids` are EOS and the request's stop ids: banned until `min_tokens` outputs exist.
    """

    temperature: np.ndarray  # [S] float32; 0 = greedy
    top_p: np.ndarray  # [S] float32; 1 = off
    top_k: np.ndarray  # [S] int32; <= 0 = off
    min_p: np.ndarray  # [S] float32; 0 = off
    presence_penalty: np.ndarray  # [S] float32; 0 = off
    frequency_penalty: np.ndarray  # [S] float32; 0 = off
    repetition_penalty: np.ndarray  # [S] float32; 1 = off
    seed: np.ndarray  # [S] int64; < 0 = no seed
    min_tokens: np.ndarray  # [S] int32
    num_logprobs: np.ndarray  # [S] int32; < 0 = none, 0 = only the sampled token's
    logit_bias_ids: np.ndarray  # [S, Nb] int32, -1 padded
    logit_bias_values: np.ndarray  # [S, Nb] float32
    allowed_token_ids: np.ndarray  # [S, Na] int32, -1 padded
    bad_token_ids: np.ndarray  # [S, Nx] int32, -1 padded
    stop_token_ids: np.ndarray  # [S, Ns] int32, -1 padded
    # vLLM's logprob_token_ids: the tokens whose logprobs a row reports instead of its top-k (its
    # num_logprobs is their count); a row of only -1 reports its top-k.
    logprob_token_ids: np.ndarray  # [S, Nl] int32, -1 padded
    forced_token_ids: np.ndarray  # [S] int32: the token a row must take; -1 = sample
    # vLLM's bad words of two tokens or more: per row a tuple of token tuples (None: none). A
    # word's last token is banned when the output ends with the rest of it.
    bad_words: np.ndarray  # [S] object
    # Structured outputs: bit t of row r's words allows token t (stages.text.structured); rows without
    # a grammar have every bit set; width 0 when no row has one.
    token_bitmask: np.ndarray  # [S, ceil(V / 32)] int32

    @classmethod
    def defaults(cls, num_rows: int, **overrides: np.ndarray) -> SamplingArrays:
        """Greedy rows with every knob off; `overrides` replace whole fields."""
        greedy = RequestSampling.of(SamplingParams(temperature=0.0), (), ())
        empty_ids = np.full((num_rows, 0), -1, dtype=np.int32)
        fields: dict[str, np.ndarray] = dict(
            **{name: np.repeat(greedy.row[name], num_rows) for name in ROW.names},
            logit_bias_ids=empty_ids,
            logit_bias_values=np.zeros((num_rows, 0), np.float32),
            allowed_token_ids=empty_ids,
            bad_token_ids=empty_ids,
            stop_token_ids=empty_ids,
            logprob_token_ids=empty_ids,
            forced_token_ids=np.full(num_rows, -1, np.int32),
            bad_words=np.empty(num_rows, object),
            token_bitmask=np.zeros((num_rows, 0), np.int32),
        )
        fields.update(overrides)
        return cls(**fields)

    def select(self, rows: np.ndarray) -> SamplingArrays:
        """The parameters of `rows` only."""
        return SamplingArrays(**{name: getattr(self, name)[rows] for name in self.__slots__})


# The per-row scalars: (SamplingArrays field, SamplingParams attribute, dtype, what None means).
# A new scalar option is a line here, a SamplingArrays field, and the code that uses it.
SCALARS: tuple[tuple[str, str, type, int | None], ...] = (
    ("temperature", "temperature", np.float32, None),
    ("top_p", "top_p", np.float32, None),
    ("top_k", "top_k", np.int32, None),
    ("min_p", "min_p", np.float32, None),
    ("presence_penalty", "presence_penalty", np.float32, None),
    ("frequency_penalty", "frequency_penalty", np.float32, None),
    ("repetition_penalty", "repetition_penalty", np.float32, None),
    ("seed", "seed", np.int64, -1),
    ("min_tokens", "min_tokens", np.int32, None),
    ("num_logprobs", "logprobs", np.int32, -1),
)
ROW = np.dtype([(name, dtype) for name, _, dtype, _ in SCALARS])
_NO_IDS = np.zeros(0, np.int32)


@dataclass(slots=True, frozen=True)
class RequestSampling:
    """One request's parameters as the sampler gathers them, built once when the request arrives."""

    row: np.ndarray  # [1] ROW
    prompt_logprobs: int  # top-k of prompt logprobs wanted; < 0 = none
    logit_bias_ids: np.ndarray  # [Nb] int32
    logit_bias_values: np.ndarray  # [Nb] float32
    allowed_token_ids: np.ndarray  # [Na] int32; empty = every token
    stop_token_ids: np.ndarray  # [Ns] int32
    bad_token_ids: np.ndarray  # [Nx] int32: bad words of one token, banned outright
    bad_words: tuple[tuple[int, ...], ...] | None  # longer bad words, banned at their last token
    logprob_token_ids: np.ndarray  # [Nl] int32; empty = the top-k

    @classmethod
    def of(
        cls,
        params: SamplingParams,
        stop_token_ids: Sequence[int],  # the request's and EOS, as render resolved them
        bad_words: Sequence[tuple[int, ...]],  # token sequences
    ) -> RequestSampling:
        row = np.zeros(1, ROW)
        for name, attribute, _, none in SCALARS:
            value = getattr(params, attribute)
            if value is None:
                value = none
            elif name == "seed":
                value &= _SEED_MASK  # any client seed, negative or past int64, is a seed
            row[name] = value
        bias = params.logit_bias or {}
        return cls(
            row=row,
            prompt_logprobs=-1 if params.prompt_logprobs is None else params.prompt_logprobs,
            logit_bias_ids=np.fromiter(bias.keys(), np.int32, len(bias)),
            logit_bias_values=np.fromiter(bias.values(), np.float32, len(bias)),
            allowed_token_ids=np.asarray(params.allowed_token_ids or (), np.int32),
            stop_token_ids=np.asarray(stop_token_ids, np.int32),
            bad_token_ids=np.array([w[0] for w in bad_words if len(w) == 1], np.int32),
            bad_words=tuple(w for w in bad_words if len(w) > 1) or None,
            logprob_token_ids=np.asarray(params.logprob_token_ids or (), np.int32),
        )

    @property
    def has_bad_words(self) -> bool:
        return bool(len(self.bad_token_ids)) or self.bad_words is not None


def gather(
    requests: Sequence[RequestSampling],
    token_bitmask: np.ndarray,  # [S, W] int32, or width 0 when no row has a grammar
    with_bad_words: bool = True,  # False: no row has bad words (their arrays are skipped)
    forced_token_ids: np.ndarray | None = None,  # [S] int32, -1 = sample; None: no row forced
) -> SamplingArrays:
    """The step's rows, one per request in batch order."""
    rows = np.concatenate([r.row for r in requests]) if requests else np.zeros(0, ROW)
    count = len(requests)
    return SamplingArrays(
        **{name: rows[name] for name in ROW.names},
        logit_bias_ids=_padded([r.logit_bias_ids for r in requests], np.int32, -1),
        logit_bias_values=_padded([r.logit_bias_values for r in requests], np.float32, 0.0),
        allowed_token_ids=_padded([r.allowed_token_ids for r in requests], np.int32, -1),
        bad_token_ids=_padded([r.bad_token_ids for r in requests], np.int32, -1)
        if with_bad_words
        else np.zeros((count, 0), np.int32),
        bad_words=_objects([r.bad_words for r in requests])
        if with_bad_words
        else np.empty(count, object),
        stop_token_ids=_padded([r.stop_token_ids for r in requests], np.int32, -1),
        logprob_token_ids=_padded([r.logprob_token_ids for r in requests], np.int32, -1),
        forced_token_ids=np.full(count, -1, np.int32)
        if forced_token_ids is None
        else forced_token_ids,
        token_bitmask=token_bitmask,
    )


def _objects(items: list[tuple[tuple[int, ...], ...] | None]) -> np.ndarray:  # -> [S] object
    out = np.empty(len(items), object)
    for i, item in enumerate(items):
        out[i] = item
    return out


def _padded(rows: list[np.ndarray], dtype: type, fill: float) -> np.ndarray:  # -> [S, max len]
    width = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), width), fill, dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


@dataclass(slots=True, frozen=True)
class TokenHistory:
    """One sequence's tokens so far: the count for min_tokens and seeding, the ids for penalties.

    The id arrays may be left empty for a row that uses no penalty.
    """

    num_outputs: int
    prompt_ids: np.ndarray  # [P] int64
    output_ids: np.ndarray  # [O] int64

    @classmethod
    def of(cls, prompt_ids: list[int], output_ids: list[int]) -> TokenHistory:
        return cls(
            len(output_ids), np.asarray(prompt_ids, np.int64), np.asarray(output_ids, np.int64)
        )


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:  # [S, V] -> [S] int64
    """Each row's argmax (the first, on ties). On the CPU through numpy, whose argmax is
    vectorised: torch's took 58 us a row of SmolLM2's 49,152 logits and 544 us for 8 (one
    thread), numpy's 4.5 and 26."""
    if logits.device.type == "cpu":
        return torch.from_numpy(logits.detach().numpy().argmax(1))
    return logits.argmax(1)


def rows_needing_token_ids(params: SamplingArrays) -> np.ndarray:  # -> [S] bool
    """Rows whose penalties read the prompt and output ids in their TokenHistory."""
    return (
        (params.repetition_penalty != 1.0)
        | (params.frequency_penalty != 0.0)
        | (params.presence_penalty != 0.0)
        | np.not_equal(params.bad_words, None)
    )


@dataclass(slots=True, frozen=True)
class SampleOutput:
    token_ids: torch.Tensor  # [S] int64
    logprobs: torch.Tensor  # [S] float32, raw-distribution logprob of the sampled token
    ranks: torch.Tensor  # [S] int64, 1 = the most likely token
    top_ids: torch.Tensor  # [S, K] int64, K = max num_logprobs (0 when none asked)
    top_logprobs: torch.Tensor  # [S, K] float32
    # [S, V] float32, with keep_probs: the distribution each row was sampled from (every knob
    # applied; one-hot for greedy and forced rows); else None
    probs: torch.Tensor | None = None


# Tokens per block of inverse_cdf's first running sum (49152 and 128256 are multiples of it)
INVERSE_CDF_BLOCK = 256


def open_uniforms(
    count: int, device: torch.device, generator: torch.Generator | None
) -> torch.Tensor:  # -> [count] float64 in (0, 1]
    return 1.0 - torch.rand(count, dtype=torch.float64, generator=generator, device=device)


def inverse_cdf(
    weights: torch.Tensor,  # [R, V] nonnegative, each row's (unnormalised) distribution
    uniforms: torch.Tensor,  # [R] float64 in (0, 1]
) -> torch.Tensor:  # -> [R] int64
    """Each row's token at its uniform on the cumulative distribution: one draw a row, where an
    exponential race (argmax p / E) draws one per token of the vocabulary (on CPU 30 ms for 32
    rows of 49k). The running sum is taken over blocks of INVERSE_CDF_BLOCK tokens first, then
    within the one block the draw falls in: the first token whose running weight reaches
    u * total has weight > 0 for any u in (0, 1], so a masked token (weight 0) is never drawn.
    Two distributions read at the same uniform give the same token wherever they agree (the
    coupling seeded drafts rely on)."""
    rows, vocab = weights.shape
    block = INVERSE_CDF_BLOCK
    num_blocks = -(-vocab // block)
    if num_blocks * block != vocab:
        weights = torch.nn.functional.pad(weights, (0, num_blocks * block - vocab))
    tiles = weights.view(rows, num_blocks, block)
    cdf = tiles.sum(-1).double().cumsum(1)  # [R, blocks]
    target = (uniforms * cdf[:, -1]).unsqueeze(1)
    chosen = torch.searchsorted(cdf, target, side="left").clamp_(max=num_blocks - 1)  # [R, 1]
    before = cdf.gather(1, (chosen - 1).clamp(min=0)).masked_fill_(chosen == 0, 0.0)
    inner = tiles[torch.arange(rows, device=weights.device), chosen.squeeze(1)]  # [R, block]
    at = torch.searchsorted(before + inner.double().cumsum(1), target, side="left").squeeze(1)
    # A block's float32 sum and its float64 running sum may differ by rounding: a draw past the
    # running sum's end takes the block's last token with weight.
    positions = torch.arange(block, device=weights.device)
    last = torch.where(inner > 0, positions, -1).amax(dim=1)
    return chosen.squeeze(1) * block + torch.minimum(at, last)


def seeded_generator(
    seed: int, output_index: int, device: torch.device | str = "cpu"
) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * _SEED_MIX + output_index) & _SEED_MASK)
    return generator


def logprob_summary(
    logprobs: torch.Tensor,  # logprobs: [S, V] float32, log_softmax of raw logits
    token_ids: torch.Tensor,  # token_ids: [S] int64
    num_top: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob of token_ids [S], their ranks [S], top ids [S, K], top logprobs [S, K])."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    ranks = (logprobs > chosen.unsqueeze(1)).sum(dim=1) + 1
    top_logprobs, top_ids = (
        logprobs.topk(num_top, dim=1)
        if num_top > 0
        else (
            logprobs.new_zeros((logprobs.shape[0], 0)),
            token_ids.new_zeros((logprobs.shape[0], 0)),
        )
    )
    return chosen, ranks, top_ids, top_logprobs


def _on(values: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """A host array as a tensor on `like`'s device (the logits': the host, or a GPU)."""
    return torch.from_numpy(values).to(like.device)


def _id_mask(ids: np.ndarray, like: torch.Tensor) -> torch.Tensor:  # ids: [S, N] -> [S, V] bool
    vocab_size = like.shape[1]
    mask = torch.zeros((ids.shape[0], vocab_size), dtype=torch.bool, device=like.device)
    rows, cols = np.nonzero((ids >= 0) & (ids < vocab_size))
    mask[_on(rows, like), _on(ids[rows, cols].astype(np.int64), like)] = True
    return mask


def _bitmask(words: np.ndarray, like: torch.Tensor) -> torch.Tensor:  # [S, W] int32 -> [S, V] bool
    vocab_size = like.shape[1]
    bits = np.unpackbits(np.ascontiguousarray(words).view(np.uint8), axis=1, bitorder="little")
    if bits.shape[1] < vocab_size:  # tokens past the mask's width are not allowed
        bits = np.pad(bits, ((0, 0), (0, vocab_size - bits.shape[1])))
    return _on(np.ascontiguousarray(bits[:, :vocab_size]).view(np.bool_), like)


def _apply_token_rules(
    logits: torch.Tensor, params: SamplingArrays, history: Sequence[TokenHistory]
) -> None:
    vocab_size = logits.shape[1]
    if params.token_bitmask.shape[1]:
        logits.masked_fill_(~_bitmask(params.token_bitmask, logits), float("-inf"))
    if params.allowed_token_ids.size and (params.allowed_token_ids >= 0).any():
        allowed = _id_mask(params.allowed_token_ids, logits)
        restricted = allowed.any(dim=1, keepdim=True)
        logits.masked_fill_(restricted & ~allowed, float("-inf"))
    if params.bad_token_ids.size and (params.bad_token_ids >= 0).any():
        logits.masked_fill_(_id_mask(params.bad_token_ids, logits), float("-inf"))
    for row in np.flatnonzero(np.not_equal(params.bad_words, None)).tolist():
        output = history[row].output_ids.tolist()
        for word in params.bad_words[row]:
            head = len(word) - 1
            ends_with_head = (
                len(output) >= head and tuple(output[len(output) - head :]) == word[:-1]
            )
            if ends_with_head and 0 <= word[-1] < vocab_size:
                logits[row, word[-1]] = float("-inf")
    num_outputs = np.array([h.num_outputs for h in history], dtype=np.int64)
    too_short = num_outputs < params.min_tokens
    if too_short.any() and params.stop_token_ids.size:
        stop = _id_mask(np.where(too_short[:, None], params.stop_token_ids, -1), logits)
        logits.masked_fill_(stop, float("-inf"))
    if params.logit_bias_ids.size and (params.logit_bias_ids >= 0).any():
        rows, cols = np.nonzero((params.logit_bias_ids >= 0) & (params.logit_bias_ids < vocab_size))
        ids = _on(params.logit_bias_ids[rows, cols].astype(np.int64), logits)
        bias = _on(params.logit_bias_values[rows, cols].astype(np.float32), logits)
        logits.index_put_((_on(rows, logits), ids), bias, accumulate=True)


def _apply_penalties(
    logits: torch.Tensor, params: SamplingArrays, history: Sequence[TokenHistory]
) -> None:
    """Repetition (CTRL/HF: over prompt and output), frequency and presence (OpenAI: output only)."""
    vocab_size = logits.shape[1]
    repetition = params.repetition_penalty != 1.0
    additive = (params.frequency_penalty != 0.0) | (params.presence_penalty != 0.0)
    for row in np.nonzero(rows_needing_token_ids(params))[0].tolist():
        output = _on(history[row].output_ids.astype(np.int64), logits)
        counts = torch.bincount(output, minlength=vocab_size)[:vocab_size].float()
        if repetition[row]:
            prompt = _on(history[row].prompt_ids.astype(np.int64), logits)
            seen = torch.zeros(vocab_size, dtype=torch.bool, device=logits.device)
            seen[prompt[prompt < vocab_size]] = True
            seen |= counts > 0
            penalty = float(params.repetition_penalty[row])
            values = logits[row]
            logits[row] = torch.where(
                seen, torch.where(values > 0, values / penalty, values * penalty), values
            )
        if additive[row]:
            logits[row] -= float(params.frequency_penalty[row]) * counts
            logits[row] -= float(params.presence_penalty[row]) * (counts > 0).float()


def _filter_top_k_top_p_min_p(logits: torch.Tensor, params: SamplingArrays) -> None:
    """Set to -inf what top_k, top_p and min_p exclude; the most likely token always stays."""
    # Which filters apply is read on the host: on a GPU a test of device values would wait for
    # every kernel queued before it.
    if (params.min_p > 0).any():
        min_p = _on(params.min_p.astype(np.float32), logits)
        probs = torch.softmax(logits, dim=1)
        threshold = min_p.unsqueeze(1) * probs.max(dim=1, keepdim=True).values
        logits.masked_fill_(probs < threshold, float("-inf"))
    if not ((params.top_k > 0).any() or (params.top_p < 1.0).any()):
        return
    top_k = _on(params.top_k.astype(np.int64), logits)
    top_p = _on(params.top_p.astype(np.float32), logits)
    use_k = top_k > 0
    use_p = top_p < 1.0
    sorted_logits, order = logits.sort(dim=1, descending=True)
    ranks = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
    drop = use_k.unsqueeze(1) & (ranks >= top_k.unsqueeze(1))
    sorted_logits.masked_fill_(drop, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=1)
    mass_before = sorted_probs.cumsum(dim=1) - sorted_probs
    drop |= use_p.unsqueeze(1) & (mass_before >= top_p.unsqueeze(1))
    drop[:, 0] = False
    logits.scatter_(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def sample(
    logits: torch.Tensor,  # logits: [S, V] float32, raw model output
    params: SamplingArrays,
    history: Sequence[TokenHistory],
    generator: torch.Generator | None = None,
    keep_probs: bool = False,
    owned: bool = False,
) -> SampleOutput:
    """One token per row. `generator` drives rows without a seed. Logprobs are computed for the
    rows that asked for them (num_logprobs >= 0); other rows get nan and rank 0. Everything runs
    on the logits' device (`generator` and the outputs are there too). `keep_probs` also returns
    each row's distribution. `owned`: the caller no longer needs `logits`, which the knobs may
    then change in place instead of in a copy."""
    wanted = np.flatnonzero(params.num_logprobs >= 0)
    raw_logprobs = torch.log_softmax(logits[_on(wanted, logits)].float(), dim=1)
    logits = logits.float() if owned else logits.float().clone()
    _apply_token_rules(logits, params, history)
    _apply_penalties(logits, params, history)

    temperature = _on(params.temperature.astype(np.float32), logits)
    rows_np = np.flatnonzero(params.temperature >= GREEDY_BELOW_TEMPERATURE)
    all_random = len(rows_np) == len(logits)
    # every row sampled: no argmax, and the rows are scaled where they are (this is our copy)
    token_ids = (
        logits.new_zeros(len(logits), dtype=torch.int64) if all_random else argmax_rows(logits)
    )
    random_rows = _on(rows_np, logits)
    probs = None
    if len(rows_np):
        if all_random:
            scaled = logits.div_(temperature.unsqueeze(1))
        else:
            scaled = logits[random_rows] / temperature[random_rows].unsqueeze(1)
        _filter_top_k_top_p_min_p(scaled, params.select(rows_np))
        probs = torch.softmax(scaled, dim=1)
        uniforms = torch.empty(len(rows_np), dtype=torch.float64, device=logits.device)
        seeds = params.seed[rows_np]
        unseeded = np.flatnonzero(seeds < 0)
        if len(unseeded):  # one draw for them all: on a GPU one kernel, not one per row
            uniforms[_on(unseeded, logits)] = open_uniforms(len(unseeded), logits.device, generator)
        for i in np.flatnonzero(seeds >= 0).tolist():
            row = int(rows_np[i])
            row_generator = seeded_generator(int(seeds[i]), history[row].num_outputs, logits.device)
            uniforms[i] = open_uniforms(1, logits.device, row_generator)[0]
        token_ids[random_rows] = inverse_cdf(probs, uniforms)
    forced = _on(params.forced_token_ids.astype(np.int64), logits)
    token_ids = torch.where(forced >= 0, forced, token_ids)
    distributions = None
    if keep_probs:
        distributions = torch.zeros_like(logits)
        distributions[torch.arange(len(token_ids), device=logits.device), token_ids] = 1.0
        if probs is not None:
            sampled_rows = random_rows[forced[random_rows] < 0]
            distributions[sampled_rows] = probs[forced[random_rows] < 0]

    num_top = max(0, int(params.num_logprobs.max(initial=-1)))
    reported = _logprob_report(raw_logprobs, token_ids, params, wanted, num_top)
    return SampleOutput(token_ids, *reported, distributions)


def _logprob_report(
    raw_logprobs: torch.Tensor,  # [W, V] float32: log_softmax of the wanted rows' raw logits
    token_ids: torch.Tensor,  # [S] int64, every row's token, on raw_logprobs' device
    params: SamplingArrays,  # the S rows' (num_logprobs, logprob_token_ids)
    wanted: np.ndarray,  # [W] int64, the rows that asked for logprobs
    num_top: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprobs [S], ranks [S], top ids [S, K], top logprobs [S, K]) of the rows' tokens; rows
    that asked for none get nan, rank 0 and no top-k."""
    rows = len(token_ids)
    device = token_ids.device
    chosen = torch.full((rows,), float("nan"), device=device)
    ranks = torch.zeros(rows, dtype=torch.int64, device=device)
    top_ids = torch.full((rows, num_top), -1, dtype=torch.int64, device=device)
    top_logprobs = torch.full((rows, num_top), float("-inf"), device=device)
    if len(wanted):
        index = _on(wanted, token_ids)
        chosen[index], ranks[index], top_ids[index], top_logprobs[index] = logprob_summary(
            raw_logprobs, token_ids[index], num_top
        )
        _report_given_ids(
            raw_logprobs, params.logprob_token_ids[wanted], wanted, top_ids, top_logprobs
        )
    return chosen, ranks, top_ids, top_logprobs


def token_logprobs(
    logits: torch.Tensor,  # logits: [S, V] float32, raw model output
    token_ids: torch.Tensor,  # token_ids: [S] int64
    params: SamplingArrays,  # the S rows' (num_logprobs, logprob_token_ids)
    num_top: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What `sample` reports for rows that took `token_ids` (rows that asked for no logprobs
    get nan, rank 0 and no top-k): (logprobs [S], ranks [S], top ids [S, K], top logprobs)."""
    wanted = np.flatnonzero(params.num_logprobs >= 0)
    raw_logprobs = torch.log_softmax(logits[_on(wanted, logits)].float(), dim=1)
    return _logprob_report(raw_logprobs, token_ids.to(logits.device), params, wanted, num_top)


def rejection_sample(
    target_probs: torch.Tensor,  # [S', V] float32: p at each verified position (sample's probs)
    sampled: np.ndarray,  # [S'] int64: the target's plain sample at each position; in place, the
    # token emitted there (an accepted draft, a residual sample, or the bonus: that sample)
    draft_probs: torch.Tensor,  # [S', V] float32: q of the draft that follows each position
    drafts: np.ndarray,  # [S'] int64: that draft (unused at a row's last position)
    per_row: np.ndarray,  # [S] positions of each row (1 + its drafts), in order
    seeded: np.ndarray,  # [S'] bool: the draft drew with the target's noise there (a seeded row)
    generator: torch.Generator | None,  # the acceptance and residual draws of the other rows
) -> np.ndarray:  # -> [S] int64, drafts accepted per row
    """Leviathan et al.'s speculative sampling for drafts a model sampled from q (vLLM's
    rejection sampler): draft x is accepted with probability min(1, p(x) / q(x)); at the first
    rejection the emitted token is drawn from norm(max(p - q, 0)) instead of `sampled`; when all
    are accepted the last position's `sampled` is the bonus token. Greedy rows have one-hot p
    and q, so they accept while the draft is the target's argmax and then emit that argmax.

    A seeded row's draft was drawn at the very uniform u of the target's sample there (q's and
    p's cumulative distributions read at the u of its (seed, output index)): a coupling of q
    and p (the same token wherever q is p), so the draft is accepted when it equals that
    sample, and every token emitted is plain decoding's own. Its text then does not depend on where drafts
    were placed (the load, a preemption, a recovery): it is the text the seed gives unspeculated."""
    accepted = np.zeros(len(per_row), dtype=np.int64)
    start = 0
    for row, count in enumerate(per_row.tolist()):
        accepted[row] = count - 1
        for at in range(start, start + count - 1):
            draft = int(drafts[at])
            if seeded[at]:
                if int(sampled[at]) == draft:
                    continue
                accepted[row] = at - start
                break
            p, q = target_probs[at], draft_probs[at]
            if float(torch.rand((), generator=generator, device=p.device)) * float(
                q[draft]
            ) < float(p[draft]):
                sampled[at] = draft  # emitted as drafted (the target's own sample is not)
                continue
            residual = (p - q).clamp_(min=0.0)
            if float(residual.sum()) <= 0.0:  # p and q equal up to rounding: p itself
                residual = p.clone()
            draw = open_uniforms(1, residual.device, generator)
            sampled[at] = int(inverse_cdf(residual.unsqueeze(0), draw)[0])
            accepted[row] = at - start
            break
        start += count
    return accepted


def verify(
    sampled: np.ndarray,  # sampled: [S'] int64, the token sampled at each verified position
    drafts: np.ndarray,  # drafts: [S'] int64, the draft that followed it (unused at a row's last)
    per_row: np.ndarray,  # per_row: [S] positions of each row (1 + its drafts), in order
) -> np.ndarray:  # -> [S] int64, drafts accepted per row
    """Speculative verification for drafts proposed without a model (q one-hot on the draft).

    Each position was sampled from exactly the distribution plain decoding would use there (p,
    with every knob applied and the noise of its (seed, output index)), given the drafts before it.
    Draft x is accepted when it equals that sample: that happens with probability p(x) =
    min(1, p(x) / q(x)), Leviathan et al.'s acceptance for q one-hot at x, and on rejection the
    sample emitted is p conditioned on not being x, which is their residual norm(max(p - q, 0)).
    When every draft is accepted the last position's sample is the bonus token. So every emitted
    token has plain decoding's distribution, and a greedy or seeded row emits plain decoding's
    very tokens.
    """
    accepted = np.zeros(len(per_row), dtype=np.int64)
    start = 0
    for row, count in enumerate(per_row.tolist()):
        matches = sampled[start : start + count - 1] == drafts[start : start + count - 1]
        accepted[row] = count - 1 if matches.all() else int(np.argmin(matches))
        start += count
    return accepted


def _report_given_ids(
    raw_logprobs: torch.Tensor,  # [W, V] float32, the rows that want logprobs
    given: np.ndarray,  # [W, Nl] int32, -1 padded: each row's logprob_token_ids
    wanted: np.ndarray,  # [W] int64: those rows' indices in the batch
    top_ids: torch.Tensor,  # [S, K] int64, K >= Nl where a row has ids (its num_logprobs)
    top_logprobs: torch.Tensor,  # [S, K] float32
) -> None:
    """In place of their top-k, the rows with logprob_token_ids report exactly those tokens."""
    for w in np.flatnonzero((given >= 0).any(axis=1)) if given.shape[1] else ():
        ids = _on(given[w][given[w] >= 0].astype(np.int64), raw_logprobs)
        row = int(wanted[w])
        top_ids[row, : len(ids)] = ids
        top_logprobs[row, : len(ids)] = raw_logprobs[w, ids]
