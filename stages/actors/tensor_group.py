"""How execute ranks form a tensor-parallel group: torch.distributed's own TCP rendezvous with
torchrun's MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK (passed, not read from the environment),
gloo on CPU and NCCL on CUDA; the runner configuration they share and the KV block count they
agree on; rank 0 sharing each step's forward inputs on the broadcast ring; and a lost rank told
apart from a bug."""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import structlog

from pipeline.broadcast import BroadcastWriter
from pipeline.errors import PeerDied
from stages.config import EngineConfig, resolve_max_model_len, sized_from_device_memory
from stages.device import cuda_placement
from stages.kv_size import published_num_blocks
from stages.rings.forward import FORWARD, ForwardStep, pack_forward

if TYPE_CHECKING:
    from gpu.runner import ForwardInputs, RunnerConfig
    from gpu.tensor_parallel import TensorParallel

log = structlog.get_logger("stages.tensor_group")

# A collective that waits longer than this for a rank that is alive but stuck fails the group
# (a dead rank fails it at once: its sockets close).
COLLECTIVE_TIMEOUT_S = 120.0


def rank_threads(config: EngineConfig) -> int:
    """Torch threads of one rank: --threads (or every core) divided among the ranks."""
    total = config.threads or len(os.sched_getaffinity(0))
    return max(1, total // config.tensor_parallel_size)


def runner_config(
    config: EngineConfig, device: str, sized: bool = False, num_kv_blocks: int | None = None
) -> RunnerConfig:
    """The runner's configuration: execute's, the same on every tensor-parallel rank but for
    its device. `sized`: the KV cache takes what --gpu-memory-utilization leaves (one rank only,
    stages/config.py:sized_from_device_memory); `num_kv_blocks`: a count published before."""
    from gpu.runner import RunnerConfig

    return RunnerConfig(
        dtype=config.dtype,
        kv_cache_bytes=config.kv_cache_bytes,
        block_size=config.block_size,
        threads=rank_threads(config) if config.tensor_parallel_size > 1 else config.threads,
        device=device,
        seed=config.seed,
        quantization=config.quantization,
        kv_cache_dtype=config.kv_cache_dtype,
        random_weights=config.random_weights,
        gpu_memory_utilization=config.gpu_memory_utilization if sized else None,
        num_kv_blocks=num_kv_blocks,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=resolve_max_model_len(config),
        enforce_eager=config.enforce_eager,
        calculate_kv_scales=config.calculate_kv_scales,
        lora=config.lora,
    )


def hold_device(config: EngineConfig, log: structlog.typing.FilteringBoundLogger) -> str:
    """The torch device this rank runs on: on CUDA the (replica x TP + rank)-th device of
    CUDA_VISIBLE_DEVICES (stages/device.py), made current and logged."""
    if config.device != "cuda":
        log.info("execute device", device=config.device, rank=config.tensor_parallel_rank)
        return config.device
    import torch

    placement = cuda_placement(
        replica=config.data_parallel_rank,
        rank=config.tensor_parallel_rank,
        tensor_parallel_size=config.tensor_parallel_size,
        visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        device_count=torch.cuda.device_count(),
    )
    torch.cuda.set_device(placement.index)
    log.info(
        "execute device",
        device=placement.torch_device,
        rank=config.tensor_parallel_rank,
        cuda_visible_id=placement.visible_id,
        name=torch.cuda.get_device_name(placement.index),
    )
    return placement.torch_device


def join_group(config: EngineConfig, device: str = "cpu") -> TensorParallel:
    """Join the group as config.tensor_parallel_rank; returns once every rank has joined."""
    import torch.distributed as dist

    from gpu.tensor_parallel import TensorParallel

    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{config.master_addr}:{config.master_port}",
        world_size=config.tensor_parallel_size,
        rank=config.tensor_parallel_rank,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    log.info(
        "joined the tensor-parallel group",
        rank=config.tensor_parallel_rank,
        world_size=config.tensor_parallel_size,
        backend=backend,
        device=device,
        threads=rank_threads(config),
        master=f"{config.master_addr}:{config.master_port}",
    )
    return TensorParallel(config.tensor_parallel_rank, config.tensor_parallel_size)


def published_blocks(config: EngineConfig, tp: TensorParallel | None, device: str) -> int | None:
    """The KV block count a restarted pipeline allocates again (stages/kv_size.py); None at the
    first start, or when --kv-cache-memory sizes the cache. Under tensor parallelism rank 0 reads
    it and every rank takes its answer: a group in which some ranks sized their caches (a probe
    step run together) and others did not would wait for ever."""
    if not sized_from_device_memory(config):
        return None
    count = published_num_blocks(config) if tp is None or tp.samples else None
    if tp is not None:
        count = tp.from_first_rank(-1 if count is None else count, device)
        count = None if count < 0 else count
    return count


@contextlib.contextmanager
def lost_rank_is_peer_death() -> Iterator[None]:
    """A collective that failed because another rank died raises PeerDied, so that the rank
    which died, not this one, is named as the failure (pipeline.actor.PEER_DIED_EXIT_CODE)."""
    import torch.distributed as dist

    try:
        yield
    except RuntimeError as exc:
        text = str(exc)
        if isinstance(exc, dist.DistError) or "gloo" in text or "closed by peer" in text:
            raise PeerDied(f"the tensor-parallel group lost a rank: {text[:300]}") from exc
        raise


def forward_inputs(step: ForwardStep) -> ForwardInputs:
    """What a rank that does not sample hands its runner: the step as rank 0 made it (the two
    classes hold the same fields; gpu/ cannot import the ring's)."""
    from gpu.runner import ForwardInputs

    return ForwardInputs(**{name: getattr(step, name) for name in ForwardStep.__slots__})


def forward_sharer(forward: BroadcastWriter) -> Callable[[ForwardInputs], None]:
    """What rank 0 hands the runner: it sends a step's network inputs to the other ranks."""

    def share(inputs: ForwardInputs) -> None:
        step = ForwardStep(
            inputs.input_ids,
            inputs.positions,
            inputs.query_start_loc,
            inputs.context_lens,
            inputs.block_tables,
            inputs.slot_mapping,
            inputs.logits_rows,
            inputs.block_copies,
            inputs.lora_ids,
            inputs.lora_paths,
        )
        forward.send(FORWARD, pack_forward(step))

    return share
