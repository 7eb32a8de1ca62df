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
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
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
from server.logs import configure_server_logging
from server.options import ATTENTION_BACKENDS, OPTIONS, build_parser
from server.serve import serve_app
from server.systemd import Notifier, PipelineState, monitor, status_line
from server.vllm_configs import check_structured_outputs, merge_dotted, resolve_reasoning
from stages.config import EngineConfig, default_model_path, generation_defaults
from stages.device import default_dtype, resolve_device
from stages.engine_layout import resolve_binding
from stages.lora import LoraConfig, LoraError, read_adapter
from stages.text.checkpoint import FP8_KV_CACHE_DTYPES
from stages.text.random_model import write_random_checkpoint

log = structlog.get_logger("server")

_DTYPE_ALIASES = {"float": "float32", "half": "float16"}
QUANTIZATION_CHOICES_CPU = ("int8", "int4")
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's


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
    once here: VLLM_API_KEY, VLLM_ALLOW_RUNTIME_LORA_UPDATING."""
    environ = os.environ if environ is None else environ
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:  # `pipeline-serve serve MODEL`, as `vllm serve MODEL`
        argv = argv[1:]
    args = parser.parse_args(merge_dotted(argv))
    model = _model(parser, args)
    device = resolve_device(args.device)
    _check_flags(parser, args, model, device)
    resolve_reasoning(parser, args)
    structured_outputs_backend = check_structured_outputs(parser, args)
    if args.gpu_memory_utilization is not None and device != "cuda":
        args.kv_cache_memory = _cpu_kv_cache_memory(parser, args, model.path)
    names = _served_model_names(args, model)
    lora = _lora_config(parser, args, model.dummy)
    _check_lora_names(parser, args, names)
    sampling = _sampling(parser, args)
    config = ServerConfig(
        served_model_name=names[0],
        served_model_aliases=tuple(names[1:]),
        # vLLM's: the flag, else VLLM_API_KEY from the environment
        api_key=args.api_key or environ.get("VLLM_API_KEY") or None,
        default_sampling_params=sampling.defaults,
        enable_log_requests=bool(args.enable_log_requests),
        allowed_origins=None if args.allowed_origins is None else tuple(args.allowed_origins),
        allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers),
        enable_lora=lora is not None,
        lora_modules=tuple(args.lora_modules or ()),
        allow_runtime_lora_updating=environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0")
        .strip()
        .lower()
        in ("1", "true"),
        structured_outputs_backend=structured_outputs_backend,
        **{entry.server: getattr(args, entry.dest) for entry in OPTIONS if entry.server},
    )
    return config, _engine_config(args, model, device, names[0], sampling, lora)


@dataclass(frozen=True, slots=True)
class _Model:
    """What MODEL (or --model, or --random-weights) resolved to."""

    path: Path
    dummy: bool  # `pipeline-serve dummy`: the null model on the default model's tokenizer
    random_name: str | None  # --random-weights: the preset's (or config's) name


def _model(parser: argparse.ArgumentParser, args: argparse.Namespace) -> _Model:
    """Resolves MODEL into args.model (a path), writing --random-weights' checkpoint."""
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
    # `pipeline-serve dummy`: the null model (deterministic tokens, no compute) on the default
    # model's tokenizer, for measuring the pipeline and the front end alone.
    dummy = args.model == "dummy"
    if args.model is None or dummy:
        try:
            args.model = default_model_path()
        except FileNotFoundError as error:
            parser.error(f"no MODEL given and {error}")
    return _Model(Path(args.model), dummy, random_name)


