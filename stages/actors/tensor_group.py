"""How an execute rank joins its tensor-parallel group: torch.distributed's own TCP rendezvous
with torchrun's MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK (passed, not read from the
environment), gloo on CPU and NCCL on CUDA; and a lost rank told apart from a bug."""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import structlog

from pipeline.errors import PeerDied
from stages.config import EngineConfig

if TYPE_CHECKING:
    from gpu.tensor_parallel import TensorParallel

log = structlog.get_logger("stages.tensor_group")

# A collective that waits longer than this for a rank that is alive but stuck fails the group
# (a dead rank fails it at once: its sockets close).
COLLECTIVE_TIMEOUT_S = 120.0


def rank_threads(config: EngineConfig) -> int:
    """Torch threads of one rank: --threads (or every core) divided among the ranks."""
    total = config.threads or len(os.sched_getaffinity(0))
    return max(1, total // config.tensor_parallel_size)


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
