"""The tokenizer built from a GGUF vocabulary, and from a Hugging Face directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from gpu.tokenizer import TokenizerLoadError, load_tokenizer

TEXTS = [
    "Hello, world!",
    "  leading   spaces\n\n\ttabs and\r\nCRLF",
    "héllo wörld ünïcödé façade naïve",
    "emoji 🤖🎉👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "中文测试，日本語のテキスト、한국어 텍스트",  # noqa: RUF001 - CJK punctuation on purpose
    "numbers 1234567890 3.14159 -42 1e-9 0x1F",
    "def f(x):\n    return x**2  # comment\n\nprint(f(3))\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "it's they're we'll I'd DON'T",
    "\u00a0\u200b odd\u2028spaces\u3000here",
    "a" * 40 + " " * 7 + "b",
    "",
]


@pytest.fixture(scope="module")
def gguf_bundle(smollm2_gguf):
    return load_tokenizer(smollm2_gguf)


def test_gguf_tokenizer_matches_transformers(smollm2_gguf, gguf_bundle):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(
        os.path.dirname(smollm2_gguf), gguf_file=os.path.basename(smollm2_gguf)
    )
    for text in TEXTS:
        assert gguf_bundle.encode(text) == reference(text, add_special_tokens=False).input_ids, text


def test_gguf_tokenizer_round_trips_and_keeps_specials_whole(gguf_bundle):
    for text in TEXTS:
        token_ids = gguf_bundle.encode(text)
        assert gguf_bundle.decode(token_ids) == text
        assert b"".join(gguf_bundle.token_bytes[i] for i in token_ids) == text.encode("utf-8")
    assert gguf_bundle.encode("<|im_start|>") == [1]
    assert gguf_bundle.decode(gguf_bundle.encode("<|im_end|>x"), skip_special_tokens=True) == "x"


def test_gguf_tokenizer_metadata(gguf_bundle):
    assert gguf_bundle.bos_token_id == 1
    assert gguf_bundle.eos_token_ids == (2,)
    assert gguf_bundle.pad_token_id == 2
    assert gguf_bundle.add_bos_token is False
    assert gguf_bundle.vocab_size == 49152
    assert {0, 1, 2} <= gguf_bundle.special_token_ids
    assert "<|im_start|>" in (gguf_bundle.chat_template or "")
    # A token holding part of a multi-byte character is its raw bytes, not text.
    partial = [
        i
        for i, b in enumerate(gguf_bundle.token_bytes[:5000])
        if b and b[0] >= 0xC0 and len(b) == 1
    ]
    assert partial


def test_tokenizer_module_does_not_import_torch(smollm2_gguf):
    code = (
        "import sys; from gpu.tokenizer import load_tokenizer; "
        f"load_tokenizer({smollm2_gguf!r}); assert 'torch' not in sys.modules"
    )
    subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )


def _write_hf_tokenizer(directory, add_bos: bool | None) -> None:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>", "<|eot|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(TEXTS * 3, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": {"content": "</s>"},
        "chat_template": "{{ messages }}",
    }
    if add_bos is not None:
        config["add_bos_token"] = add_bos
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))


def test_hf_directory_tokenizer(tmp_path):
    _write_hf_tokenizer(tmp_path, add_bos=True)
    bundle = load_tokenizer(str(tmp_path))
    assert bundle.bos_token_id == 0
    assert bundle.eos_token_ids == (1, 2)
    assert bundle.chat_template == "{{ messages }}"
    token_ids = bundle.encode("héllo 🤖 <|eot|>")
    assert token_ids[0] == 0 and token_ids[-1] == 2
    assert bundle.decode(token_ids[1:]) == "héllo 🤖 <|eot|>"
    assert b"".join(bundle.token_bytes[i] for i in token_ids[1:-1]) == "héllo 🤖 ".encode()


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerLoadError, match=r"tokenizer\.json"):
        load_tokenizer(str(tmp_path))


def test_sentencepiece_style_token_bytes(tmp_path):
    """Llama 2 / Mistral tokenizer.json: `▁` for spaces and `<0xNN>` byte-fallback tokens."""
    from tokenizers import normalizers

    text = "Hello wörld 🤖"
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{byte:02X}>": 3 + byte for byte in range(256)})
    for char in sorted(set("▁" + text.replace(" ", "").replace("🤖", ""))):
        vocab.setdefault(char, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True})
    )
    bundle = load_tokenizer(str(tmp_path))
    token_ids = bundle.encode(text)
    assert token_ids[0] == 1
    assert bundle.token_bytes[vocab["<0xF0>"]] == b"\xf0"
    assert b"".join(bundle.token_bytes[i] for i in token_ids[1:]) == (" " + text).encode("utf-8")
    assert bundle.decode(token_ids[1:]) == text
    assert bundle.eos_token_ids == (2,)
