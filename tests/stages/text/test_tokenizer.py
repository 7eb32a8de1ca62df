"""The tokenizer built from a GGUF vocabulary, and from a Hugging Face directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from stages.text.tokenizer import TokenizerLoadError, load_tokenizer

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
        # vLLM's /tokenize token_strs are transformers' convert_ids_to_tokens
        ids = gguf_bundle.encode(text)
        assert gguf_bundle.token_strings(ids) == reference.convert_ids_to_tokens(ids), text


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


def test_tokenizer_info_has_what_vllm_reports(gguf_bundle):
    info = gguf_bundle.info(max_model_len=8192)
    assert info["tokenizer_class"] and info["model_max_length"] == 8192
    assert (info["bos_token"], info["eos_token"], info["pad_token"]) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    assert info["chat_template"] == gguf_bundle.chat_template
    assert info["added_tokens_decoder"]["1"] == {"content": "<|im_start|>", "special": True}
    assert info["add_bos_token"] is False


def test_tokenizer_module_does_not_import_torch(smollm2_gguf):
    code = (
        "import sys; from stages.text.tokenizer import load_tokenizer; "
        f"load_tokenizer({smollm2_gguf!r}); assert 'torch' not in sys.modules"
    )
    subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))),
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


# -- SentencePiece vocabularies (Llama 1/2, Mistral v0.1 GGUFs: tokenizer.ggml.model = "llama") ----

SPM_CORPUS = [
    *TEXTS[:-1],
    "The quick brown fox jumps over the lazy dog.",
    "Llamas are members of the camelid family; they live in the Andes.",
    "print('hello')  # a comment, with   three spaces",
    "Numbers like 2024, 3.5 and 1000000 are split into digits.",
]


def write_spm_gguf(directory, add_space_prefix: bool | None = None) -> str:
    """A GGUF holding a SentencePiece BPE vocabulary trained here, written as llama.cpp's converter
    writes Llama 2's: pieces, scores, token types (normal 1, unknown 2, control 3, byte 6)."""
    import gguf
    import numpy as np
    import sentencepiece as spm

    corpus = directory / "corpus.txt"
    corpus.write_text("\n".join(SPM_CORPUS * 20), encoding="utf-8")
    prefix = str(directory / "spm")
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=prefix,
        model_type="bpe",
        vocab_size=420,
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        user_defined_symbols=["<|user|>"],
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_file=prefix + ".model")
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(
            2
            if sp.is_unknown(i)
            else 3
            if sp.is_control(i)
            else 6
            if sp.is_byte(i)
            else 4
            if tokens[-1] == "<|user|>"
            else 1
        )
    path = directory / "spm.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (
        ("block_count", 1),
        ("embedding_length", 8),
        ("feed_forward_length", 16),
        ("attention.head_count", 2),
        ("context_length", 64),
    ):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory) -> str:
    return write_spm_gguf(tmp_path_factory.mktemp("spm"))


def test_sentencepiece_gguf_matches_transformers_and_sentencepiece(spm_gguf):
    import sentencepiece as spm
    from transformers import AutoTokenizer

    bundle = load_tokenizer(spm_gguf)
    reference = AutoTokenizer.from_pretrained(
        os.path.dirname(spm_gguf), gguf_file=os.path.basename(spm_gguf)
    )
    sp = spm.SentencePieceProcessor(model_file=os.path.join(os.path.dirname(spm_gguf), "spm.model"))
    texts = [t for t in TEXTS if "<|im_" not in t] + SPM_CORPUS[-4:] + ["<|user|>hi <s>x</s>"]
    for text in texts:
        ids = bundle.encode(text)
        assert ids == reference(text).input_ids, text  # BOS included: llama.cpp's default here
        assert ids[0] == 1 and bundle.add_bos_token
        # sentencepiece itself knows no added tokens in text; and on text that starts with a space
        # it (and llama.cpp) puts one more "▁" in front than transformers' Metaspace does
        if "<" not in text and not text.startswith(" "):
            assert ids[1:] == sp.encode(text), text
        decoded = bundle.decode(ids, skip_special_tokens=True)
        assert decoded == reference.decode(ids, skip_special_tokens=True)
        if text.startswith(" "):  # the leading space is the prefix, which decoding strips
            assert decoded == text[1:]
            continue
        assert decoded == text.replace("</s>", "").replace("<s>", "")  # control tokens skipped
        if "<" not in text:
            # exact bytes per token (byte-fallback pieces included), with the prefix space
            raw = b"".join(bundle.token_bytes[i] for i in ids[1:])
            assert raw == (b" " + text.encode("utf-8") if text else b""), text
    assert bundle.encode("<|user|>")[1:] == [bundle.tokenizer.token_to_id("<|user|>")]
    assert {0, 1, 2} <= bundle.special_token_ids or {1, 2} <= bundle.special_token_ids
    assert bundle.eos_token_ids == (2,) and bundle.bos_token == "<s>"


def test_sentencepiece_gguf_without_space_prefix(tmp_path):
    bundle = load_tokenizer(write_spm_gguf(tmp_path, add_space_prefix=False))
    assert (
        not bundle.tokenizer.encode("quick fox", add_special_tokens=False)
        .tokens[0]
        .startswith("\u2581")
    )
    assert bundle.decode(bundle.encode("quick fox"), skip_special_tokens=True) == "quick fox"


def test_an_unsupported_gguf_vocabulary_is_a_clear_error(tmp_path):
    import gguf

    path = tmp_path / "bert.gguf"
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_tokenizer_model("bert")
    writer.add_token_list(["[PAD]", "a"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(TokenizerLoadError, match=r"'bert'.*not supported"):
        load_tokenizer(str(path))
