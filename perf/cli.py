"""`pipeline-bench`: the profiling tool's command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pipeline-bench", description=__doc__)
    sub = parser.add_subparsers(dest="mode", required=True)
    for add in (
        _add_ring,
        _add_broadcast,
        _add_serve,
        _add_offline,
        _add_model,
        _add_long_prompt,
        _add_chaos,
        _add_spec,
        _add_dp,
        _add_lora,
        _add_beam,
        _add_kernels,
        _add_roofline,
    ):
        add(sub)
    args = parser.parse_args(argv)
    return RUNNERS[args.mode](args, parser)


def _add_ring(sub: argparse._SubParsersAction) -> None:
    ring = sub.add_parser("ring", help="the shared-memory ring against mp.Queue and pyzmq+msgspec")
    ring.add_argument("--transports", default="ring,mp_queue,zmq_msgspec")
    ring.add_argument("--sizes", default="64,4096,65536,1048576", help="message sizes in bytes")
    ring.add_argument("--scale", type=float, default=1.0, help="scale the message counts")
    ring.add_argument("--json", dest="json_path", help="write the rows as JSON here")


def _add_broadcast(sub: argparse._SubParsersAction) -> None:
    broadcast = sub.add_parser(
        "broadcast", help="the broadcast ring against N single-consumer rings, N reader processes"
    )
    broadcast.add_argument("--readers", default="1,2,4", help="reader counts")
    broadcast.add_argument("--sizes", default="4096,65536,1048576", help="message sizes in bytes")
    broadcast.add_argument("--scale", type=float, default=1.0, help="scale the message counts")
    broadcast.add_argument("--json", dest="json_path", help="write the rows as JSON here")


def _add_serve(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser(
        "serve", help="streaming load generator for any OpenAI-compatible server"
    )
    serve.add_argument("--url", default="http://127.0.0.1:8000", help="base URL of the server")
    serve.add_argument(
        "--compare", help="a second server, run interleaved with the first; prints ratios"
    )
    serve.add_argument("--concurrency", default="1", help="closed loop: comma-separated levels")
    serve.add_argument(
        "--request-rate", default="", help="open loop: Poisson rates (req/s), comma-separated"
    )
    serve.add_argument(
        "--num-requests", type=int, default=0, help="per load level (default 4 x concurrency, >= 8)"
    )
    serve.add_argument(
        "--workload",
        choices=("random", "grounded"),
        default="random",
        help="random: random-word prompts of --prompt-tokens; grounded: copy a function of this "
        "project's source given in the prompt (where speculative decoding pays); its requests end at "
        "EOS, the others run to --max-tokens unless --no-ignore-eos",
    )
    serve.add_argument("--prompt-tokens", type=int, default=204)
    serve.add_argument("--max-tokens", type=int, default=128)
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument(
        "--dataset", help="JSONL of chat requests ({messages, max_tokens?}) instead of synthetic"
    )
    serve.add_argument("--slo", help="goodput thresholds in ms, e.g. ttft=500,itl=100")
    serve.add_argument("--model", help="model name to request (default: the server's first)")
    serve.add_argument("--api-key")
    serve.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS")
    serve.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="the requests' temperature (default 0: greedy; above 0 times random sampling)",
    )
    serve.add_argument(
        "--warmup", type=int, default=1, help="short requests per server before measuring"
    )
    serve.add_argument("--json", dest="json_path", help="write the report as JSON here")
    serve.add_argument("--report", help="write PNG charts into this folder")
    serve.add_argument(
        "--profile",
        action="store_true",
        help="pipeline-serve only: per-stage figures and CPU per token from /debug/profile",
    )


def _add_offline(sub: argparse._SubParsersAction) -> None:
    offline = sub.add_parser("offline", help="the engine in-process, without HTTP; where time goes")
    offline.add_argument("model", nargs="?", help="GGUF file or HF directory (default: SmolLM2)")
    offline.add_argument(
        "--dummy", action="store_true", help="null model: the pipeline's own ceiling"
    )
    offline.add_argument("--concurrency", default="1,32")
    offline.add_argument("--num-requests", type=int, default=0)
    offline.add_argument("--prompt-tokens", type=int, default=204)
    offline.add_argument("--max-tokens", type=int, default=128)
    offline.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="auto: CUDA if torch sees it",
    )
    offline.add_argument(
        "--random-weights", metavar="CONFIG", help="a preset shape or config.json, instead of MODEL"
    )
    offline.add_argument("--dtype", help="default: bfloat16 on CUDA, float32 on CPU")
    offline.add_argument("--quantization", default=None)
    offline.add_argument("--threads", type=int, default=0)
    offline.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="execute ranks (they share --threads)"
    )
    offline.add_argument("--max-num-seqs", type=int, default=256)
    offline.add_argument("--max-num-batched-tokens", type=int, default=512)
    offline.add_argument("--json", dest="json_path")
    offline.add_argument("--report", help="write the stage timeline (Gantt) PNG into this folder")


def _add_model(sub: argparse._SubParsersAction) -> None:
    model = sub.add_parser("model", help="model runner prefill/decode throughput per weight format")
    model.add_argument("model", nargs="?", help="GGUF file or HF directory (default: SmolLM2)")
    model.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="auto: CUDA if torch sees it",
    )
    model.add_argument(
        "--random-weights",
        metavar="CONFIG",
        help="random weights of a preset shape (llama-3-8b, llama-3-1b, qwen2.5-0.5b) or of a "
        "config.json, made on the device, instead of MODEL",
    )
    model.add_argument(
        "--peak-bandwidth-gb-s",
        type=float,
        help="the roofline's memory bandwidth; default: measured on CPU, an H200's 4800 on CUDA",
    )
    model.add_argument("--weights", help="default: fp32,bf16,int8,int4 on CPU, bf16 on CUDA")
    model.add_argument("--batches", default="1,8,32,64")
    model.add_argument("--context", type=int, default=256)
    model.add_argument("--prefill-tokens", type=int, default=512)
    model.add_argument("--steps", type=int, default=8, help="timed decode steps per point (median)")
    model.add_argument("--threads", type=int, default=0, help="per rank")
    model.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks over gloo, this process rank 0 (no baseline)",
    )
    model.add_argument("--no-baseline", action="store_true")
    model.add_argument(
        "--verify-drafts",
        type=int,
        default=0,
        metavar="K",
        help="also time each batch verifying K drafts per sequence (speculative decoding), in "
        "decode steps: the tokens per step drafting must emit to pay",
    )
    model.add_argument(
        "--cpu-isa",
        metavar="LEVELS",
        help="CPU kernel levels to measure in turn in one run, e.g. avx2,avx512_vnni (of "
        "portable, avx2, avx2_vnni, avx512, avx512_vnni: those this CPU runs); default: "
        "PIPELINE_SERVE_CPU_ISA",
    )
    model.add_argument("--json", dest="json_path")


def _add_long_prompt(sub: argparse._SubParsersAction) -> None:
    long_prompt = sub.add_parser(
        "long-prompt", help="streams' tok/s before, during and after one long prompt's prefill"
    )
    long_prompt.add_argument(
        "model", nargs="?", help="GGUF file or HF directory (default: SmolLM2)"
    )
    long_prompt.add_argument(
        "--shares",
        default="0.33,1",
        help="--long-prefill-share values to compare (1: no limit), each on its own engine",
    )
    long_prompt.add_argument("--streams", type=int, default=8)
    long_prompt.add_argument("--prompt-tokens", type=int, default=4000)
    long_prompt.add_argument(
        "--threshold", type=int, default=512, help="--long-prefill-token-threshold"
    )
    long_prompt.add_argument("--settle", type=float, default=5.0, help="seconds before and after")
    long_prompt.add_argument("--threads", type=int, default=0)
    long_prompt.add_argument("--rounds", type=int, default=1)
    long_prompt.add_argument("--json", dest="json_path")


def _add_chaos(sub: argparse._SubParsersAction) -> None:
    chaos = sub.add_parser(
        "chaos", help="streams under random SIGKILLs of stages: lost requests, recovery times"
    )
    chaos.add_argument("model", nargs="?", help="GGUF file or HF directory (default: SmolLM2)")
    chaos.add_argument("--dummy", action="store_true", help="null model: recovery without weights")
    chaos.add_argument("--streams", type=int, default=16)
    chaos.add_argument("--kills", type=int, default=12)
    chaos.add_argument(
        "--kill-interval",
        type=float,
        default=3.0,
        help="mean seconds from a recovery to the next kill",
    )
    chaos.add_argument("--stages", default="render,schedule,execute,detokenize")
    chaos.add_argument("--max-tokens", type=int, default=48)
    chaos.add_argument("--seed", type=int, default=0)
    chaos.add_argument("--threads", type=int, default=0)
    chaos.add_argument(
        "--template-bombs",
        type=int,
        default=0,
        help="requests with chat templates that loop for minutes or take a gigabyte, spread over "
        "the run; each must be a 400 naming its limit",
    )
    chaos.add_argument(
        "--non-readers",
        type=int,
        default=0,
        help="streams read once and then left unread, spread over the run; each must be aborted",
    )
    chaos.add_argument("--json", dest="json_path")
    chaos.add_argument(
        "--baseline",
        help="a tree of this project (e.g. `git archive main`) to run the same passes on, "
        "alternating with this one: recovery times side by side",
    )
    chaos.add_argument("--rounds", type=int, default=2, help="passes per side with --baseline")


def _add_spec(sub: argparse._SubParsersAction) -> None:
    spec = sub.add_parser(
        "spec", help="speculative decoding on against off, two servers side by side, one table"
    )
    spec.add_argument("model", nargs="?", help="GGUF file or HF directory (default: SmolLM2)")
    spec.add_argument(
        "--speculative-config",
        default=None,
        help="the JSON for the speculating server (default: ngram, 5 tokens, n-grams of 2-5)",
    )
    spec.add_argument(
        "--draft-model",
        default=None,
        help="speculate with this draft model instead (draft_model, --num-speculative-tokens); "
        "'self' drafts with the served model itself",
    )
    spec.add_argument(
        "--num-speculative-tokens", type=int, help="with --draft-model: its drafts (default 3)"
    )
    spec.add_argument("--threads", type=int, default=2)
    spec.add_argument("--max-tokens", type=int, default=128)
    spec.add_argument("--repeats", type=int, default=1, help="pairs per case, order alternated")
    spec.add_argument(
        "--same-servers",
        action="store_true",
        help="run every repeat on one pair of servers (faster; by default each repeat starts a "
        "fresh pair, so that one process's luck does not weigh on every ratio)",
    )
    spec.add_argument(
        "--ceiling",
        action="store_true",
        help="instead of on against off: the most the grounded cases can reach, the model's greedy "
        "outputs replayed through the method's proposer and priced with the verification cost "
        "measured on the model (no pipeline costs; ngram and suffix)",
    )
    spec.add_argument(
        "--ceiling-weights",
        choices=["fp32", "bf16", "int8", "int4"],
        help="with --ceiling: the weights the verification cost is measured with (default int4, "
        "as the default model serves)",
    )
    spec.add_argument("--port", type=int, default=8610, help="the servers take PORT and PORT + 1")
    spec.add_argument("--log-dir", default=".", help="where the two servers' logs go")
    spec.add_argument("--json", dest="json_path")


def _add_dp(sub: argparse._SubParsersAction) -> None:
    dp = sub.add_parser(
        "dp",
        help="data-parallel routing: cache-aware against round robin, two DP=2 servers, one table",
    )
    dp.add_argument("model", nargs="?", help="GGUF file or HF directory (default: SmolLM2)")
    dp.add_argument("--groups", type=int, default=12, help="distinct shared prefixes")
    dp.add_argument("--num-requests", type=int, default=48)
    dp.add_argument("--concurrency", type=int, default=4)
    dp.add_argument(
        "--kv-cache-memory", default="80MiB", help="per replica (about half the prefixes fit)"
    )
    dp.add_argument("--repeats", type=int, default=2, help="pairs, order alternated")
    dp.add_argument("--port", type=int, default=8620, help="the servers take PORT and PORT + 1")
    dp.add_argument("--log-dir", default=".", help="where the servers' logs and workloads go")
    dp.add_argument("--json", dest="json_path")


def _add_lora(sub: argparse._SubParsersAction) -> None:
    lora = sub.add_parser(
        "lora", help="LoRA adapters against the base model alone, one server, rounds interleaved"
    )
    lora.add_argument("model", nargs="?", help="GGUF file or HF directory (default: SmolLM2)")
    lora.add_argument("--adapters", type=int, default=4, help="random adapters, one per slot")
    lora.add_argument("--rank", type=int, default=8)
    lora.add_argument("--concurrency", type=int, default=32)
    # Rounds of ~25 s: at 64 requests of 64 tokens (~5 s) pairs ranged 0.4-1.8 on a quiet machine.
    lora.add_argument("--num-requests", type=int, default=128)
    lora.add_argument("--max-tokens", type=int, default=128)
    lora.add_argument("--repeats", type=int, default=3, help="pairs of rounds, order alternated")
    lora.add_argument("--threads", type=int, default=2)
    lora.add_argument("--port", type=int, default=8620)
    lora.add_argument("--json", dest="json_path")


def _add_beam(sub: argparse._SubParsersAction) -> None:
    beam = sub.add_parser(
        "beam", help="beam search (width 4) against n=4 sampling on one server, interleaved"
    )
    beam.add_argument("model", nargs="?", help="GGUF file or HF directory (default: SmolLM2)")
    beam.add_argument("--width", type=int, default=4)
    beam.add_argument("--concurrency", default="1,8")
    beam.add_argument("--repeats", type=int, default=3, help="batch pairs per level")
    beam.add_argument("--max-tokens", type=int, default=64)
    beam.add_argument("--threads", type=int, default=2)
    beam.add_argument("--port", type=int, default=8630)
    beam.add_argument("--log-dir", default=".", help="where the server's log goes")
    beam.add_argument("--json", dest="json_path")


def _add_kernels(sub: argparse._SubParsersAction) -> None:
    kernels = sub.add_parser(
        "kernels",
        help="compile every Triton kernel for CUDA with no GPU: registers, spills, occupancy",
    )
    kernels.add_argument("--arch", default="80,90", help="compute capabilities, e.g. 80,90")
    kernels.add_argument(
        "--shapes", default="", help="model shapes (default all: smollm2, presets, TP shards)"
    )
    kernels.add_argument("--json", dest="json_path", help="write the table as JSON here")


def _run_kernels(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from perf import kernel_check

    try:
        archs = tuple(int(a) for a in args.arch.split(",") if a)
        shapes = tuple(s for s in args.shapes.split(",") if s)
        return kernel_check.main(archs, shapes, args.json_path)
    except ValueError as exc:
        parser.error(str(exc))


def _add_roofline(sub: argparse._SubParsersAction) -> None:
    roofline = sub.add_parser(
        "roofline", help="bytes, FLOPs and predicted time of one decode step on a GPU, by design"
    )
    roofline.add_argument("--model", default="llama-3-8b", help="a --random-weights preset")
    roofline.add_argument("--gpu", default="h100", help="a100, h100 or h200")
    roofline.add_argument("--batch", type=int, default=1)
    roofline.add_argument("--context", type=int, default=2048, help="tokens in each sequence")
    roofline.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    roofline.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    roofline.add_argument(
        "--kv-cache-dtype", choices=["bfloat16", "float16", "float32"], help="default: --dtype"
    )
    roofline.add_argument(
        "--max-model-len",
        type=int,
        help="the block tables' bound (a CUDA graph's); default: context",
    )
    roofline.add_argument("--json", dest="json_path")


def _run_roofline(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from perf import roofline

    try:
        return roofline.main(
            args.json_path,
            model=args.model,
            gpu=args.gpu,
            batch=args.batch,
            context=args.context,
            tensor_parallel=args.tp,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            max_model_len=args.max_model_len,
        )
    except ValueError as exc:
        parser.error(str(exc))


def _run_broadcast(args: argparse.Namespace) -> int:
    from perf import broadcast_bench

    broadcast_bench.main(
        [int(n) for n in args.readers.split(",") if n],
        [int(n) for n in args.sizes.split(",") if n],
        args.scale,
        args.json_path,
    )
    return 0


def _run_ring(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from perf import ring_bench

    transports = [t for t in args.transports.split(",") if t]
    unknown = set(transports) - set(ring_bench.TRANSPORTS)
    if unknown:
        parser.error(f"unknown transports {sorted(unknown)}; choose from {ring_bench.TRANSPORTS}")
    sizes = [int(s) for s in args.sizes.split(",") if s]
    ring_bench.main(transports, sizes, args.scale, args.json_path)
    return 0


def _without_parser(
    run: Callable[[argparse.Namespace], int],
) -> Callable[[argparse.Namespace, argparse.ArgumentParser], int]:
    return lambda args, _parser: run(args)


def run_serve_cli(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import asyncio
    import json
    import os

    from perf import serve_bench

    try:
        slo = serve_bench.Slo.parse(args.slo)
        concurrency = tuple(int(c) for c in args.concurrency.split(",") if c)
        rates = tuple(float(r) for r in args.request_rate.split(",") if r)
    except ValueError as exc:
        parser.error(str(exc))
    bench_args = serve_bench.ServeArgs(
        urls=(args.url, args.compare) if args.compare else (args.url,),
        concurrency=concurrency,
        request_rates=rates,
        num_requests=args.num_requests,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        seed=args.seed,
        dataset=args.dataset,
        workload=args.workload,
        slo=slo,
        api_key=args.api_key,
        model=args.model,
        ignore_eos=not args.no_ignore_eos,
        warmup=args.warmup,
        profile=args.profile,
        temperature=args.temperature,
    )
    report, samples = asyncio.run(serve_bench.run_serve(bench_args))
    print(serve_bench.format_table(report))
    for run in report["runs"]:
        if "stages" in run:
            from perf.attribution import format_attribution
            from perf.pipeline_stats import format_stages

            load = run.get("concurrency", run.get("request_rate"))
            print(f"\n{run['url']} at {load}:\n{format_stages(run['stages'], run['overhead'])}")
            print(format_attribution(run["attribution"]))
        if "request_stage_ms" in run:
            parts = ", ".join(f"{k} {v['mean']:.1f}" for k, v in run["request_stage_ms"].items())
            print(f"time per request in each stage (ms, mean): {parts}")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
    if args.report:
        from perf.report import serve_report

        for path in serve_report(args.report, report, samples):
            print(f"wrote {path}", file=sys.stderr)
        for label, spans in samples["gantt"].items():
            from perf.report import gantt_chart

            name = "".join(ch if ch.isalnum() else "_" for ch in label)
            path = gantt_chart(
                os.path.join(args.report, f"gantt_{name}.png"), spans, f"Stage timeline, {label}"
            )
            print(f"wrote {path}", file=sys.stderr)
    return 1 if any(run["completed"] == 0 for run in report["runs"]) else 0


def run_beam_cli(args: argparse.Namespace) -> int:
    import json

    from perf import beam_bench

    report = beam_bench.run_beam_bench(
        beam_bench.BeamBenchArgs(
            model=args.model,
            width=args.width,
            concurrency=tuple(int(c) for c in args.concurrency.split(",") if c),
            repeats=args.repeats,
            max_tokens=args.max_tokens,
            port=args.port,
            threads=args.threads,
        ),
        args.log_dir,
    )
    print(beam_bench.format_table(report))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def run_spec_cli(args: argparse.Namespace) -> int:
    import json
    from dataclasses import replace

    from perf import spec_bench

    bench_args = spec_bench.SpecBenchArgs(
        model=args.model,
        port=args.port,
        threads=args.threads,
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        fresh_servers=not args.same_servers,
    )
    if args.speculative_config:
        bench_args = replace(bench_args, speculative_config=args.speculative_config)
    if args.num_speculative_tokens is not None and not args.draft_model:
        raise SystemExit(
            "pipeline-bench spec: --num-speculative-tokens goes with --draft-model (the JSON of "
            "--speculative-config carries its own)"
        )
    if args.draft_model:
        if args.speculative_config:
            raise SystemExit("pipeline-bench spec: --draft-model or --speculative-config, not both")
        draft = args.draft_model if args.draft_model != "self" else args.model
        config = spec_bench.draft_model_config(draft, args.num_speculative_tokens or 3)
        bench_args = replace(bench_args, speculative_config=config)
    if args.ceiling:
        if args.repeats != 1 or args.same_servers:
            raise SystemExit("pipeline-bench spec: --ceiling runs once, on one server")
        try:
            report = spec_bench.run_ceiling(
                bench_args, args.log_dir, args.ceiling_weights or "int4"
            )
        except ValueError as error:
            raise SystemExit(f"pipeline-bench spec: {error}") from None
        print(spec_bench.format_ceiling(report))
    else:
        if args.ceiling_weights:
            raise SystemExit("pipeline-bench spec: --ceiling-weights goes with --ceiling")
        report = spec_bench.run_spec_bench(bench_args, args.log_dir)
        print(spec_bench.format_table(report))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def run_dp_cli(args: argparse.Namespace) -> int:
    import json

    from perf import dp_bench

    bench_args = dp_bench.DpBenchArgs(
        model=args.model,
        groups=args.groups,
        num_requests=args.num_requests,
        concurrency=args.concurrency,
        kv_cache_memory=args.kv_cache_memory,
        repeats=args.repeats,
        port=args.port,
    )
    report = dp_bench.run_dp_bench(bench_args, args.log_dir)
    print(dp_bench.format_table(report))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
    return 1 if any(run["errors"] for run in report["runs"]) else 0


def run_lora_cli(args: argparse.Namespace) -> int:
    import json
    import tempfile

    from perf import lora_bench

    bench_args = lora_bench.LoraBenchArgs(
        model=args.model,
        num_adapters=args.adapters,
        rank=args.rank,
        concurrency=args.concurrency,
        num_requests=args.num_requests,
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        port=args.port,
        threads=args.threads,
    )
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as work_dir:
        report = lora_bench.run_lora_bench(bench_args, work_dir)
    print(lora_bench.format_table(report))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def run_long_prompt_cli(args: argparse.Namespace) -> int:
    import json

    from perf import long_prompt_bench as bench
    from pipeline.logs import configure_logging
    from stages.config import default_model_path

    configure_logging("console", "error")
    bench_args = bench.LongPromptArgs(
        model_path=args.model or default_model_path(),
        shares=tuple(float(s) for s in args.shares.split(",") if s),
        streams=args.streams,
        prompt_tokens=args.prompt_tokens,
        settle_s=args.settle,
        long_prefill_token_threshold=args.threshold,
        threads=args.threads,
        rounds=args.rounds,
    )
    print(
        f"long-prompt: {args.prompt_tokens} tokens beside {args.streams} streams ...",
        file=sys.stderr,
    )
    report = bench.run_long_prompt_bench(bench_args)
    print(bench.format_table(report))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def run_chaos_cli(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import asyncio
    import json

    from perf import chaos
    from pipeline.logs import configure_logging
    from stages.config import default_model_path

    stages = tuple(s for s in args.stages.split(",") if s)
    if unknown := set(stages) - set(chaos.STAGES):
        parser.error(f"unknown stages {sorted(unknown)}; choose from {chaos.STAGES}")
    configure_logging("console", "error")
    bench_args = chaos.ChaosArgs(
        model_path=args.model or default_model_path(),
        dummy=args.dummy,
        streams=args.streams,
        kills=args.kills,
        kill_interval_s=args.kill_interval,
        stages=stages,
        max_tokens=args.max_tokens,
        seed=args.seed,
        threads=args.threads,
        template_bombs=args.template_bombs,
        non_readers=args.non_readers,
    )
    print(f"chaos: {args.kills} kills under {args.streams} streams ...", file=sys.stderr)
    if args.baseline:
        summary = chaos.run_chaos_ab(bench_args, args.baseline, args.rounds)
        print(chaos.format_ab_table(summary))
        if args.json_path:
            with open(args.json_path, "w") as f:
                json.dump(summary, f, indent=2)
        sides = (summary["baseline"], summary["this"])
        return 0 if all(s["lost"] == s["wrong_text"] == 0 for s in sides) else 1
    report = asyncio.run(chaos.run_chaos(bench_args))
    print(chaos.format_table(report))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
    bombs_ok = report["template_bombs_refused"] == report["template_bombs"] and (
        report["non_readers_aborted"] == report["non_readers"]
    )
    clean = report["lost"] == report["wrong_text"] == report["misnamed_kills"] == 0
    return 0 if clean and report["kills"] and bombs_ok else 1


def run_model_cli(args: argparse.Namespace) -> int:
    import json

    from perf import model_bench
    from pipeline.logs import configure_logging

    configure_logging("console", "warning")
    device, model_path = _device_and_model(args)
    default_weights = "bf16" if device == "cuda" else "fp32,bf16,int8,int4"
    report = model_bench.run_model_bench(
        model_bench.ModelBenchArgs(
            model_path=model_path,
            device=device,
            random_weights=args.random_weights is not None,
            peak_bandwidth_gb_s=args.peak_bandwidth_gb_s,
            weights=tuple(w for w in (args.weights or default_weights).split(",") if w),
            batches=tuple(int(b) for b in args.batches.split(",") if b),
            context=args.context,
            prefill_tokens=args.prefill_tokens,
            steps=args.steps,
            threads=args.threads,
            baseline=not args.no_baseline,
            tensor_parallel_size=args.tensor_parallel_size,
            verify_drafts=args.verify_drafts,
            cpu_isa=tuple(level for level in (args.cpu_isa or "").split(",") if level),
        )
    )
    print(model_bench.format_table(report))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def _device_and_model(args: argparse.Namespace) -> tuple[str, str]:
    """--device resolved, and the model: MODEL, --random-weights' checkpoint, or SmolLM2."""
    from stages.config import default_model_path
    from stages.device import resolve_device
    from stages.text.random_model import write_random_checkpoint

    device = resolve_device(args.device)
    if args.random_weights is not None:
        if args.model is not None:
            raise SystemExit("--random-weights replaces MODEL: give one of them")
        return device, write_random_checkpoint(args.random_weights)[1]
    return device, args.model or default_model_path()


