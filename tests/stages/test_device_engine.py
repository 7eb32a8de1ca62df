"""The engine on a random-weight model whose KV cache execute sizes and publishes: schedule plans
the count execute made, a restarted pipeline keeps it, and the byte-level text streams."""

from __future__ import annotations

import json
import os
import signal

import pytest

from stages.api import GenerateRequest, SamplingParams, TextPrompt
from stages.config import EngineConfig, num_kv_blocks
from stages.engine import Engine
from stages.kv_size import published_num_blocks
from stages.text.random_model import write_random_checkpoint
from tests.stages.conftest import LoopThread


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


SHAPE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 300,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


async def collect(engine: Engine, text: str, max_tokens: int) -> list:
    request = GenerateRequest(
        "r", TextPrompt(text), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    )
    return [out async for out in engine.generate(request)]


def test_random_weights_serve_on_the_kv_blocks_execute_published(tmp_path):
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(json.dumps(SHAPE))
    _, model = write_random_checkpoint(str(tmp_path / "tiny" / "config.json"), str(tmp_path))
    config = EngineConfig(
        model_path=model,
        random_weights=True,
        # On CPU execute sizes the cache from kv_cache_bytes, and publishes it as on CUDA.
        gpu_memory_utilization=0.9,
        kv_cache_bytes=1 << 20,
        threads=1,
        log_format="json",
        log_level="warning",
    )
    engine = Engine(config)
    assert engine.num_blocks == 0  # not known before execute has made the cache
    loop = LoopThread()
    try:
        loop.run(engine.start())
        expected = num_kv_blocks(config)
        assert engine.num_blocks == expected
        assert published_num_blocks(engine.config) == expected
        outs = loop.run(collect(engine, "héllo 🙂 wörld", 16))
        assert outs[-1].num_output_tokens == 16 and outs[-1].finish_reason == "length"
        ids = [t for o in outs for t in o.token_ids]
        assert "".join(o.text for o in outs) == engine.bundle.decode(ids, skip_special_tokens=True)
        # A restarted pipeline allocates the published count again, and serves the same text.
        execute_pid = engine.supervisor.pids()["execute"]
        os.kill(execute_pid, signal.SIGKILL)
        again = loop.run(collect(engine, "héllo 🙂 wörld", 16))
        assert [t for o in again for t in o.token_ids] == ids
        assert engine.num_recoveries == 1
        assert published_num_blocks(engine.config) == expected
    finally:
        loop.run(engine.stop())
        loop.close()


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device")
def test_on_cuda_execute_sizes_the_cache_from_device_memory_and_serves(tmp_path):
    # KV blocks of 64 KiB: 5% of a large device is some 100k of them, not millions.
    shape = {**SHAPE, "hidden_size": 256, "num_hidden_layers": 4, "num_key_value_heads": 4}
    (tmp_path / "small").mkdir()
    (tmp_path / "small" / "config.json").write_text(json.dumps(shape))
    _, model = write_random_checkpoint(str(tmp_path / "small" / "config.json"), str(tmp_path))
    config = EngineConfig(
        model_path=model,
        random_weights=True,
        device="cuda",
        dtype="bfloat16",
        gpu_memory_utilization=0.05,
        max_num_seqs=8,
        log_format="json",
        log_level="warning",
    )
    engine = Engine(config)
    loop = LoopThread()
    try:
        loop.run(engine.start(), timeout=600)
        # 5% of the device, nearly all of it KV cache for so small a model
        assert engine.num_blocks > 1000
        outs = loop.run(collect(engine, "héllo 🙂 wörld", 32))  # decode steps replay graphs
        assert outs[-1].num_output_tokens == 32
        again = loop.run(collect(engine, "héllo 🙂 wörld", 32))
        assert [t for o in again for t in o.token_ids] == [t for o in outs for t in o.token_ids]
    finally:
        loop.run(engine.stop())
        loop.close()
