"""ModelRunner: the model, its paged KV cache and the sampler behind one `step(batch)` call.

The execute stage fills a `StepBatch` of numpy arrays from its ring and gets a `StepOutput` of
numpy arrays back. The runner remembers, per request id, the tokens it has seen (for penalties,
min_tokens and seeds) from the first step that names the request until `free`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace

import numpy as np
import structlog
import torch

from gpu import memory
from gpu.attention import AttentionInputs
from gpu.backends import NATIVE_KERNELS, Kernels, kernels_for, kernels_name
from gpu.cuda_graphs import DecodeGraphs, DecodeRows, capture_sizes
from gpu.drafter import Drafter
from gpu.kv_cache import (
    DEFAULT_BLOCK_SIZE,
    FP8,
    KVCache,
    kv_block_bytes,
    num_blocks_for_budget,
)
from gpu.loader import iter_weights, read_gguf_raw_tensors
from gpu.lora import install_lora
from gpu.model import CausalLM, rope_inv_freq
from gpu.quantize import QUANTIZATION_MODES, quantize_linears
from gpu.random_weights import fill_random
from gpu.sampler import (
    GREEDY_BELOW_TEMPERATURE,
    SampleOutput,
    SamplingArrays,
    TokenHistory,
    argmax_rows,
    logprob_summary,
    rejection_sample,
    rows_needing_token_ids,
    sample,
    token_logprobs,
    verify,
)
from gpu.tensor_parallel import (
    TensorParallel,
    shard_model,
    shard_raw_blocks,
    shard_weights,
)
from stages.lora import LoraConfig
from stages.text.checkpoint import (
    ModelConfig,
    UnsupportedModelError,
    cache_shape,
    load_model_config,
    quantized_shard_problem,
    resolve_kv_cache_dtype,
)

log = structlog.get_logger(__name__)

_NO_COPIES = np.zeros((0, 2), np.int32)
# (batch row, drafts, last_only) -> [1 + len(drafts), W] int32 structured-output masks ([1, W]
# after all the drafts with last_only), or None for a row without a grammar: StepBatch's
GrammarMasks = Callable[[int, list[int], bool], np.ndarray | None]
# (batch row, its drafts) -> the token forced at its next position and after each draft ([1 + D],
# -1: none), or None for a row nothing forces
ForcedAlong = Callable[[int, list[int]], list[int] | None]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KV_DTYPES = {**_DTYPES, "float8_e4m3fn": FP8}
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
    # quantized matmuls for every input; "auto": 1024 on the native kernels (int4 and int8: a
    # row's bits then do not depend on its batch), 8 on torch's packed ones.
    quantized_max_rows: int | str | None = "auto"
    # The C kernels of gpu/native on CPU (norms, RoPE + KV write, decode attention, GGUF-format
    # quantized matmuls with int8 activations); None: wherever they build. False: torch only.
    native_kernels: bool | None = None
    kv_cache_dtype: str = "auto"  # see stages.text.checkpoint.resolve_kv_cache_dtype
    random_weights: bool = False  # make the weights (gpu/random_weights.py) instead of reading
    # CUDA: the KV cache takes what remains of this fraction of the device's memory after the
    # weights and a profiled step of max_num_batched_tokens over max_num_seqs rows
    # (gpu/memory.py); None: kv_cache_bytes.
    gpu_memory_utilization: float | None = None
    num_kv_blocks: int | None = None  # exactly this many KV blocks (a count published before)
    max_num_seqs: int = 256  # the largest decode batch: CUDA graphs are captured up to it
    max_num_batched_tokens: int = 2048  # the profiled step's tokens
    max_model_len: int = 0  # 0: the model's; sets the CUDA graphs' block table width
    enforce_eager: bool = False  # CUDA: no graphs for decode steps
    calculate_kv_scales: bool = False  # an fp8 cache's scales from the first step's K and V
    lora: LoraConfig | None = None  # --enable-lora: adapter slots on every decoder projection
    # Speculative decoding's draft model, when the KV cache is sized from device memory: loaded
    # with the target, so that the sizing counts its weights, and its KV cache (as many blocks as
    # the target's) comes out of the same budget. Otherwise execute attaches it afterwards.
    draft_model: str | None = None


@dataclass(slots=True, frozen=True)
class StepBatch:
    """One engine step: B sequences, T new tokens in all, flattened in sequence order."""

    handles: np.ndarray  # [B] int64, each row's request (the engine's handle, stages/api.py)
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
    # With drafts and grammars: a row's structured-output masks at its next position and after
    # each of the given drafts in turn ([1 + D, ceil(V / 32)] int32; None for a row without a
    # grammar). A draft model samples each draft under them, and each verified position is
    # sampled under its own. None: each row's own mask (sampling.token_bitmask) for all.
    grammar_masks: GrammarMasks | None = None
    # With drafts and thinking budgets: the token forced at each verified position of a row (the
    # close tag's, once its budget is spent after the drafts before it). None: each row's own
    # forced token (sampling.forced_token_ids) for all its positions.
    forced_along: ForcedAlong | None = None
    # [B] int64: each row's LoRA adapter id, 0 for the base model; None: every row is the base's
    lora_ids: np.ndarray | None = None
    lora_paths: Mapping[int, str] = field(default_factory=dict)  # each adapter id's directory
    # [C, 2] int32 (source, destination): KV blocks copied before the forward (beams about to
    # write blocks they shared); None: none
    block_copies: np.ndarray | None = None


@dataclass(slots=True, frozen=True)
class ForwardInputs:
    """What the network needs of a step: the rank that samples makes it from the StepBatch, and
    with tensor parallelism the other ranks get it from that one and run the same forward."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    query_start_loc: (
        np.ndarray
    )  # [R + 1] int32, attention rows (a verified row split in one-token rows)
    context_lens: np.ndarray  # [R] int32
    block_tables: np.ndarray  # [R, max_blocks] int32
    slot_mapping: np.ndarray  # [T] int64
    logits_rows: np.ndarray  # [L] int64, rows of T whose logits are computed
    # [C, 2] int32 (source, destination): KV blocks every rank copies first (copy on write)
    block_copies: np.ndarray = field(default_factory=lambda: _NO_COPIES)
    # [T] int64: each token's LoRA adapter id (0: the base model); empty: every token the base's
    lora_ids: np.ndarray = field(default_factory=lambda: _NO_IDS)
    lora_paths: Mapping[int, str] = field(default_factory=dict)  # each adapter id's directory


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
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self._requests: dict[int, _RequestState] = {}
        self.graphs: DecodeGraphs | None = None  # set by capture_graphs
        # Speculative decoding's draft model (attach_drafter): it proposes the drafts of the rows
        # whose drafts are placeholders; None: drafts come filled in (prompt lookup, suffix).
        self.drafter: Drafter | None = None
        self.last_sample_ns = 0  # how long the last step's sampling took (the stage trace's)

    @classmethod
    def from_path(
        cls, model_path: str, config: RunnerConfig, tensor_parallel: TensorParallel | None = None
    ) -> ModelRunner:
        """Load the model; with `tensor_parallel`, only this rank's shard of it and of the KV
        heads (the caller joined the group; every rank calls this with the same arguments)."""
        if config.dtype not in _DTYPES:
            raise ValueError(
                f"dtype {config.dtype!r} is not supported; use one of {sorted(_DTYPES)}"
            )
        if config.quantization not in (None, *QUANTIZATION_MODES):
            raise ValueError(
                f"quantization {config.quantization!r} is not supported; use None or one of {QUANTIZATION_MODES}"
            )
        device = torch.device(config.device)
        if config.quantization is not None and device.type != "cpu":
            raise ValueError(
                f"quantization {config.quantization!r} runs on CPU only; on {device.type} the "
                "weights are dequantized to the model dtype"
            )
        if config.threads > 0:
            torch.set_num_threads(config.threads)
        dtype = _DTYPES[config.dtype]
        model_config = load_model_config(model_path)
        if tensor_parallel is not None and config.quantization is not None:
            problem = quantized_shard_problem(model_config, tensor_parallel.world_size)
            if problem:
                raise UnsupportedModelError(f"{problem}: run it unquantized (quantization None)")
        sized = config.gpu_memory_utilization is not None and config.num_kv_blocks is None
        start = memory.baseline(device) if sized and device.type == "cuda" else None
        model, local_shape = _load_model(model_path, model_config, config, dtype, tensor_parallel)
        if config.quantization is not None:
            is_gguf = model_path.endswith(".gguf")
            raw = {}
            if is_gguf:
                for ggml_type in ("Q4_1", "Q8_0"):
                    raw.update(read_gguf_raw_tensors(model_path, model_config, ggml_type))
                if tensor_parallel is not None:
                    raw = shard_raw_blocks(raw, model_config, tensor_parallel)
            use_native = model.kernels is NATIVE_KERNELS  # kernels_for made the choice
            max_rows = config.quantized_max_rows
            if max_rows == "auto":
                # The native kernels serve every batch (int8 activations, llama.cpp's
                # arithmetic), so a row's logits do not depend on how many rows share its step:
                # a prefix-cache hit computes a prompt's tail as a short chunk, a recovery
                # recomputes decoded tokens as a prefill, and both must give the bits they had.
                # torch's dense GEMM rounds one row differently from many: only a step of more
                # than 1024 rows (--max-num-batched-tokens above it) takes the dense copy.
                max_rows = 1024 if use_native else 8
            quantize_linears(
                model,
                config.quantization,
                raw,
                _DTYPES[config.quantized_compute_dtype],
                max_rows,
                use_native=use_native,
            )
        model = model.to(device=device)
        draft = None
        if config.draft_model is not None and start is not None:
            draft = _load_draft(config.draft_model, model_config, config, dtype, device)
        return cls.from_model(model, config, tensor_parallel, local_shape, start, draft)

    @classmethod
    def from_model(
        cls,
        model: CausalLM,
        config: RunnerConfig,
        tensor_parallel: TensorParallel | None = None,
        local_shape: ModelConfig | None = None,
        start: memory.Baseline | None = None,
        draft: CausalLM | None = None,
    ) -> ModelRunner:
        """A runner on a model already prepared: from_path's (this rank's shard under tensor
        parallelism, `local_shape` its KV heads; `start` the device before the weights, when the
        KV cache is sized from device memory, and `draft` a draft model loaded since, whose KV
        blocks it sizes too), or gpu/prepared.py's."""
        device = torch.device(config.device)
        model_config = model.config
        local_shape = local_shape or model_config
        if config.lora is not None:
            install_lora(model, config.lora, device, tensor_parallel)
        if device.type == "cuda" and kernels_name(model.kernels) == "triton":
            _set_angle_tables(model, draft, config)  # before the KV cache takes what is left
        kv_dtype = _KV_DTYPES[
            resolve_kv_cache_dtype(config.kv_cache_dtype, config.dtype, config.quantization)
        ]
        if kv_dtype == FP8:
            _check_fp8_cache(config.kv_cache_dtype, kernels_name(model.kernels), device)
        if config.num_kv_blocks is not None:
            kv_cache = KVCache(
                local_shape, config.num_kv_blocks, config.block_size, kv_dtype, device
            )
        elif config.gpu_memory_utilization is not None and start is not None:
            draft_block_bytes = (
                0 if draft is None else kv_block_bytes(draft.config, config.block_size, kv_dtype)
            )
            kv_cache = cls._sized_kv_cache(
                model, config, local_shape, kv_dtype, start, tensor_parallel, draft_block_bytes
            )
        else:
            # Every rank has the blocks of the rank with the most KV heads (the scheduler hands
            # out one set of block ids); each holds its own heads only.
            world_size = 1 if tensor_parallel is None else tensor_parallel.world_size
            num_blocks = num_blocks_for_budget(
                cache_shape(model_config, world_size),
                config.kv_cache_bytes,
                config.block_size,
                kv_dtype,
            )
            kv_cache = KVCache(local_shape, num_blocks, config.block_size, kv_dtype, device)
        runner = cls(model, kv_cache, config)
        if draft is not None:
            runner.attach_draft_model(draft, kv_dtype)
        # Under tensor parallelism the other ranks run every forward eagerly (execute_rank.py);
        # adapters apply their updates around the network's call, which a graph would not see.
        eager = config.enforce_eager or tensor_parallel is not None or config.lora is not None
        if device.type == "cuda" and runner.kernels_name == "triton":
            shapes = [local_shape] + ([] if draft is None else [draft.config])
            runner.compile_kernels(shapes, _DTYPES[config.dtype], kv_dtype)
        if device.type == "cuda" and not eager:
            runner.capture_graphs()
        if config.calculate_kv_scales:  # after the startup forwards, from the first served
            runner.kv_cache.calculate_scales_on_next_write()
            if runner.drafter is not None:
                runner.drafter.kv_cache.calculate_scales_on_next_write()
        log.info(
            "model ready",
            architecture=model_config.architecture,
            device=str(device),
            kernels=runner.kernels_name,
            dtype=config.dtype,
            random_weights=config.random_weights,
            kv_cache_dtype=str(kv_dtype).removeprefix("torch."),
            kv_blocks=kv_cache.num_blocks,
            block_size=config.block_size,
            cuda_graphs=None if runner.graphs is None else list(runner.graphs.sizes),
            tensor_parallel_rank=None if tensor_parallel is None else tensor_parallel.rank,
            kv_heads=local_shape.num_kv_heads,
        )
        return runner

    @classmethod
    def _sized_kv_cache(
        cls,
        model: CausalLM,
        config: RunnerConfig,
        local_shape: ModelConfig,  # this rank's KV heads
        dtype: torch.dtype,
        start: memory.Baseline,  # the device before the model was loaded
        tensor_parallel: TensorParallel | None,
        draft_block_bytes: int = 0,  # a draft model's KV bytes per block (its cache has as many)
    ) -> KVCache:
        """The KV cache --gpu-memory-utilization leaves room for: the weights (a draft model's
        included) are measured, then
        the largest step the scheduler may plan (max_num_batched_tokens over max_num_seqs rows,
        every row sampled) runs on a cache just big enough for it, and its peak is measured.
        Under tensor parallelism every rank measures its own device, running the probe step
        together, and all take the fewest blocks any of them has room for (vLLM's rule: the
        scheduler hands out one set of block ids)."""
        device = torch.device(config.device)
        torch.cuda.empty_cache()
        weights_bytes = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        batch = profile_batch(config.max_num_batched_tokens, config.max_num_seqs, config.block_size)
        probe_blocks = int(batch.block_tables.max()) + 1
        probe = cls(
            model, KVCache(local_shape, probe_blocks, config.block_size, dtype, device), config
        )
        if tensor_parallel is None or tensor_parallel.samples:
            probe.step(batch)
        else:  # rank 0's forward of that step, in lockstep with it through the collectives
            rows = len(batch.handles)
            inputs, _ = network_inputs(
                batch, batch.sample, np.zeros(rows, np.int64), np.zeros(rows, bool)
            )
            probe.forward(inputs)
        measured = memory.measure(device, start, weights_bytes)
        block_bytes = kv_block_bytes(local_shape, config.block_size, dtype)
        probe_bytes = probe_blocks * block_bytes
        measured = replace(measured, peak_step_bytes=max(0, measured.peak_step_bytes - probe_bytes))
        del probe
        torch.cuda.empty_cache()
        # A draft model's step runs before the target's and is smaller: the target's peak holds.
        num_blocks, own = agreed_kv_blocks(
            measured,
            config.gpu_memory_utilization or 0.0,
            block_bytes + draft_block_bytes,
            tensor_parallel,
            device,
        )
        log.info(
            "kv cache sized from device memory",
            device=str(device),
            total_gib=round(measured.total_bytes / (1 << 30), 2),
            utilization=config.gpu_memory_utilization,
            weights_gib=round(measured.weights_bytes / (1 << 30), 2),
            peak_step_gib=round(measured.peak_step_bytes / (1 << 30), 2),
            non_torch_gib=round(measured.non_torch_bytes / (1 << 30), 2),
            kv_blocks=num_blocks,  # under tensor parallelism, the fewest any rank has room for
            kv_blocks_here=own,
            kv_cache_gib=round(num_blocks * block_bytes / (1 << 30), 2),
            draft_kv_cache_gib=round(num_blocks * draft_block_bytes / (1 << 30), 2),
        )
        return KVCache(local_shape, num_blocks, config.block_size, dtype, device)

    def compile_kernels(
        self, shapes: list[ModelConfig], dtype: torch.dtype, kv_dtype: torch.dtype
    ) -> None:
        """Compile every Triton kernel variant the forwards of these shapes (the model's, a
        draft's) can meet, so that none compiles while serving (gpu/kernels/startup.py)."""
        from gpu.kernels.startup import compile_kernels

        started = time.perf_counter()
        for shape in shapes:
            compile_kernels(
                shape.num_heads,
                shape.num_kv_heads,
                shape.head_dim,
                shape.hidden_size,
                shape.intermediate_size,
                dtype,
                kv_dtype,
                self.kv_cache.block_size,
                self.device,
            )
        torch.cuda.synchronize(self.device)
        log.info(
            "kernels compiled", shapes=len(shapes), seconds=round(time.perf_counter() - started, 2)
        )

    def capture_graphs(self) -> None:
        """CUDA graphs of decode steps of every size up to max_num_seqs (gpu/cuda_graphs.py)."""
        max_len = self.config.max_model_len or self.model_config.max_position_embeddings
        graphs = DecodeGraphs(
            self.model,
            self.kv_cache.layers,
            capture_sizes(self.config.max_num_seqs),
            -(-max_len // self.kv_cache.block_size),
            self.device,
        )
        with torch.inference_mode():
            graphs.capture()
        self.graphs = graphs

    def attach_drafter(self, model_path: str) -> None:
        """Load a draft model beside this one, with the same settings, and a KV cache of as many
        blocks as this one's (indexed by the same block tables)."""
        _check_draft_vocab(model_path, load_model_config(model_path), self.model_config)
        draft = ModelRunner.from_path(
            model_path,
            # Exactly the target's block count; no graphs (the drafter calls the network itself).
            replace(
                self.config,
                gpu_memory_utilization=None,
                num_kv_blocks=self.num_kv_blocks,
                enforce_eager=True,
                lora=None,  # drafts are proposals: the target verifies them under the adapter
            ),
        )
        self.drafter = Drafter(draft.model, draft.kv_cache, self.generator)

    def attach_draft_model(self, draft: CausalLM, kv_dtype: torch.dtype) -> None:
        """A draft model already loaded on this device (from_path's, for a sized cache), with a
        KV cache of as many blocks as this one's."""
        cache = KVCache(
            draft.config, self.num_kv_blocks, self.kv_cache.block_size, kv_dtype, self.device
        )
        self.drafter = Drafter(draft, cache, self.generator)

    @property
    def model_config(self) -> ModelConfig:
        return self.model.config

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @property
    def kernels_name(self) -> str:
        """What runs the model's layers: `triton`, `torch` or a CPU kernel level."""
        return kernels_name(self.model.kernels)

    @property
    def tracked_handles(self) -> frozenset[int]:
        """Requests whose token history the runner holds (seen and not yet freed)."""
        return frozenset(self._requests)

    def copy_blocks(self, pairs: np.ndarray) -> None:  # pairs: [C, 2] int32 (source, destination)
        """Copy KV blocks before a step (beam search's copy on write)."""
        self.kv_cache.copy_blocks(torch.from_numpy(pairs.astype(np.int64)).to(self.device))

    def free(self, handles: np.ndarray | list[int]) -> None:
        """Forget finished or aborted requests."""
        ids = np.asarray(handles, dtype=np.int64).tolist()
        for handle in ids:
            self._requests.pop(handle, None)
        if self.drafter is not None:
            self.drafter.free(ids)

    def step(
        self, batch: StepBatch, share: Callable[[ForwardInputs], None] | None = None
    ) -> StepOutput:
        """Run one step and sample. `share` gets the step's ForwardInputs before the forward
        (tensor parallelism: the other ranks must run the same forward)."""
        with torch.inference_mode():
            return self._step(batch, share)

    def forward(self, inputs: ForwardInputs) -> torch.Tensor:  # -> [L, V] float32 (rank 0)
        """The network alone: what a tensor-parallel rank that does not sample runs."""
        with torch.inference_mode():
            return self._forward(inputs)

    def _step(self, batch: StepBatch, share: Callable[[ForwardInputs], None] | None) -> StepOutput:
        starts = batch.query_start_loc.astype(np.int64)
        states = [self._requests.setdefault(int(r), _RequestState()) for r in batch.handles]
        samples = np.asarray(batch.sample, dtype=bool)
        num_draft = (
            np.zeros(len(states), np.int64)
            if batch.num_draft is None
            else np.where(samples, batch.num_draft, 0).astype(np.int64)
        )
        draft_probs = None
        if self.drafter is not None:  # it fills in the drafts (first feeding what it lacks)
            proposal = self.drafter.propose(batch, [s.token_ids for s in states], num_draft)
            batch = replace(batch, input_ids=proposal.input_ids)
            draft_probs = proposal.probs
        for b, state in enumerate(states):
            positions = batch.positions[starts[b] : starts[b + 1]]
            _store(state.token_ids, positions, batch.input_ids[starts[b] : starts[b + 1]])
        wants_prompt = (batch.prompt_logprobs >= 0) & (
            batch.positions[starts[:-1]] < batch.prompt_lens
        )
        inputs, rows = network_inputs(batch, samples, num_draft, wants_prompt)
        if share is not None:
            share(inputs)
        logits = self._forward(inputs)  # [R, V] float32

        # Where each sequence's logits end among the rows computed (its last row is row_end - 1).
        row_ends = np.cumsum([len(r) for r in rows]) if rows else np.zeros(0, dtype=np.int64)
        last_row = {}
        cursor = 0
        for b in range(len(states)):
            if wants_prompt[b] or samples[b]:
                last_row[b] = int(row_ends[cursor]) - 1
                cursor += 1

        timer = Stopwatch(self.device)
        out = self._sample(batch, states, logits, last_row, num_draft, draft_probs)
        # Prompt logprobs (rare, and per prompt token) are scored on the host.
        host_logits = logits.cpu() if wants_prompt.any() else logits
        prompt = self._prompt_logprobs(batch, states, host_logits, wants_prompt, row_ends)
        self.last_sample_ns = timer.elapsed_ns()
        return StepOutput(*out, *prompt)

    def _forward(self, step: ForwardInputs) -> torch.Tensor:
        device = self.device
        if len(step.block_copies):
            self.copy_blocks(step.block_copies)
        graphs = self.graphs
        num_rows = len(step.context_lens)
        if (
            graphs is not None
            and len(step.input_ids) == num_rows  # one token per attention row
            and len(step.logits_rows) == num_rows  # each sampled (a draft is a row of its own)
            and graphs.fits(num_rows, step.block_tables.shape[1])
        ):
            rows = DecodeRows(
                input_ids=step.input_ids,
                positions=step.positions,
                slot_mapping=step.slot_mapping,
                context_lens=step.context_lens,
                block_tables=step.block_tables,
            )
            return graphs.run(rows)
        inputs = AttentionInputs(
            query_start_loc=torch.from_numpy(step.query_start_loc).to(device),
            context_lens=torch.from_numpy(step.context_lens).to(device),
            block_tables=torch.from_numpy(step.block_tables).to(device),
            slot_mapping=torch.from_numpy(step.slot_mapping).to(device),
        )
        lora = self.model.lora
        if lora is not None:
            ids = step.lora_ids if len(step.lora_ids) else np.zeros(len(step.input_ids), np.int64)
            lora.begin(ids, step.lora_paths)
        try:
            logits = self.model(
                torch.from_numpy(step.input_ids).to(device),
                torch.from_numpy(step.positions).to(device),
                self.kv_cache.layers,
                inputs,
                torch.from_numpy(step.logits_rows).to(device),
            )
        finally:
            if lora is not None:
                lora.end()
        return logits.float()  # on the device: sampling runs there

    def _sample(
        self,
        batch: StepBatch,
        states: list[_RequestState],
        logits: torch.Tensor,  # [R, V] float32 on the device, the rows the network computed
        last_row: dict[int, int],  # batch row -> its last row of `logits`
        num_draft: np.ndarray,  # [B] int64, drafts each sampling row verifies
        draft_probs: dict[int, torch.Tensor] | None = None,  # batch row -> [D, V] q of its drafts
    ) -> tuple[np.ndarray, ...]:
        """Each sampling row's token, or with drafts its verified run: every position is sampled
        as plain decoding would sample it there (same knobs, same seeded noise), and the drafts
        are accepted while they equal what was sampled (gpu.sampler.verify); drafts a model
        sampled from q are accepted by rejection sampling instead (gpu.sampler.rejection_sample)."""
        num_seqs = len(states)
        sampled = np.nonzero(np.asarray(batch.sample, dtype=bool))[0]  # [S] batch rows
        num_top = max(0, int(batch.sampling.num_logprobs[sampled].max(initial=-1)))
        if len(sampled) == 0:
            return _nothing_sampled(num_seqs, num_top)
        if draft_probs is None and not num_draft.any() and _plain_greedy(batch):
            return self._sample_greedy(batch, states, logits, last_row, sampled)

        # One virtual row per position sampled: j = 0 is the input token's, j >= 1 draft j's.
        per_row = num_draft[sampled] + 1  # [S]
        first_of = np.cumsum(per_row) - per_row  # [S] each sampling row's first virtual row
        owner = np.repeat(sampled, per_row)  # [S'] the batch row of each virtual row
        offset = np.arange(len(owner)) - np.repeat(first_of, per_row)  # [S'] j of each
        params = _position_params(batch, num_draft, owner)
        history = _token_histories(batch, states, num_draft, params, owner, offset)
        first_row = np.array([last_row[int(b)] for b in sampled]) - num_draft[sampled]
        rows = np.repeat(first_row, per_row) + offset  # [S'] the logits row of each
        picked, result = self._sample_positions(
            batch, logits, rows, params, history, keep_probs=draft_probs is not None
        )
        drafted = _drafted_tokens(batch, states, num_draft, sampled, first_of, len(owner))
        if draft_probs is None or result.probs is None:
            accepted = verify(result.token_ids.numpy(), drafted, per_row)  # [S] drafts accepted
        else:
            result, accepted = self._rejection_sample(
                result,
                result.probs,
                picked,
                drafted,
                draft_probs,
                sampled,
                per_row,
                params,
            )
        counts = np.ones(num_seqs, dtype=np.int32)
        counts[sampled] = accepted + 1
        position_of = dict(zip(sampled.tolist(), range(len(sampled)), strict=True))
        token_ids, logprobs, ranks, top_ids, top_logprobs = _emitted(
            result, params, counts, position_of, first_of, num_top
        )
        _keep_emitted(batch, states, num_draft, counts, position_of, token_ids)
        return counts, token_ids, logprobs, ranks, top_ids, top_logprobs

    def _sample_greedy(
        self,
        batch: StepBatch,
        states: list[_RequestState],
        logits: torch.Tensor,  # [R, V] float32 on the device
        last_row: dict[int, int],  # batch row -> its last row of `logits`
        sampled: np.ndarray,  # [S] batch rows that sample
    ) -> tuple[np.ndarray, ...]:
        """_sample when every row is plain greedy decoding (_plain_greedy): each sampling row's
        argmax, no logprobs, none of the sampler's per-row work (the same tokens it would pick:
        its greedy rows are the argmax of the unchanged logits)."""
        num_seqs = len(states)
        rows = [last_row[int(b)] for b in sampled]
        picked = logits if rows == list(range(len(logits))) else logits[rows]
        tokens = argmax_rows(picked).cpu().numpy()  # [S]
        token_ids = np.full(num_seqs, -1, dtype=np.int64)
        token_ids[sampled] = tokens
        for b, token in zip(sampled.tolist(), tokens.tolist(), strict=True):
            history = states[b].token_ids
            del history[int(batch.context_lens[b]) :]
            history.append(token)
        nothing = _nothing_sampled(num_seqs, 0)
        return nothing[0], token_ids, *nothing[2:]

    def _sample_positions(
        self,
        batch: StepBatch,
        logits: torch.Tensor,  # [R, V] float32 on the device
        rows: np.ndarray,  # [S'] int64, the row of `logits` at each position sampled
        params: SamplingArrays,  # S' rows
        history: list[TokenHistory],  # S', the tokens before each position
        keep_probs: bool,  # a draft model's rejection sampling reads the distributions after
    ) -> tuple[torch.Tensor, SampleOutput]:  # -> ([S', V] logits sampled, the samples)
        """Sample every position on the device and copy back the [S'] rows (and their top-k), not
        [S', V] logits; with `keep_probs` the distributions stay on the device."""
        if len(rows) == logits.shape[0] and (rows == np.arange(len(rows))).all():
            # Every logits row is sampled, in order (decodes and verifications): no [S', V]
            # copy, and sampling may mask and penalise them in place unless something reads
            # them after (a draft model's rejection sampling; prompt logprobs read the chunk's
            # rows, where a sampled row is one they do not use, but need not know that).
            picked = logits
            owned = not keep_probs and not (batch.prompt_logprobs >= 0).any()
        else:
            picked = logits[torch.from_numpy(rows).to(logits.device)]  # [S', V]
            owned = not keep_probs
        on_device = sample(
            picked, params, history, self.generator, keep_probs=keep_probs, owned=owned
        )
        return picked, _to_host(on_device)

    def _rejection_sample(
        self,
        result: SampleOutput,  # the target's plain samples at the S' verified positions
        target_probs: torch.Tensor,  # [S', V] float32 on the device: p at each of them
        logits: torch.Tensor,  # [S', V] float32 on the device, the target's raw logits there
        drafted: np.ndarray,  # [S'] int64, the draft after each position
        draft_probs: dict[int, torch.Tensor],  # batch row -> [D, V] q of its drafts
        sampled: np.ndarray,  # [S] batch rows that sample, in order
        per_row: np.ndarray,  # [S] 1 + drafts of each
        params: SamplingArrays,  # S' rows
    ) -> tuple[SampleOutput, np.ndarray]:  # -> (the emitted samples, [S] drafts accepted)
        """The drafts a model proposed, accepted by rejection sampling (seeded rows: while they
        equal the target's samples); a position that emits another token than the target's
        sample gets that token's logprobs."""
        vocab = target_probs.shape[1]
        q = torch.zeros_like(target_probs)  # the draft after each position's q; 0 at a row's last
        at = 0
        for b, count in zip(sampled.tolist(), per_row.tolist(), strict=True):
            if count > 1:
                q[at : at + count - 1] = draft_probs[b][:, :vocab].to(q.device)
            at += count
        token_ids = result.token_ids.numpy().copy()
        accepted = rejection_sample(
            target_probs,
            token_ids,
            q,
            drafted,
            per_row,
            params.seed >= 0,
            self.generator,
        )
        chosen, ranks = result.logprobs.clone(), result.ranks.clone()
        top_ids, top_logprobs = result.top_ids.clone(), result.top_logprobs.clone()
        changed = np.flatnonzero(token_ids != result.token_ids.numpy())
        if len(changed):
            index = torch.from_numpy(changed)
            chosen[index], ranks[index], top_ids[index], top_logprobs[index] = token_logprobs(
                logits[index.to(logits.device)].cpu(),
                torch.from_numpy(token_ids[changed]),
                params.select(changed),
                top_ids.shape[1],
            )
        samples = SampleOutput(torch.from_numpy(token_ids), chosen, ranks, top_ids, top_logprobs)
        return samples, accepted

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


def _to_host(on_device: SampleOutput) -> SampleOutput:
    """The samples on the host, but for the distributions (which stay where they are): on a
    GPU the fields are copied without blocking into pinned memory and waited for once, one host
    sync for the step's samples instead of one a field (#33 item 8)."""
    device = on_device.token_ids.device
    fields = [getattr(on_device, f) for f in SampleOutput.__slots__ if f != "probs"]
    if device.type != "cuda":
        return SampleOutput(*fields, on_device.probs)
    copies = [t.to("cpu", non_blocking=True) for t in fields]
    torch.cuda.current_stream(device).synchronize()
    return SampleOutput(*copies, on_device.probs)


def _set_angle_tables(model: CausalLM, draft: CausalLM | None, config: RunnerConfig) -> None:
    """Every position's rotary angles once, for the Triton rotary (CausalLM.set_angle_table)."""
    max_len = config.max_model_len or model.config.max_position_embeddings
    for network in (model, draft):
        if network is not None and network.angle_table is None:
            network.set_angle_table(max_len)


def _load_model(
    model_path: str,
    model_config: ModelConfig,
    config: RunnerConfig,
    dtype: torch.dtype,
    tensor_parallel: TensorParallel | None,
) -> tuple[CausalLM, ModelConfig]:  # -> (the model, the heads and columns this rank holds)
    """The model with its weights, in `dtype` (rope frequencies in float32). A CPU checkpoint
    loads in float32 first (quantization reads float weights); otherwise the model is laid out
    without memory and allocated in `dtype` on the device, so that an 8B model never exists in
    float32 or on the host: a checkpoint's tensors are copied in one by one (GGUF's dequantized
    on the host, then cast), random weights are made in place. On a device a tensor-parallel
    rank loads only its shard (load_shard); random weights are made whole, then cut, so that a
    seed gives the same model at every tensor-parallel size, and a CPU rank cuts the loaded
    model (on the meta path a gloo process group outlived destroy_process_group, and a process
    leaving normally then aborted in its threads' destructors).
    """
    kernels = kernels_for(config.device, config.native_kernels)
    if config.device == "cpu" and not config.random_weights:
        model = CausalLM(model_config, kernels)
        model.load_weights(iter_weights(model_path, model_config, dtype))
        model = model.to(dtype=dtype).eval()
        model.inv_freq = model.inv_freq.float()
        if tensor_parallel is not None:
            return model, shard_model(model, tensor_parallel)
        return model, model_config
    if tensor_parallel is not None and not config.random_weights:
        return load_shard(model_path, model_config, kernels, config.device, dtype, tensor_parallel)
    with torch.device("meta"):
        model = CausalLM(model_config, kernels)
    model = _allocated(model, model_config, config.device, dtype)
    if config.random_weights:
        fill_random(model, config.seed)
    else:
        model.load_weights(iter_weights(model_path, model_config, dtype))
    if tensor_parallel is not None:
        return model, shard_model(model, tensor_parallel)
    return model, model_config


def _check_fp8_cache(name: str, kernels: str, device: torch.device) -> None:
    """An fp8 KV cache needs the Triton kernels on a GPU that converts to float8 e4m3."""
    if kernels != "triton":
        raise ValueError(
            f"--kv-cache-dtype {name} needs the Triton (CUDA) kernels; the {kernels} kernels "
            "keep a float32 or bfloat16 cache"
        )
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(
            f"--kv-cache-dtype {name} needs compute capability 8.9 or later (Ada, Hopper): "
            f"Triton does not convert to float8 e4m3 on {torch.cuda.get_device_name(device)}"
        )


def _check_draft_vocab(path: str, draft: ModelConfig, target: ModelConfig) -> None:
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"draft model {path!r} has {draft.vocab_size} logits, the target {target.vocab_size}"
        )


