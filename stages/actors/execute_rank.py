"""A tensor-parallel execute rank other than 0: it holds its shard of the model and KV cache
and runs every step's forward with rank 0, which sends it each step on the `forward` broadcast
ring, samples, and answers schedule."""

from __future__ import annotations

import time

from pipeline.actor import SyncActor
from pipeline.clock import now_ns
from stages import spans
from stages.actors.tensor_group import (
    forward_inputs,
    hold_device,
    join_group,
    lost_rank_is_peer_death,
    published_blocks,
    rank_threads,
    runner_config,
)
from stages.config import EngineConfig, sized_from_device_memory
from stages.rings.forward import unpack_forward


class ExecuteRankActor(SyncActor):
    def warm_up(self) -> None:
        import torch  # only the execute stage's processes import torch

        from gpu.runner import ModelRunner

        config: EngineConfig = self.ctx.config
        torch.set_num_threads(rank_threads(config))
        device = hold_device(config, self.ctx.log)
        tp = join_group(config, device)
        with lost_rank_is_peer_death():
            published = published_blocks(config, tp, device)
            sized = sized_from_device_memory(config)
            self.runner = ModelRunner.from_path(
                config.model_path, runner_config(config, device, sized, published), tp
            )

    def run(self) -> None:
        inbox, trace = self.ctx.broadcast_in["forward"], self.ctx.trace
        while True:
            waited = now_ns()
            _, arrays = inbox.recv()
            received = now_ns()
            step = unpack_forward(arrays)
            started, cpu = now_ns(), time.process_time_ns()
            with lost_rank_is_peer_death():
                self.runner.forward(forward_inputs(step))
            finished = now_ns()
            trace.record(
                spans.SPAN_FORWARD,
                started,
                finished,
                tokens=len(step.input_ids),
                wait_ns=received - waited,
                cpu_ns=time.process_time_ns() - cpu,
                lead_ns=started - received,
            )
            self.ctx.heartbeat()
