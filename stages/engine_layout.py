"""The pipeline's shape, from the engine's config: its rings and actors (the drawing of
docs/ARCHITECTURE.md, "Processes and rings"), with a tensor-parallel group's ranks and the
broadcast ring that feeds them.
"""

from __future__ import annotations

import dataclasses
import socket

from pipeline.actor import ActorSpec
from pipeline.broadcast import BroadcastSpec
from pipeline.ring import RingSpec
from stages.config import EngineConfig
from stages.cpu_bind import NONE, plan_binding
from stages.rings import deltas, forward, plan, prompts, requests, results, tokens


def pipeline_layout(
    config: EngineConfig,
) -> tuple[list[RingSpec | BroadcastSpec], list[ActorSpec]]:
    """The rings and actors of docs/ARCHITECTURE.md's drawing ("Processes and rings")."""
    step_bytes = 256 * 1024 + 64 * config.max_num_seqs * 64  # block tables grow with context
    rings: list[RingSpec | BroadcastSpec] = [
        RingSpec("requests", requests.REQUESTS, n_slots=64, slot_bytes=64 * 1024),
        # Errors, and the answers to render-only requests (a prompt's ids and text: 64 KiB is
        # about 8k tokens in one slot; longer ones take several).
        RingSpec("errors", requests.ERRORS, n_slots=16, slot_bytes=64 * 1024),
        RingSpec("prompts", prompts.PROMPTS, n_slots=64, slot_bytes=64 * 1024),
        RingSpec("plan", plan.PLAN, n_slots=4, slot_bytes=_round(step_bytes)),
        RingSpec("results", results.RESULTS, n_slots=4, slot_bytes=256 * 1024),
        RingSpec("tokens", tokens.TOKENS_VOCAB, n_slots=16, slot_bytes=256 * 1024),
        RingSpec("stop_hits", tokens.STOP_HITS, n_slots=16, slot_bytes=4096),
        RingSpec("deltas", deltas.DELTAS_VOCAB, n_slots=16, slot_bytes=256 * 1024),
    ]
    execute_entry = (
        "stages.actors.execute:ExecuteActor"
        if not config.dummy
        else "stages.actors.dummy:DummyExecuteActor"
    )
    tp_rings, config, tp_ranks = _tensor_parallel_ranks(config, step_bytes)
    execute_out = ("results", "forward") if tp_rings else ("results",)
    config = resolve_binding(config)  # the engine resolved it already: the same cores
    binding = config.cpu_binding
    compute, others = ((), ()) if binding is None else (binding.compute, binding.others)
    # The asyncio stages do not spin: a spin blocks their whole event loop, several readers each
    # spin, and messages come once per step (milliseconds apart), so spinning would only burn one
    # of two cores. Execute, a blocking loop fed a step ahead, keeps the short default spin.
    actors = [
        ActorSpec(
            "render",
            "stages.actors.render:RenderActor",
            config,
            ("requests",),
            ("prompts", "errors"),
            spin_s=0.0,
            cpus=others,
        ),
        ActorSpec(
            "schedule",
            "stages.actors.schedule:ScheduleActor",
            config,
            ("prompts", "results", "stop_hits"),
            ("plan", "tokens"),
            spin_s=0.0,
            cpus=others,
        ),
        ActorSpec(
            "execute",
            execute_entry,
            config,
            ("plan",),
            execute_out,
            heartbeat_interval_s=0.5,
            kept_files=("weights",),  # the prepared model, mapped again after a restart
            cpus=compute,
        ),
        ActorSpec(
            "detokenize",
            "stages.actors.detokenize:DetokenizeActor",
            config,
            ("tokens",),
            ("deltas", "stop_hits"),
            spin_s=0.0,
            cpus=others,
        ),
    ]
    return rings + tp_rings, actors + tp_ranks


def resolve_binding(config: EngineConfig) -> EngineConfig:
    """The config with --cpu-threads-bind's cores resolved (`cpu_binding`, and `threads` one a
    compute core), from this process's affinity: once, before anything is bound (a pipeline
    restarted later lays its stages on the same cores). One pipeline of one rank, on the CPU."""
    if config.cpu_threads_bind == NONE or config.cpu_binding is not None:
        return config
    if config.tensor_parallel_size > 1 or config.data_parallel_size > 1 or config.device != "cpu":
        raise ValueError(
            "--cpu-threads-bind binds one CPU pipeline's threads: not with --tensor-parallel-size"
            " or --data-parallel-size above 1, nor on a GPU"
        )
    binding = plan_binding(config.cpu_threads_bind, config.threads)
    assert binding is not None
    return dataclasses.replace(config, cpu_binding=binding, threads=len(binding.compute))


def _tensor_parallel_ranks(
    config: EngineConfig, step_bytes: int
) -> tuple[list[BroadcastSpec], EngineConfig, list[ActorSpec]]:
    """With --tensor-parallel-size N > 1: the `forward` broadcast ring from rank 0 (execute) to
    the N - 1 others, rank 0's config (the stages share it) and the other ranks' actors, every
    config naming the group's rendezvous port and the rank's own number."""
    size = config.tensor_parallel_size
    if size == 1:
        return [], config, []
    if config.dummy:
        raise ValueError("--tensor-parallel-size needs a model; the dummy execute has none")
    config = dataclasses.replace(
        config, master_port=config.master_port or _free_port(config.master_addr)
    )
    ring = BroadcastSpec(
        "forward", forward.FORWARD_VOCAB, size - 1, n_chunks=4, chunk_bytes=_round(step_bytes)
    )
    ranks = [
        ActorSpec(
            f"execute.rank{rank}",
            "stages.actors.execute_rank:ExecuteRankActor",
            dataclasses.replace(config, tensor_parallel_rank=rank),
            ("forward",),
            heartbeat_interval_s=0.5,
        )
        for rank in range(1, size)
    ]
    return [ring], config, ranks


def _free_port(host: str) -> int:
    """A TCP port free now on host, for the group's rendezvous (a fresh one at each start, so a
    restarted group never meets its predecessor's sockets)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def _round(n: int) -> int:
    return (n + 4095) // 4096 * 4096


def process_title(config: EngineConfig) -> str:
    if config.data_parallel_size == 1:
        return "pipeline-serve"
    return f"pipeline-serve dp{config.data_parallel_rank}"


def replica_fields(config: EngineConfig) -> tuple[tuple[str, str], ...]:
    """What tells one data-parallel replica's stage logs from another's (vLLM's `engine`)."""
    if config.data_parallel_size == 1:
        return ()
    return (("engine", str(config.data_parallel_rank)),)
