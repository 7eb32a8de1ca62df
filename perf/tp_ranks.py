"""Tensor-parallel ranks for `pipeline-bench model`: the bench process is rank 0, and each other
rank is a process that runs every forward rank 0 shares on a broadcast ring, as the server's
execute.rank<k> stages do."""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist

from gpu.runner import ForwardInputs, ModelRunner, RunnerConfig
from gpu.tensor_parallel import TensorParallel
from pipeline.broadcast import BroadcastHandle, BroadcastSpec
from pipeline.errors import RingClosed
from pipeline.names import new_namespace
from stages.actors.tensor_group import forward_inputs, forward_sharer
from stages.rings.forward import FORWARD_VOCAB, unpack_forward

TIMEOUT = datetime.timedelta(seconds=600)


class RankGroup:
    """Ranks 1..N-1 in processes of their own and rank 0's runner here, joined over gloo."""

    def __init__(self, model_path: str, config: RunnerConfig, world_size: int) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        spec = BroadcastSpec("bench_forward", FORWARD_VOCAB, world_size - 1, 4, 1 << 20)
        self._handle = BroadcastHandle.create(new_namespace(), spec)
        ctx = multiprocessing.get_context("spawn")
        self._procs = [
            ctx.Process(
                target=_follow,
                args=(
                    model_path,
                    config,
                    rank,
                    world_size,
                    port,
                    self._handle.for_reader(rank - 1),
                ),
            )
            for rank in range(1, world_size)
        ]
        for proc in self._procs:
            proc.start()
        try:
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=0,
                world_size=world_size,
                timeout=TIMEOUT,
            )
            self._writer = self._handle.writer()
            self.runner = ModelRunner.from_path(model_path, config, TensorParallel(0, world_size))
        except BaseException:
            self.close()
            raise
        self.share: Callable[[ForwardInputs], None] = forward_sharer(self._writer)

    def close(self) -> None:
        """Close the ring (the other ranks exit on it), join them, leave the group."""
        with contextlib.suppress(AttributeError):
            self._writer.close()
        for proc in self._procs:
            proc.join(30)
            if proc.exitcode is None:
                proc.kill()
                proc.join()
        self._handle.unlink()
        if dist.is_initialized():
            dist.destroy_process_group()


def _follow(
    model_path: str,
    config: RunnerConfig,
    rank: int,
    world_size: int,
    port: int,
    handle: BroadcastHandle,
) -> None:
    if config.threads > 0:
        torch.set_num_threads(config.threads)
    reader = handle.reader_end()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=TIMEOUT,
    )
    runner = ModelRunner.from_path(model_path, config, TensorParallel(rank, world_size))
    with reader, contextlib.suppress(RingClosed):
        while True:
            step = unpack_forward(reader.recv()[1])
            runner.forward(forward_inputs(step))
    dist.destroy_process_group()
