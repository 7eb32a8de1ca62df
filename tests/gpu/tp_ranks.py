"""Process entry of the tensor-parallel tests: one rank joins a gloo group and runs a script of
steps (importable, as spawn requires)."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from gpu.runner import ForwardInputs, ModelRunner, RunnerConfig
from gpu.tensor_parallel import TensorParallel
from tests.gpu.paged import BlockPool, PagedSequence, build_step

RUNNER = RunnerConfig(kv_cache_bytes=1 << 20, block_size=4, threads=1)


def script(
    prompts: list[list[int]], vocab_size: int, steps: int, chunk: int
) -> list[ForwardInputs]:
    """Steps that prefill the prompts in chunks of `chunk` tokens, decoding the sequences whose
    prompt is done in the same steps (mixed batches), every row's logits asked for."""
    pool = BlockPool(64, RUNNER.block_size)
    seqs = [PagedSequence(list(p)) for p in prompts]
    out = []
    for step in range(steps):
        chunks = []
        for i, seq in enumerate(seqs):
            left = len(seq.token_ids) - seq.num_cached
            if left == 0:
                seq.token_ids.append((31 * step + 7 * i) % vocab_size)
                left = 1
            chunks.append((seq, min(chunk, left)))
        b = build_step(pool, chunks)
        out.append(
            ForwardInputs(
                b.input_ids,
                b.positions,
                b.query_start_loc,
                b.context_lens,
                b.block_tables,
                b.slot_mapping,
                np.arange(len(b.input_ids), dtype=np.int64),
            )
        )
    return out


def run_rank(
    path: str,
    rank: int,
    world: int,
    port: int,
    steps: list[ForwardInputs],
    results,  # type: ignore[no-untyped-def]
    config: RunnerConfig = RUNNER,
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        runner = ModelRunner.from_path(path, config, TensorParallel(rank, world))
        logits = [runner.forward(inputs).numpy() for inputs in steps]
        results.put((rank, runner.kv_cache.layers[0][0].shape[2], logits if rank == 0 else None))
    finally:
        dist.destroy_process_group()


def agree_on_blocks(
    rank: int, world: int, port: int, figures: list, snapshot_dir: str, results
) -> None:  # type: ignore[no-untyped-def]
    """Each rank sizes a KV cache from its own device's figures (`figures[case][rank]`: a
    DeviceMemory), and reads the block count a restarted group allocates; puts what it got."""
    from gpu.runner import agreed_kv_blocks
    from stages.actors.tensor_group import published_blocks
    from stages.config import EngineConfig
    from stages.kv_size import publish_num_blocks

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    tp = TensorParallel(rank, world)
    try:
        got: list = []
        for case in figures:
            try:
                got.append(agreed_kv_blocks(case[rank], 0.9, 1 << 20, tp, "cpu"))
            except ValueError as error:
                got.append(str(error))
        config = EngineConfig(
            model_path="model", gpu_memory_utilization=0.9, snapshot_dir=snapshot_dir
        )
        got.append(published_blocks(config, tp, "cpu"))  # the first start: none
        dist.barrier()
        if rank == 0:
            publish_num_blocks(config, 1234)
        dist.barrier()
        got.append(published_blocks(config, tp, "cpu"))
        results.put((rank, got))
    finally:
        dist.destroy_process_group()


def load_peak(path: str, rank: int, world: int, results) -> None:  # type: ignore[no-untyped-def]
    """Load a rank's shard as a device does (gpu.runner.load_shard; loading runs no collective,
    so no group is joined) while a thread samples the process's anonymous memory (what torch
    allocates; the checkpoint's mapped file pages are not in it); put the peak's growth and the
    bytes of the parameters kept."""
    import threading
    import time

    from gpu.backends import TORCH_KERNELS
    from gpu.runner import load_shard
    from stages.text.checkpoint import load_model_config

    def anonymous_bytes() -> int:
        with open("/proc/self/status") as f:
            line = next(line for line in f if line.startswith("RssAnon:"))
        return int(line.split()[1]) * 1024

    torch.set_num_threads(1)
    # The first random init on the meta device imports torch's Python references (~80 MB
    # once per process): not the model's.
    with torch.device("meta"):
        torch.nn.Embedding(2, 2)
    config = load_model_config(path)
    before, peak, done = anonymous_bytes(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], anonymous_bytes())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        model, _ = load_shard(
            path, config, TORCH_KERNELS, "cpu", torch.float32, TensorParallel(rank, world)
        )
    finally:
        done.set()
        sampler.join()
    kept = sum(p.numel() * p.element_size() for p in model.parameters())
    results.put((rank, peak[0] - before, kept))