def _load_draft(
    path: str, target: ModelConfig, config: RunnerConfig, dtype: torch.dtype, device: torch.device
) -> CausalLM:
    """A draft model's weights on the device, as attach_drafter loads them (whole, unquantized:
    this is the sized CUDA path)."""
    draft_config = load_model_config(path)
    _check_draft_vocab(path, draft_config, target)
    settings = replace(config, draft_model=None, lora=None, enforce_eager=True)
    model, _ = _load_model(path, draft_config, settings, dtype, None)
    return model.to(device=device)


def load_shard(
    model_path: str,
    model_config: ModelConfig,
    kernels: Kernels,
    device: str,
    dtype: torch.dtype,
    tensor_parallel: TensorParallel,
) -> tuple[CausalLM, ModelConfig]:  # -> (this rank's shard, its heads and columns)
    """A tensor-parallel rank's shard, laid out on the meta device and given memory on `device`
    for that alone; each checkpoint tensor is cut to the rank's slice as it streams by
    (shard_weights), so that the rank never holds more than its shard and one whole tensor.
    Loading runs no collective."""
    with torch.device("meta"):
        model = CausalLM(model_config, kernels)
        local = shard_model(model, tensor_parallel)  # the shard's layout, nothing allocated
    model = _allocated(model, model_config, device, dtype)
    weights = iter_weights(model_path, model_config, dtype)
    model.load_weights(shard_weights(weights, model_config, tensor_parallel), local)
    return model, local