def run_offline_cli(args: argparse.Namespace) -> int:
    import asyncio
    import json
    import os

    from perf import offline
    from perf.attribution import format_attribution
    from perf.pipeline_stats import format_stages
    from pipeline.logs import configure_logging
    from stages.device import default_dtype

    configure_logging("console", "warning")
    device, model_path = _device_and_model(args)
    bench_args = offline.OfflineArgs(
        model_path=model_path,
        device=device,
        random_weights=args.random_weights is not None,
        dummy=args.dummy,
        concurrency=tuple(int(c) for c in args.concurrency.split(",") if c),
        num_requests=args.num_requests,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        dtype=args.dtype or default_dtype(device),
        quantization=args.quantization,
        threads=args.threads,
        tensor_parallel_size=args.tensor_parallel_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    print(
        f"starting the pipeline ({'dummy model' if args.dummy else bench_args.model_path}) ...",
        file=sys.stderr,
    )
    report, gantt = asyncio.run(offline.run_offline(bench_args))
    for run in report["runs"]:
        print(
            f"\nconcurrency {run['concurrency']}: {run['completed']} requests, "
            f"{run['output_tok_per_s']:.1f} output tok/s, TTFT p50 {run['ttft_ms']['p50']:.1f} ms, "
            f"ITL p50 {run['itl_ms']['p50']:.2f} ms p99 {run['itl_ms']['p99']:.2f} ms"
        )
        print(format_stages(run["stages"], run["overhead"]))
        print(format_attribution(run["attribution"]))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
    if args.report:
        from perf.report import gantt_chart

        os.makedirs(args.report, exist_ok=True)
        path = gantt_chart(
            os.path.join(args.report, "stages_gantt.png"), gantt, "Stage timeline (last run)"
        )
        print(f"wrote {path}", file=sys.stderr)
    return 0


# Each mode's runner, given the parsed arguments and the parser (for its errors).
RUNNERS: dict[str, Callable[[argparse.Namespace, argparse.ArgumentParser], int]] = {
    "ring": _run_ring,
    "broadcast": _without_parser(_run_broadcast),
    "serve": run_serve_cli,
    "offline": _without_parser(run_offline_cli),
    "model": _without_parser(run_model_cli),
    "long-prompt": _without_parser(run_long_prompt_cli),
    "chaos": run_chaos_cli,
    "spec": _without_parser(run_spec_cli),
    "dp": _without_parser(run_dp_cli),
    "lora": _without_parser(run_lora_cli),
    "beam": _without_parser(run_beam_cli),
    "kernels": _run_kernels,
    "roofline": _run_roofline,
}


if __name__ == "__main__":
    sys.exit(main())
