"""The model's tokenizer and config as the engine read them, written once for its stages.

Reading them from a GGUF takes seconds (gguf's reader parses a 49k-token vocabulary and its
merges in Python), and render, schedule and detokenize each need them: from the engine's
snapshot a stage gets them in a fraction of that, so a pipeline restarted after a stage failure
comes back sooner. The files live in a directory the engine owns and removes at stop.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

import msgspec

from stages.text.checkpoint import ModelConfig, load_model_config
from stages.text.tokenizer import TokenizerBundle, load_tokenizer

if TYPE_CHECKING:
    from stages.config import EngineConfig

_TOKENIZER_FILE = "tokenizer.msgpack"
_MODEL_CONFIG_FILE = "model_config.msgpack"


def write_snapshot(directory: str, bundle: TokenizerBundle, model: ModelConfig) -> None:
    fields: dict[str, Any] = {name: getattr(bundle, name) for name in TokenizerBundle.__slots__}
    fields["tokenizer"] = bundle.tokenizer.to_str()
    fields["special_token_ids"] = sorted(bundle.special_token_ids)
    with open(os.path.join(directory, _TOKENIZER_FILE), "wb") as f:
        f.write(msgspec.msgpack.encode(fields))
    with open(os.path.join(directory, _MODEL_CONFIG_FILE), "wb") as f:
        f.write(msgspec.msgpack.encode(model))


def tokenizer_of(config: EngineConfig) -> TokenizerBundle:
    """The model's tokenizer: from the engine's snapshot when there is one, else from
    --tokenizer or the model, with --chat-template in place of its template."""
    if not config.snapshot_dir:
        bundle = load_tokenizer(config.tokenizer or config.model_path)
        if config.chat_template is None:
            return bundle
        return dataclasses.replace(bundle, chat_template=config.chat_template)
    from tokenizers import Tokenizer

    with open(os.path.join(config.snapshot_dir, _TOKENIZER_FILE), "rb") as f:
        fields = msgspec.msgpack.decode(f.read())
    fields["tokenizer"] = Tokenizer.from_str(fields["tokenizer"])
    fields["special_token_ids"] = frozenset(fields["special_token_ids"])
    fields["eos_token_ids"] = tuple(fields["eos_token_ids"])
    fields["token_bytes"] = tuple(fields["token_bytes"])
    return TokenizerBundle(**fields)


def model_config_of(config: EngineConfig) -> ModelConfig:
    """The model's config: from the engine's snapshot when there is one."""
    if not config.snapshot_dir:
        return load_model_config(config.model_path)
    with open(os.path.join(config.snapshot_dir, _MODEL_CONFIG_FILE), "rb") as f:
        return msgspec.msgpack.decode(f.read(), type=ModelConfig)
