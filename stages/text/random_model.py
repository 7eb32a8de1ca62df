"""Checkpoints of a model's shape without its weights (`--random-weights`): a config.json of a
preset (Llama-3-8B, Llama-3.2-1B, Qwen2.5-0.5B, with the real configs' values) or of a file, and a
byte-level tokenizer with a chat template that encodes and decodes any text. Execute makes the
weights on the device (gpu/random_weights.py). Torch-free: the server writes the directory."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import tempfile
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from stages.text.checkpoint import ModelConfig, config_from_hf
from stages.text.tokenizer import _bytes_to_unicode

_LLAMA3 = {"rms_norm_eps": 1e-05, "rope_theta": 500000.0, "vocab_size": 128256}
# The config.json values of the real checkpoints that shape a model (meta-llama/Meta-Llama-3-8B,
# meta-llama/Llama-3.2-1B, Qwen/Qwen2.5-0.5B).
PRESETS: dict[str, dict[str, Any]] = {
    "llama-3-8b": {
        "architectures": ["LlamaForCausalLM"],
        **_LLAMA3,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
    },
    "llama-3-1b": {
        "architectures": ["LlamaForCausalLM"],
        **_LLAMA3,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 131072,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": True,
    },
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "sliding_window": 32768,
        "use_sliding_window": False,
        "tie_word_embeddings": True,
    },
}

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def random_model_config(spec: str) -> tuple[str, dict[str, Any]]:
    """(name, config.json dict) of a preset name or of a config.json file's path."""
    if spec in PRESETS:
        return spec, PRESETS[spec]
    if os.path.isfile(spec):
        with open(spec, encoding="utf-8") as f:
            raw = json.load(f)
        name = os.path.basename(os.path.dirname(os.path.abspath(spec))) or "random"
        return name, raw
    raise ValueError(f"{spec!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json file")


def parameter_count(config: ModelConfig) -> int:
    """Parameters of a model of this shape (the LM head counted once when tied)."""
    h, q, kv = config.hidden_size, config.q_size, config.kv_size
    attention = h * (q + 2 * kv) + q * h + (q + 2 * kv if config.attention_bias else 0)
    layer = attention + 3 * h * config.intermediate_size + 2 * h
    embedding = config.vocab_size * h
    head = 0 if config.tie_word_embeddings else embedding
    return embedding + config.num_layers * layer + h + head


def byte_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE without merges: every byte is a token (ids 0-255), so any byte string
    encodes and decodes back; then SPECIAL_TOKENS, then filler tokens (two or three bytes each,
    never produced by encoding) up to the model's vocabulary, so that every id it samples decodes."""
    byte_chars = [_bytes_to_unicode()[b] for b in range(256)]
    needed = vocab_size - 256 - len(SPECIAL_TOKENS)
    if needed < 0:
        raise ValueError(f"a vocabulary of {vocab_size} cannot hold the 256 bytes and the specials")
    fillers = itertools.chain(
        itertools.product(byte_chars, repeat=2), itertools.product(byte_chars, repeat=3)
    )
    vocab = {char: i for i, char in enumerate(byte_chars)}
    vocab.update((token, 256 + i) for i, token in enumerate(SPECIAL_TOKENS))
    start = 256 + len(SPECIAL_TOKENS)
    vocab.update(
        ("".join(chars), start + i) for i, chars in enumerate(itertools.islice(fillers, needed))
    )
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t in SPECIAL_TOKENS]
    )
    return tokenizer


def write_random_checkpoint(spec: str, root: str | None = None) -> tuple[str, str]:
    """(name, directory) of a weightless checkpoint of `spec`: config.json, tokenizer.json and
    tokenizer_config.json. The directory is named by the config's digest under `root` (the
    system's temporary directory), so the same shape reuses it."""
    name, raw = random_model_config(spec)
    model = config_from_hf(raw)  # refuses an architecture this server does not run
    digest = hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()[:12]
    directory = os.path.join(root or tempfile.gettempdir(), f"pipeline-serve-random-{digest}")
    if os.path.isfile(os.path.join(directory, "tokenizer_config.json")):
        return name, directory
    staging = tempfile.mkdtemp(
        prefix=f"{os.path.basename(directory)}.", dir=os.path.dirname(directory)
    )
    with open(os.path.join(staging, "config.json"), "w", encoding="utf-8") as f:
        json.dump(raw, f, indent=2)
    byte_tokenizer(model.vocab_size).save(os.path.join(staging, "tokenizer.json"))
    with open(os.path.join(staging, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(
            {"eos_token": EOS_TOKEN, "add_bos_token": False, "chat_template": CHAT_TEMPLATE}, f
        )
    try:
        os.rename(staging, directory)
    except OSError:  # another process wrote it first: theirs is the same
        for file_name in os.listdir(staging):
            os.remove(os.path.join(staging, file_name))
        os.rmdir(staging)
    return name, directory