def _allocated(
    model: CausalLM, model_config: ModelConfig, device: str, dtype: torch.dtype
) -> CausalLM:
    """A model laid out on the meta device, given uninitialised memory in `dtype` on `device`."""
    model = model.to(dtype=dtype).to_empty(device=device).eval()
    if model_config.tie_word_embeddings:  # to_empty made each its own tensor
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(model_config).to(device)
    return model


def agreed_kv_blocks(
    measured: memory.DeviceMemory,
    utilization: float,
    block_bytes: int,  # of this rank's KV heads
    tensor_parallel: TensorParallel | None,
    device: torch.device | str,
) -> tuple[int, int]:  # -> (blocks every rank allocates, blocks this device has room for)
    """The KV blocks of a cache sized from device memory. Under tensor parallelism each rank
    calls this with its own device's figures and all get the fewest blocks any has room for; a
    rank whose device has no room raises its own error, and the others say that one failed
    (they must still hear of it, or they would wait in the collective)."""
    try:
        own = memory.kv_cache_budget(measured, utilization) // block_bytes
        error = (
            None
            if own >= 1
            else ValueError(
                f"what --gpu-memory-utilization {utilization:g} leaves for the KV cache holds no "
                f"block of {block_bytes} bytes: raise it or set --kv-cache-memory"
            )
        )
    except ValueError as raised:
        own, error = 0, raised
    agreed = own if tensor_parallel is None else tensor_parallel.min_over_ranks(own, device)
    if error is not None:
        raise error
    if agreed < 1:
        raise ValueError(
            "another tensor-parallel rank has no room for the KV cache (its log says why)"
        )
    return agreed, own


