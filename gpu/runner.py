"""ModelRunner: the model, its paged KV cache and the sampler behind one `step(batch)` call.

The execute stage fills a `StepBatch` of numpy arrays from its ring and gets a `StepOutput` of
numpy arrays back. The runner remembers, per request id, the tokens it has seen (for penalties,
min_tokens and seeds) from the first step that names the request until `free`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import structlog
import torch

from gpu.attention import AttentionInputs
from gpu.backends import NATIVE_KERNELS, kernels_for
from gpu.kv_cache import DEFAULT_BLOCK_SIZE, KVCache
from gpu.loader import iter_weights, read_gguf_raw_tensors
from gpu.model import CausalLM
from gpu.quantize import QUANTIZATION_MODES, quantize_linears
from gpu.sampler import (
    SamplingArrays,
    TokenHistory,
    logprob_summary,
    rows_needing_token_ids,
    sample,
    verify,
)
from stages.text.checkpoint import ModelConfig, load_model_config, resolve_kv_cache_dtype

log = structlog.get_logger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NO_IDS = np.zeros(0, dtype=np.int64)


@dataclass(slots=True, frozen=True)
class RunnerConfig:
    dtype: str = "float32"  # float32, bfloat16 or float16: weights, activations and KV cache
    kv_cache_bytes: int = 256 * 1024 * 1024
    block_size: int = DEFAULT_BLOCK_SIZE
    threads: int = 0  # torch intra-op threads; 0 keeps torch's default
    device: str = "cpu"
    seed: int = 0  # drives requests that carry no seed of their own
    quantization: str | None = None  # None, "int8" or "int4": weight-only, decoder linears
    quantized_compute_dtype: str = "bfloat16"  # what the quantized matmuls compute in
    # Inputs with more rows than this use a dense bf16 copy (faster once compute-bound); None:
    # quantized matmuls for every input; "auto": 1024 on the native many-row int4 kernel (on this
    # CPU it is 1.2-1.8x faster than dense bf16 from 32 to 512 rows), 8 on torch's packed ones.
    quantized_max_rows: int | str | None = "auto"
    # The C kernels of gpu/native on CPU (norms, RoPE + KV write, decode attention, GGUF-format
    # quantized matmuls with int8 activations); None: wherever they build. False: torch only.
    native_kernels: bool | None = None
    kv_cache_dtype: str = "auto"  # see stages.text.checkpoint.resolve_kv_cache_dtype


@dataclass(slots=True, frozen=True)
class StepBatch:
    """One engine step: B sequences, T new tokens in all, flattened in sequence order."""

    request_ids: np.ndarray  # [B] int64
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [B + 1] int32, cumulative query lengths
    context_lens: np.ndarray  # [B] int32, KV length after this step (cached + new)
    block_tables: np.ndarray  # [B, max_blocks] int32, padded
    slot_mapping: np.ndarray  # [T] int64, block * block_size + offset
    prompt_lens: np.ndarray  # [B] int32, positions below this are prompt, the rest output
    sample: np.ndarray  # [B] bool, False for a prefill chunk that is not the prompt's last
    sampling: SamplingArrays  # B rows; rows that do not sample are ignored
    prompt_logprobs: np.ndarray  # [B] int32, top-k of prompt logprobs wanted; < 0 = none
    # [B] int32: a sampling row's last num_draft input tokens are drafts to verify (speculative
    # decoding); None: no row has any
    num_draft: np.ndarray | None = None
    # [S', ceil(V / 32)] int32: with drafts and a grammar, the structured-output mask of each
    # verified position (sampling rows in order, 1 + num_draft each); None: each row's own
    draft_bitmask: np.ndarray | None = None


@dataclass(slots=True, frozen=True)
class StepOutput:
    """Per-sequence results in batch order, and the prompt logprobs of prefill chunks.

    Each sequence has `num_tokens[b]` entries in the token arrays, in order: one (-1 where it did
    not sample), or 1 + the drafts it accepted where it verified drafts. Without drafts N == B.
    Top-k rows are padded with id -1 and logprob -inf past what each request asked for. Prompt
    logprob entries of sequence b are rows prompt_logprob_start_loc[b]:[b + 1]; each scores the
    prompt token at `prompt_positions` (position 0 has none).
    """

    num_tokens: np.ndarray  # [B] int32
    token_ids: np.ndarray  # [N] int64, -1 where not sampled
    logprobs: np.ndarray  # [N] float32, nan where not sampled
    ranks: np.ndarray  # [N] int64, 0 where not sampled
    top_ids: np.ndarray  # [N, K] int64
    top_logprobs: np.ndarray  # [N, K] float32
    prompt_logprob_start_loc: np.ndarray  # [B + 1] int32
    prompt_positions: np.ndarray  # [P] int64
    prompt_token_ids: np.ndarray  # [P] int64
    prompt_token_logprobs: np.ndarray  # [P] float32
    prompt_ranks: np.ndarray  # [P] int64
    prompt_top_ids: np.ndarray  # [P, Kp] int64
    prompt_top_logprobs: np.ndarray  # [P, Kp] float32


@dataclass(slots=True)
class _RequestState:
    token_ids: list[int] = field(default_factory=list)  # by position; prompt, then outputs
    pending_prompt_logprobs: torch.Tensor | None = None  # [V]: scores the next chunk's first token


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        config: RunnerConfig,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.config = config
        self.device = torch.device(config.device)
        self.generator = torch.Generator().manual_seed(config.seed)
        self._requests: dict[int, _RequestState] = {}

    @classmethod
    def from_path(cls, model_path: str, config: RunnerConfig) -> ModelRunner:
        if config.dtype not in _DTYPES:
            raise ValueError(
                f"dtype {config.dtype!r} is not supported; use one of {sorted(_DTYPES)}"
            )
        if config.quantization not in (None, *QUANTIZATION_MODES):
            raise ValueError(
                f"quantization {config.quantization!r} is not supported; use None or one of {QUANTIZATION_MODES}"
            )
        if config.threads > 0:
            torch.set_num_threads(config.threads)
        dtype = _DTYPES[config.dtype]
        model_config = load_model_config(model_path)
        model = CausalLM(model_config, kernels_for(config.device, config.native_kernels))
        model.load_weights(iter_weights(model_path, model_config, dtype))
        model = model.to(dtype=dtype).eval()
        model.inv_freq = model.inv_freq.float()
        if config.quantization is not None:
            is_gguf = model_path.endswith(".gguf")
            raw = {}
            if is_gguf:
                for ggml_type in ("Q4_1", "Q8_0"):
                    raw.update(read_gguf_raw_tensors(model_path, model_config, ggml_type))
            use_native = model.kernels is NATIVE_KERNELS  # kernels_for made the choice
            max_rows = config.quantized_max_rows
            if max_rows == "auto":
                # The native Q4 kernels serve every batch (int8 activations, llama.cpp's
                # arithmetic), so a row's logits do not depend on how many rows share its step
                # (a prefix-cache hit computes a prompt's tail as a short chunk).
                many = use_native and config.quantization == "int4"
                max_rows = 1024 if many else 8
            quantize_linears(
                model,
                config.quantization,
                raw,
                _DTYPES[config.quantized_compute_dtype],
                max_rows,
                use_native=use_native,
            )
        model = model.to(device=config.device)
        return cls.from_model(model, config)

    @classmethod
    def from_model(cls, model: CausalLM, config: RunnerConfig) -> ModelRunner:
        """A runner on a model already prepared (from_path's, or gpu/prepared.py's)."""
        model_config = model.config
        kv_cache = KVCache.from_budget(
            model_config,
            config.kv_cache_bytes,
            config.block_size,
            _DTYPES[
                resolve_kv_cache_dtype(config.kv_cache_dtype, config.dtype, config.quantization)
            ],
            config.device,
        )
        log.info(
            "model ready",
            architecture=model_config.architecture,
            dtype=config.dtype,
            kv_cache_dtype=str(kv_cache.layers[0][0].dtype).removeprefix("torch."),
            kv_blocks=kv_cache.num_blocks,
            block_size=config.block_size,
        )
        return cls(model, kv_cache, config)

    @property
    def model_config(self) -> ModelConfig:
        return self.model.config

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @property
    def tracked_request_ids(self) -> frozenset[int]:
        """Requests whose token history the runner holds (seen and not yet freed)."""
        return frozenset(self._requests)

    def free(self, request_ids: np.ndarray | list[int]) -> None:
        """Forget finished or aborted requests."""
        for request_id in np.asarray(request_ids, dtype=np.int64).tolist():
            self._requests.pop(request_id, None)

    def step(self, batch: StepBatch) -> StepOutput:
        with torch.inference_mode():
            return self._step(batch)

    def _step(self, batch: StepBatch) -> StepOutput:
        starts = batch.query_start_loc.astype(np.int64)
        states = [self._requests.setdefault(int(r), _RequestState()) for r in batch.request_ids]
        for b, state in enumerate(states):
            positions = batch.positions[starts[b] : starts[b + 1]]
            _store(state.token_ids, positions, batch.input_ids[starts[b] : starts[b + 1]])

        samples = np.asarray(batch.sample, dtype=bool)
        num_draft = (
            np.zeros(len(states), np.int64)
            if batch.num_draft is None
            else np.where(samples, batch.num_draft, 0).astype(np.int64)
        )
        wants_prompt = (batch.prompt_logprobs >= 0) & (
            batch.positions[starts[:-1]] < batch.prompt_lens
        )
        rows: list[np.ndarray] = []
        for b in range(len(states)):
            if wants_prompt[b]:
                rows.append(np.arange(starts[b], starts[b + 1]))
            elif samples[b]:  # the input token's position, and each draft's
                rows.append(np.arange(starts[b + 1] - 1 - num_draft[b], starts[b + 1]))
        logits_rows = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
        logits = self._forward(batch, logits_rows)  # [R, V] float32

        # Where each sequence's logits end among the rows computed (its last row is row_end - 1).
        row_ends = np.cumsum([len(r) for r in rows]) if rows else np.zeros(0, dtype=np.int64)
        last_row = {}
        cursor = 0
        for b in range(len(states)):
            if wants_prompt[b] or samples[b]:
                last_row[b] = int(row_ends[cursor]) - 1
                cursor += 1

        out = self._sample(batch, states, logits, last_row, num_draft)
        prompt = self._prompt_logprobs(batch, states, logits, wants_prompt, row_ends)
        return StepOutput(*out, *prompt)

    def _forward(self, batch: StepBatch, logits_rows: np.ndarray) -> torch.Tensor:
        device = self.device
        query_start_loc, context_lens, block_tables = _attention_rows(batch)
        inputs = AttentionInputs(
            query_start_loc=torch.from_numpy(query_start_loc).to(device),
            context_lens=torch.from_numpy(context_lens).to(device),
            block_tables=torch.from_numpy(block_tables).to(device),
            slot_mapping=torch.from_numpy(batch.slot_mapping.astype(np.int64)).to(device),
        )
        logits = self.model(
            torch.from_numpy(batch.input_ids.astype(np.int64)).to(device),
            torch.from_numpy(batch.positions.astype(np.int64)).to(device),
            self.kv_cache.layers,
            inputs,
            torch.from_numpy(logits_rows.astype(np.int64)).to(device),
        )
        return logits.float().cpu()

    def _sample(
        self,
        batch: StepBatch,
        states: list[_RequestState],
        logits: torch.Tensor,
        last_row: dict[int, int],
        num_draft: np.ndarray,  # [B] int64, drafts each sampling row verifies
    ) -> tuple[np.ndarray, ...]:
        """Each sampling row's token, or with drafts its verified run (gpu.sampler.verify): every
        position is sampled as plain decoding would sample it there (same knobs, same seeded
        noise), and the drafts are accepted while they equal what was sampled."""
        num_seqs = len(states)
        sampled = np.nonzero(np.asarray(batch.sample, dtype=bool))[0]
        num_top = max(0, int(batch.sampling.num_logprobs[sampled].max(initial=-1)))
        counts = np.ones(num_seqs, dtype=np.int32)
        if len(sampled) == 0:
            return (
                counts,
                np.full(num_seqs, -1, dtype=np.int64),
                np.full(num_seqs, np.nan, dtype=np.float32),
                np.zeros(num_seqs, dtype=np.int64),
                np.full((num_seqs, num_top), -1, dtype=np.int64),
                np.full((num_seqs, num_top), -np.inf, dtype=np.float32),
            )

        # One virtual row per position sampled: j = 0 is the input token's, j >= 1 draft j's.
        per_row = num_draft[sampled] + 1
        owner = np.repeat(sampled, per_row)  # [S'] the batch row of each virtual row
        offset = np.arange(len(owner)) - np.repeat(np.cumsum(per_row) - per_row, per_row)
        params = batch.sampling.select(owner)
        if batch.draft_bitmask is not None:
            params = replace(params, token_bitmask=batch.draft_bitmask)
        needs_ids = rows_needing_token_ids(params)
        history = []
        for row, (b, j) in enumerate(zip(owner.tolist(), offset.tolist(), strict=True)):
            tokens = states[b].token_ids
            seen = int(batch.context_lens[b]) - int(num_draft[b]) + j  # tokens before this one
            prompt_len = min(int(batch.prompt_lens[b]), seen)
            if needs_ids[row]:
                history.append(TokenHistory.of(tokens[:prompt_len], tokens[prompt_len:seen]))
            else:
                history.append(TokenHistory(seen - prompt_len, _NO_IDS, _NO_IDS))
        first_row = np.array([last_row[int(b)] for b in sampled]) - num_draft[sampled]
        rows = torch.from_numpy(np.repeat(first_row, per_row) + offset)
        result = sample(logits[rows], params, history, self.generator)

        drafted = np.zeros(len(owner), dtype=np.int64)  # the draft each virtual row verifies
        for b, start in zip(sampled.tolist(), (np.cumsum(per_row) - per_row).tolist(), strict=True):
            d = int(num_draft[b])
            if d:
                end = int(batch.context_lens[b])
                drafted[start : start + d] = states[b].token_ids[end - d : end]
        accepted = verify(result.token_ids.numpy(), drafted, per_row)  # [S] drafts accepted
        counts[sampled] = accepted + 1
        # Flat entries: each batch row's, in order (a non-sampling row keeps one -1 entry).
        starts_of = np.cumsum(per_row) - per_row
        take = []  # virtual rows emitted, in batch order; -1 stands for a non-sampling row
        position_of = dict(zip(sampled.tolist(), range(len(sampled)), strict=True))
        for b in range(num_seqs):
            i = position_of.get(b)
            if i is None:
                take.append(-1)
            else:
                take.extend(range(int(starts_of[i]), int(starts_of[i]) + int(counts[b])))
        take_np = np.asarray(take, dtype=np.int64)
        emitted = take_np >= 0
        source = np.where(emitted, take_np, 0)
        asked = params.num_logprobs[source]
        keep_top = emitted[:, None] & (np.arange(num_top)[None, :] < asked[:, None])
        token_ids = np.where(emitted, result.token_ids.numpy()[source], -1)
        logprobs = np.where(emitted, result.logprobs.numpy()[source], np.nan).astype(np.float32)
        ranks = np.where(emitted, result.ranks.numpy()[source], 0)
        top_ids = np.where(keep_top, result.top_ids.numpy()[source], -1)
        top_logprobs = np.where(keep_top, result.top_logprobs.numpy()[source], -np.inf).astype(
            np.float32
        )
        at = 0
        for b in range(num_seqs):
            n = int(counts[b])
            if b in position_of:
                tokens = states[b].token_ids
                kept = int(batch.context_lens[b]) - int(num_draft[b]) + n - 1
                del tokens[kept:]
                tokens.append(int(token_ids[at + n - 1]))
            at += n
        return counts, token_ids, logprobs, ranks, top_ids, top_logprobs

    def _prompt_logprobs(
        self,
        batch: StepBatch,
        states: list[_RequestState],
        logits: torch.Tensor,
        wants_prompt: np.ndarray,
        row_ends: np.ndarray,
    ) -> tuple[np.ndarray, ...]:
        """Logprob of each prompt token given the ones before it, chunk by chunk.

        A chunk's last position scores the first token of the next chunk, so its distribution
        waits in the request's state until that token arrives.
        """
        num_top = max(0, int(batch.prompt_logprobs[wants_prompt].max(initial=-1)))
        starts = batch.query_start_loc.astype(np.int64)
        start_loc = [0]
        pieces: list[tuple[np.ndarray, torch.Tensor, torch.Tensor, int]] = []
        cursor = 0
        for b, state in enumerate(states):
            computed = bool(wants_prompt[b] or batch.sample[b])
            if not wants_prompt[b]:
                cursor += int(computed)
                start_loc.append(start_loc[-1])
                continue
            end_row = int(row_ends[cursor])
            cursor += 1
            first_pos = int(batch.positions[starts[b]])
            num_new = int(starts[b + 1] - starts[b])
            prompt_len = int(batch.prompt_lens[b])
            chunk = torch.log_softmax(logits[end_row - num_new : end_row], dim=1)  # [n, V]
            scored = [chunk[:-1]]
            positions = np.arange(first_pos + 1, first_pos + num_new)
            if state.pending_prompt_logprobs is not None and first_pos > 0:
                scored.insert(0, state.pending_prompt_logprobs.unsqueeze(0))
                positions = np.concatenate([[first_pos], positions])
            last_pos = first_pos + num_new - 1
            state.pending_prompt_logprobs = chunk[-1] if last_pos + 1 < prompt_len else None
            positions = positions[positions < prompt_len]
            rows = torch.cat(scored)[: len(positions)]
            pieces.append(
                (
                    positions,
                    rows,
                    torch.tensor(state.token_ids)[positions],
                    int(batch.prompt_logprobs[b]),
                )
            )
            start_loc.append(start_loc[-1] + len(positions))

        total = start_loc[-1]
        out_positions = np.zeros(total, dtype=np.int64)
        out_tokens = np.zeros(total, dtype=np.int64)
        out_logprobs = np.zeros(total, dtype=np.float32)
        out_ranks = np.zeros(total, dtype=np.int64)
        out_top_ids = np.full((total, num_top), -1, dtype=np.int64)
        out_top_logprobs = np.full((total, num_top), -np.inf, dtype=np.float32)
        offset = 0
        for positions, rows, tokens, asked in pieces:
            n = len(positions)
            chosen, ranks, top_ids, top_logprobs = logprob_summary(
                rows, tokens, min(asked, num_top)
            )
            sl = slice(offset, offset + n)
            out_positions[sl], out_tokens[sl] = positions, tokens.numpy()
            out_logprobs[sl], out_ranks[sl] = chosen.numpy(), ranks.numpy()
            out_top_ids[sl, : top_ids.shape[1]] = top_ids.numpy()
            out_top_logprobs[sl, : top_logprobs.shape[1]] = top_logprobs.numpy()
            offset += n
        return (
            np.asarray(start_loc, dtype=np.int32),
            out_positions,
            out_tokens,
            out_logprobs,
            out_ranks,
            out_top_ids,
            out_top_logprobs,
        )


def _attention_rows(batch: StepBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The step's attention rows: (query_start_loc [R + 1], context_lens [R], block_tables [R, W]).

    A row that verifies drafts is its input token and drafts, each attending to the tokens up to
    itself: attended as that many one-token rows on the same block table, it takes the decode
    kernels (on CPU one native call per layer for an all-decode step) and computes each position
    as plain decoding computes it. Other rows are the batch's own."""
    num_draft = batch.num_draft
    if num_draft is None or not (drafted := np.asarray(batch.sample, bool) & (num_draft > 0)).any():
        return batch.query_start_loc, batch.context_lens, batch.block_tables
    q_lens = np.diff(batch.query_start_loc.astype(np.int64))
    split = np.where(drafted, q_lens, 1)  # rows each batch row becomes
    owner = np.repeat(np.arange(len(q_lens)), split)
    first = np.repeat(np.cumsum(split) - split, split)
    within = np.arange(len(owner)) - first  # the token's place in its split row
    new_q_lens = np.where(drafted[owner], 1, q_lens[owner])
    context = batch.context_lens.astype(np.int64)[owner]
    context = np.where(drafted[owner], context - q_lens[owner] + 1 + within, context)
    query_start_loc = np.zeros(len(owner) + 1, np.int32)
    np.cumsum(new_q_lens, out=query_start_loc[1:])
    return query_start_loc, context.astype(np.int32), batch.block_tables[owner]


def _store(token_ids: list[int], positions: np.ndarray, values: np.ndarray) -> None:
    """Write `values` at `positions` of a request's token list, growing it as needed."""
    if len(positions) == 0:
        return
    needed = int(positions.max()) + 1
    if len(token_ids) < needed:
        token_ids.extend([0] * (needed - len(token_ids)))
    for pos, value in zip(positions.tolist(), values.tolist(), strict=True):
        token_ids[pos] = value
