"""The engine's snapshot of the tokenizer and model config gives the stages what the model gives."""

from __future__ import annotations

import os

from stages.config import EngineConfig
from stages.text.checkpoint import load_model_config
from stages.text.snapshot import model_config_of, tokenizer_of, write_snapshot
from stages.text.tokenizer import load_tokenizer


def test_the_snapshot_reads_back_the_gguf_tokenizer_and_config(smollm2_gguf, tmp_path):
    bundle, model = load_tokenizer(smollm2_gguf), load_model_config(smollm2_gguf)
    write_snapshot(str(tmp_path), bundle, model)
    config = EngineConfig(model_path=smollm2_gguf, snapshot_dir=str(tmp_path))
    back = tokenizer_of(config)
    text = "Héllo <|im_start|>user\n🤖 wörld<|im_end|>"
    assert back.encode(text) == bundle.encode(text)
    assert back.decode(bundle.encode(text)) == text
    for name in ("bos_token_id", "eos_token_ids", "special_token_ids", "chat_template"):
        assert getattr(back, name) == getattr(bundle, name), name
    assert back.token_bytes == bundle.token_bytes and back.vocab_size == bundle.vocab_size
    assert model_config_of(config) == model


def test_the_engine_removes_its_snapshot_when_it_stops(tiny_chat_model):
    import asyncio

    from stages.engine import Engine

    engine = Engine(EngineConfig(model_path=tiny_chat_model, dummy=True, log_level="error"))
    snapshot = engine.config.snapshot_dir
    assert os.path.isdir(snapshot)
    asyncio.run(engine.stop())
    assert not os.path.exists(snapshot)