def profile_batch(num_tokens: int, num_seqs: int, block_size: int) -> StepBatch:
    """The largest step a scheduler of these limits plans: `num_tokens` prompt tokens split over
    min(num_seqs, num_tokens) sequences, each on blocks of its own and each sampled."""
    rows = min(num_seqs, num_tokens)
    lens = np.full(rows, num_tokens // rows, np.int64)
    lens[: num_tokens % rows] += 1
    blocks = -(-lens // block_size)
    first_block = np.concatenate([[0], np.cumsum(blocks)[:-1]])
    tables = np.zeros((rows, int(blocks.max())), np.int32)
    for row in range(rows):
        tables[row, : blocks[row]] = np.arange(blocks[row]) + first_block[row]
    positions = np.concatenate([np.arange(n) for n in lens])
    owner = np.repeat(np.arange(rows), lens)
    slots = tables[owner, positions // block_size].astype(np.int64) * block_size
    query_start_loc = np.zeros(rows + 1, np.int32)
    np.cumsum(lens, out=query_start_loc[1:])
    return StepBatch(
        handles=np.arange(rows, dtype=np.int64),
        input_ids=np.zeros(num_tokens, np.int64),
        positions=positions,
        query_start_loc=query_start_loc,
        context_lens=lens.astype(np.int32),
        block_tables=tables,
        slot_mapping=slots + positions % block_size,
        prompt_lens=lens.astype(np.int32),
        sample=np.ones(rows, bool),
        sampling=SamplingArrays.defaults(rows),
        prompt_logprobs=np.full(rows, -1, np.int32),
    )


def _plain_greedy(batch: StepBatch) -> bool:
    """Whether every row decodes greedily with no knob that changes the argmax of its logits or
    reads more than it (logprobs, penalties, bans, biases, a grammar, a forced token, a
    minimum length), so that sampling is the argmax alone."""
    p = batch.sampling
    return bool(
        batch.grammar_masks is None
        and batch.forced_along is None
        and p.token_bitmask.shape[1] == 0
        and (p.temperature < GREEDY_BELOW_TEMPERATURE).all()
        and (p.num_logprobs < 0).all()
        and (p.min_tokens <= 0).all()
        and not rows_needing_token_ids(p).any()
        and (p.forced_token_ids < 0).all()
        and all(
            ids.size == 0 or (ids < 0).all()
            for ids in (
                p.logit_bias_ids,
                p.allowed_token_ids,
                p.bad_token_ids,
                p.logprob_token_ids,
            )
        )
    )


def _nothing_sampled(num_seqs: int, num_top: int) -> tuple[np.ndarray, ...]:
    """_sample's answer for a step in which no row samples (prompt chunks only): one empty entry
    per row."""
    return (
        np.ones(num_seqs, dtype=np.int32),
        np.full(num_seqs, -1, dtype=np.int64),
        np.full(num_seqs, np.nan, dtype=np.float32),
        np.zeros(num_seqs, dtype=np.int64),
        np.full((num_seqs, num_top), -1, dtype=np.int64),
        np.full((num_seqs, num_top), -np.inf, dtype=np.float32),
    )


def _position_params(
    batch: StepBatch,  # its drafts filled in
    num_draft: np.ndarray,  # [B] int64
    owner: np.ndarray,  # [S'] int64, the batch row of each position sampled
) -> SamplingArrays:  # -> S' rows
    """The sampling knobs at each position sampled: its row's, with the structured-output mask
    and the forced token a verified position has after the drafts before it."""
    params = batch.sampling.select(owner)
    if batch.grammar_masks is not None and params.token_bitmask.shape[1]:
        params = replace(params, token_bitmask=_verified_masks(batch, num_draft, params))
    if batch.forced_along is not None:
        params = replace(params, forced_token_ids=_verified_forced(batch, num_draft, params))
    return params


def _token_histories(
    batch: StepBatch,
    states: list[_RequestState],
    num_draft: np.ndarray,  # [B] int64
    params: SamplingArrays,  # S' rows
    owner: np.ndarray,  # [S'] int64, the batch row of each position sampled
    offset: np.ndarray,  # [S'] int64, 0 at the input token's position, j after draft j
) -> list[TokenHistory]:  # -> S'
    """The tokens before each position sampled; their ids only where a penalty reads them (the
    others' count alone, for min_tokens and seeding)."""
    needs_ids = rows_needing_token_ids(params)
    history: list[TokenHistory] = []
    for row, (b, j) in enumerate(zip(owner.tolist(), offset.tolist(), strict=True)):
        tokens = states[b].token_ids
        seen = int(batch.context_lens[b]) - int(num_draft[b]) + j  # tokens before this one
        prompt_len = min(int(batch.prompt_lens[b]), seen)
        if needs_ids[row]:
            history.append(TokenHistory.of(tokens[:prompt_len], tokens[prompt_len:seen]))
        else:
            history.append(TokenHistory(seen - prompt_len, _NO_IDS, _NO_IDS))
    return history


def _drafted_tokens(
    batch: StepBatch,
    states: list[_RequestState],
    num_draft: np.ndarray,  # [B] int64
    sampled: np.ndarray,  # [S] batch rows that sample, in order
    first_of: np.ndarray,  # [S] int64, each one's first position among the S'
    num_positions: int,  # S'
) -> np.ndarray:  # -> [S'] int64
    """The draft each position sampled verifies: the token fed after it (0 at a row's last)."""
    drafted = np.zeros(num_positions, dtype=np.int64)
    for b, start in zip(sampled.tolist(), first_of.tolist(), strict=True):
        d = int(num_draft[b])
        if d:
            end = int(batch.context_lens[b])
            drafted[start : start + d] = states[b].token_ids[end - d : end]
    return drafted


def _emitted(
    result: SampleOutput,  # S' rows, on the host
    params: SamplingArrays,  # S' rows
    counts: np.ndarray,  # [B] int32, entries each batch row emits
    position_of: dict[int, int],  # sampling batch row -> its index among the S
    first_of: np.ndarray,  # [S] int64, each sampling row's first position among the S'
    num_top: int,  # K
) -> tuple[np.ndarray, ...]:  # -> [N] token ids, logprobs, ranks; [N, K] top ids, top logprobs
    """StepOutput's flat entries: each batch row's, in order (a non-sampling row keeps one -1
    entry), top-k padded past what each row asked for."""
    take: list[int] = []  # virtual rows emitted, in batch order; -1 stands for a non-sampling row
    for b in range(len(counts)):
        i = position_of.get(b)
        if i is None:
            take.append(-1)
        else:
            take.extend(range(int(first_of[i]), int(first_of[i]) + int(counts[b])))
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
    return token_ids, logprobs, ranks, top_ids, top_logprobs


def _keep_emitted(
    batch: StepBatch,
    states: list[_RequestState],
    num_draft: np.ndarray,  # [B] int64
    counts: np.ndarray,  # [B] int32, entries each batch row emits
    position_of: dict[int, int],  # sampling batch row -> its index among the S
    token_ids: np.ndarray,  # [N] int64, the flat entries
) -> None:
    """Each sampling row's tokens as the step leaves them: its rejected drafts dropped and its
    last emitted token added (the accepted drafts are there already)."""
    at = 0
    for b in range(len(counts)):
        n = int(counts[b])
        if b in position_of:
            tokens = states[b].token_ids
            kept = int(batch.context_lens[b]) - int(num_draft[b]) + n - 1
            del tokens[kept:]
            tokens.append(int(token_ids[at + n - 1]))
        at += n


def _drafted_rows(
    batch: StepBatch,  # its drafts filled in
    num_draft: np.ndarray,  # [B] int64
) -> Iterator[tuple[int, int, list[int]]]:
    """(its first verified position, batch row, its drafts) of each sampling row with drafts;
    the positions are the sampling rows' in order, 1 + drafts each."""
    starts = batch.query_start_loc.astype(np.int64)
    first = 0
    for b in np.flatnonzero(batch.sample).tolist():
        d = int(num_draft[b])
        if d:
            yield first, b, batch.input_ids[starts[b + 1] - d : starts[b + 1]].tolist()
        first += 1 + d


def _verified_masks(
    batch: StepBatch,  # its drafts filled in
    num_draft: np.ndarray,  # [B] int64
    params: SamplingArrays,  # the sampled positions' (sampling rows in order, 1 + drafts each)
) -> np.ndarray:  # -> [S', W] int32
    """The structured-output mask of each verified position: a grammar's row's at its input
    token and after each of its drafts, as if it had taken them; the others' own."""
    assert batch.grammar_masks is not None
    masks = params.token_bitmask.copy()
    for first, b, drafts in _drafted_rows(batch, num_draft):
        rows = batch.grammar_masks(b, drafts, False)
        if rows is not None:
            masks[first : first + 1 + len(drafts)] = rows
    return masks


def _verified_forced(
    batch: StepBatch,  # its drafts filled in
    num_draft: np.ndarray,  # [B] int64
    params: SamplingArrays,  # the sampled positions' (sampling rows in order, 1 + drafts each)
) -> np.ndarray:  # -> [S'] int32
    """The token a thinking budget forces at each verified position (-1: none): at a row's input
    token and after each of its drafts, as if it had taken them."""
    assert batch.forced_along is not None
    forced = params.forced_token_ids.copy()
    for first, b, drafts in _drafted_rows(batch, num_draft):
        along = batch.forced_along(b, drafts)
        if along is not None:
            forced[first : first + 1 + len(drafts)] = along
    return forced


def network_inputs(
    batch: StepBatch,
    samples: np.ndarray,  # [B] bool, the rows that sample
    num_draft: np.ndarray,  # [B] int64, drafts each sampling row verifies
    wants_prompt: np.ndarray,  # [B] bool, the rows whose prompt logprobs are scored
) -> tuple[ForwardInputs, list[np.ndarray]]:  # -> (the forward's inputs, each row's logits rows)
    """What the network runs of a step: every token, and logits at the rows that need them (each
    token of a prompt chunk that scores prompt logprobs; a sampling row's input token and each
    of its drafts)."""
    starts = batch.query_start_loc.astype(np.int64)
    rows: list[np.ndarray] = []
    for b in range(len(batch.handles)):
        if wants_prompt[b]:
            rows.append(np.arange(starts[b], starts[b + 1]))
        elif samples[b]:  # the input token's position, and each draft's
            rows.append(np.arange(starts[b + 1] - 1 - num_draft[b], starts[b + 1]))
    logits_rows = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
    query_start_loc, context_lens, block_tables = _attention_rows(batch)
    inputs = ForwardInputs(
        input_ids=batch.input_ids.astype(np.int64, copy=False),
        positions=batch.positions.astype(np.int64, copy=False),
        query_start_loc=query_start_loc.astype(np.int32, copy=False),
        context_lens=context_lens.astype(np.int32, copy=False),
        block_tables=block_tables.astype(np.int32, copy=False),
        slot_mapping=batch.slot_mapping.astype(np.int64, copy=False),
        logits_rows=logits_rows.astype(np.int64, copy=False),
        block_copies=_NO_COPIES if batch.block_copies is None else batch.block_copies,
    )
    if batch.lora_ids is not None:
        per_token = np.repeat(batch.lora_ids.astype(np.int64), np.diff(starts))
        inputs = replace(inputs, lora_ids=per_token, lora_paths=dict(batch.lora_paths))
    return inputs, rows


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


class Stopwatch:
    """Time from its creation to `elapsed_ns`, as the device spends it: on CUDA between two
    events on the current stream (the host, which queued the work ahead, would instead count the
    forward's kernels where it first waits for them); elsewhere the host's clock. Read it only
    after the timed work has reached the host (a CUDA read waits for the second event)."""

    def __init__(self, device: torch.device) -> None:
        self._start_event = None
        if device.type == "cuda":
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record()
        self._start_ns = time.perf_counter_ns()

    def elapsed_ns(self) -> int:
        if self._start_event is None:
            return time.perf_counter_ns() - self._start_ns
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return int(self._start_event.elapsed_time(end) * 1e6)
