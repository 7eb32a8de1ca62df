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


def test_tokenizer_and_chat_template_flags(tiny_chat_model, tmp_path):
    """--tokenizer takes the vocabulary and template from another path, --chat-template
    replaces the template; both reach the stages through the snapshot."""
    import shutil

    other = tmp_path / "other-tokenizer"
    other.mkdir()
    shutil.copy(os.path.join(tiny_chat_model, "tokenizer.json"), other)
    (other / "tokenizer_config.json").write_text(
        '{"chat_template": "OTHER {{ messages[0].content }}", "eos_token": "<|im_end|>"}'
    )
    model_bundle = tokenizer_of(EngineConfig(model_path=tiny_chat_model))
    bundle = tokenizer_of(EngineConfig(model_path=tiny_chat_model, tokenizer=str(other)))
    assert bundle.chat_template == "OTHER {{ messages[0].content }}"
    assert model_bundle.chat_template != bundle.chat_template
    template = "{{ messages | length }} messages"
    replaced = tokenizer_of(
        EngineConfig(model_path=tiny_chat_model, tokenizer=str(other), chat_template=template)
    )
    assert replaced.chat_template == template
    write_snapshot(str(tmp_path), replaced, load_model_config(tiny_chat_model))
    staged = EngineConfig(model_path=tiny_chat_model, snapshot_dir=str(tmp_path))
    assert tokenizer_of(staged).chat_template == template