def _check_flags(
    parser: argparse.ArgumentParser, args: argparse.Namespace, model: _Model, device: str
) -> None:
    """Flags that need another, or contradict one: refused at start with the reason."""
    if args.enable_log_requests and args.disable_log_requests:
        parser.error("--enable-log-requests and --disable-log-requests contradict each other")
    if args.enable_log_outputs and not args.enable_log_requests:
        parser.error("--enable-log-outputs needs --enable-log-requests")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        parser.error("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    if args.root_path and (not args.root_path.startswith("/") or args.root_path.endswith("/")):
        parser.error(f"--root-path must start with / and not end with one, got {args.root_path!r}")
    if args.enable_chunked_prefill is False:
        parser.error(
            "--no-enable-chunked-prefill cannot be honoured: this scheduler always prefills "
            "prompts in chunks beside running decodes"
        )
    backend = ATTENTION_BACKENDS[device]
    if args.attention_backend is not None and args.attention_backend.upper() != backend:
        parser.error(
            f"--attention-backend {args.attention_backend} is not available: on {device} this "
            f"server's attention is {backend}, its own kernels"
        )
    _check_load_format(parser, args, model)
    if args.limit_mm_per_prompt is not None:
        log.info(
            "--limit-mm-per-prompt limits nothing: the model takes text only",
            limits=args.limit_mm_per_prompt,
        )
    if args.skip_tokenizer_init:
        parser.error("--skip-tokenizer-init is not supported: render and detokenize need it")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser")
    fp8_cache = args.kv_cache_dtype in FP8_KV_CACHE_DTYPES
    if fp8_cache and device != "cuda":
        parser.error(
            f"--kv-cache-dtype {args.kv_cache_dtype} needs CUDA: the CPU kernels keep a float32 "
            "or bfloat16 cache"
        )
    if args.calculate_kv_scales and not fp8_cache:
        parser.error(
            "--calculate-kv-scales needs --kv-cache-dtype fp8 (only an fp8 cache is scaled)"
        )
    if device == "cuda" and args.quantization in QUANTIZATION_CHOICES_CPU:
        parser.error(
            f"--quantization {args.quantization} runs on CPU; on CUDA the weights are "
            "dequantized to --dtype (use --quantization auto or none)"
        )
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
    if (args.tensor_parallel_size or 1) > 1 and model.dummy:
        parser.error("--tensor-parallel-size needs a model; the dummy execute has none")


def _check_load_format(
    parser: argparse.ArgumentParser, args: argparse.Namespace, model: _Model
) -> None:
    """--load-format gguf or safetensors names what MODEL must be; dummy needs a MODEL."""
    fmt, path = args.load_format, model.path
    if fmt == "gguf" and not (path.is_file() and path.suffix == ".gguf"):
        parser.error(f"--load-format gguf needs MODEL to be a .gguf file, not {str(path)!r}")
    if fmt == "safetensors" and not (path.is_dir() and any(path.glob("*.safetensors"))):
        parser.error(f"--load-format safetensors needs a directory of .safetensors: {str(path)!r}")
    if fmt == "dummy" and (model.dummy or model.random_name is not None):
        parser.error("--load-format dummy needs a MODEL whose shape it takes")


def _cpu_kv_cache_memory(
    parser: argparse.ArgumentParser, args: argparse.Namespace, model_path: Path
) -> int | None:
    """--gpu-memory-utilization on CPU sizes the KV cache unless --kv-cache-memory does."""
    if args.kv_cache_memory is not None:
        return int(args.kv_cache_memory)
    copies = (args.data_parallel_size or 1) * (args.tensor_parallel_size or 1)
    try:
        return cpu_kv_cache_bytes(args.gpu_memory_utilization, model_path, copies)
    except ValueError as error:
        parser.error(str(error))


def _served_model_names(args: argparse.Namespace, model: _Model) -> list[str]:
    """--served-model-name, else the random preset's, `dummy`, or the model's file name."""
    if args.served_model_name:
        return list(args.served_model_name)
    if model.random_name is not None:
        return [model.random_name]
    if model.dummy:
        return ["dummy"]
    if model.path.suffix == ".gguf":
        return [model.path.stem]
    return [model.path.name or args.model]


def _check_lora_names(
    parser: argparse.ArgumentParser, args: argparse.Namespace, served_model_names: list[str]
) -> None:
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


@dataclass(frozen=True, slots=True)
class _Sampling:
    """The generation config's sampling defaults, with its max_new_tokens apart."""

    defaults: dict[str, Any]
    default_max_tokens: int | None  # of requests that leave max_tokens unset
    max_tokens_cap: int | None  # of every request (vLLM's override_max_tokens)


def _sampling(parser: argparse.ArgumentParser, args: argparse.Namespace) -> _Sampling:
    try:
        defaults = generation_defaults(
            args.generation_config, args.model, args.override_generation_config
        )
    except (OSError, ValueError) as error:
        parser.error(f"--generation-config {args.generation_config}: {error}")
    default_max_tokens = defaults.pop("max_tokens", None)
    # vLLM's override_max_tokens: a generation config given as a directory, or an override,
    # that sets max_new_tokens caps requests that set max_tokens too.
    override_max_new_tokens = (args.override_generation_config or {}).get("max_new_tokens")
    capped = args.generation_config not in ("auto", "vllm") or override_max_new_tokens is not None
    return _Sampling(defaults, default_max_tokens, default_max_tokens if capped else None)


def _engine_config(
    args: argparse.Namespace,
    model: _Model,
    device: str,
    served_model_name: str,
    sampling: _Sampling,
    lora: LoraConfig | None,
) -> EngineConfig:
    # vLLM's rule: a KV cache size given wins; on CUDA the rest is sized from device memory.
    utilization = None
    if device == "cuda" and args.kv_cache_memory is None and not model.dummy:
        utilization = args.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
    derived: dict[str, Any] = {
        "dtype": default_dtype(device)
        if args.dtype == "auto"
        else _DTYPE_ALIASES.get(args.dtype, args.dtype),
        "quantization": None
        if device == "cuda"
        else _quantization(args.quantization, args.model, args.load_format),
        "device": device,
        "gpu_memory_utilization": utilization,
        "random_weights": model.random_name is not None or args.load_format == "dummy",
        "lora": lora,
        "default_max_tokens": sampling.default_max_tokens,
        "max_tokens_cap": sampling.max_tokens_cap,
        "reasoning_start_str": (args.reasoning_config or {}).get("reasoning_start_str"),
        "reasoning_end_str": (args.reasoning_config or {}).get("reasoning_end_str"),
        "structured_outputs_in_reasoning": (args.structured_outputs_config or {}).get(
            "enable_in_reasoning"
        ),
    }
    given = {entry.engine: getattr(args, entry.dest) for entry in OPTIONS if entry.engine}
    overrides = {name: value for name, value in {**given, **derived}.items() if value is not None}
    return EngineConfig(
        model_path=args.model,
        served_model_name=served_model_name,
        dummy=model.dummy,
        **overrides,
    )


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
            "--lora-dtype": args.lora_dtype,
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
            args.lora_dtype or defaults.dtype,
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


def _quantization(choice: str, model_path: str, load_format: str) -> str | None:
    if choice == "none":
        return None
    if choice != "auto":
        return choice
    # random weights have no Q4_1 blocks to map: auto keeps them dense, as for --random-weights
    return "int4" if load_format != "dummy" and _is_q4_1_gguf(model_path) else None


def _is_q4_1_gguf(model_path: str) -> bool:
    """True for a GGUF whose file type is "mostly Q4_1" (llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_1 = 3)."""
    if not (model_path.endswith(".gguf") and Path(model_path).is_file()):
        return False
    from stages.text.checkpoint import open_gguf  # the parse the tokenizer's load reuses

    field = open_gguf(model_path).fields.get("general.file_type")
    return field is not None and int(field.parts[field.data[0]][0]) == 3


def _url(config: ServerConfig) -> str:
    if config.uds is not None:
        return f"unix:{config.uds}{config.root_path}"
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


def bind_front_end(engine_config: EngineConfig) -> EngineConfig:
    """--cpu-threads-bind: the cores resolved once for the whole pipeline (execute's threads,
    the other stages), and this process, the HTTP front end, onto the other stages' cores."""
    engine_config = resolve_binding(engine_config)
    binding = engine_config.cpu_binding
    if binding is not None:
        os.sched_setaffinity(0, binding.others)
        log.info("CPU cores bound", compute=list(binding.compute), others=list(binding.others))
    return engine_config


def main(argv: Sequence[str] | None = None) -> int:
    config, engine_config = parse_args(argv)
    # The stages are titled "pipeline-serve: <stage>" by their supervisor (stages/engine.py).
    setproctitle.setproctitle("pipeline-serve: server")
    setproctitle.setthreadtitle("pipeline-serve")
    configure_server_logging(config.log_format, config.log_level, config.uvicorn_log_level)
    notifier = Notifier.from_environ(os.environ, os.getpid())  # systemd's, when it started us
    try:
        engine_config = bind_front_end(engine_config)
    except ValueError as error:
        log.error("cannot bind CPU threads", reason=str(error))
        notifier.close()
        return 2
    try:
        return uvloop.run(serve(config, engine_config, notifier))
    finally:
        notifier.close()


if __name__ == "__main__":
    raise SystemExit(main())
