"""A tiny random Llama checkpoint with a real byte-level BPE tokenizer and a ChatML template.

Built on the fly (nothing is downloaded): the tokenizer is trained on a small corpus so that its
merges are real, and the model's vocabulary matches it.
"""

from __future__ import annotations

import json
from pathlib import Path

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "What is the capital of France? Paris is the capital of France.",
    "Hello world! héllo wörld, 日本語のテキスト, emoji 🙂🚀 and numbers 1234567890.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "Streaming tokens through shared memory rings between processes.",
]


def build_tiny_chat_model(directory: Path, seed: int = 0, vocab_size: int = 384) -> Path:
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": CHATML,
                "eos_token": "<|im_end|>",
                "bos_token": None,
                "add_bos_token": False,
                "model_max_length": 512,
            }
        )
    )
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.token_to_id("<|im_end|>"),
        bos_token_id=None,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory
