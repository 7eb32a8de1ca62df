"""The model's tokenizer, from a Hugging Face directory or a GGUF file, without torch.

The render and detokenize processes import this module, so it must stay torch-free.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cache
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

# GGUF token types (llama.cpp's llama_token_type).
_GGUF_TOKEN_CONTROL = 3
_GGUF_TOKEN_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` names whose split regex differs from GPT-2's. The GPT-2 regex itself is the
# one built into `pre_tokenizers.ByteLevel(use_regex=True)`, used by "gpt2", "smollm", "starcoder"
# and "default".
_GGUF_SPLIT_REGEX = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_GGUF_GPT2_REGEX_PRE = frozenset({"gpt2", "smollm", "starcoder", "default", "refact", "olmo"})


class TokenizerLoadError(ValueError):
    """The model's tokenizer is missing or of a kind this server cannot build."""


@dataclass(slots=True, frozen=True)
class TokenizerBundle:
    """Everything render and detokenize need to know about the vocabulary.

    `tokenizer` never adds special tokens by itself (its post-processor is cleared); `encode`
    prepends BOS when `add_bos_token` says so. `token_bytes[i]` is the exact byte string of token
    i (special tokens as their UTF-8 text), for incremental detokenization across UTF-8 boundaries.
    """

    tokenizer: Tokenizer
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    add_bos_token: bool
    special_token_ids: frozenset[int]
    chat_template: str | None
    vocab_size: int
    token_bytes: tuple[bytes, ...]
    bos_token: str | None
    eos_token: str | None

    # The *_batch calls, of one item: tokenizers releases the GIL for those and holds it through
    # `encode` and `decode`, so a long text tokenized in a worker thread would stop every other
    # thread of the process (an event loop's among them) for as long as it takes.

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of `text` (BOS first when `add_bos` and the model wants one); special-token
        text like `<|im_start|>` maps to its single id."""
        ids = self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        if add_bos and self.add_bos_token and self.bos_token_id is not None:
            return [self.bos_token_id, *ids]
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode_batch([token_ids], skip_special_tokens=skip_special_tokens)[0]

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each id's vocabulary entry as the tokenizer spells it (byte-level `Ġ` for a space, as
        transformers' convert_ids_to_tokens gives them)."""
        return [self.tokenizer.id_to_token(token_id) or "" for token_id in token_ids]

    def info(self, max_model_len: int) -> dict[str, Any]:
        """vLLM's /tokenizer_info document, from what this server knows of the tokenizer: the
        class transformers builds from a tokenizer.json, the special tokens, the chat template."""
        special = sorted(self.special_token_ids)
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": self.add_bos_token,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": None
            if self.pad_token_id is None
            else self.tokenizer.id_to_token(self.pad_token_id),
            "chat_template": self.chat_template,
            "model_max_length": max_model_len,
            "vocab_size": self.vocab_size,
            "added_tokens_decoder": {
                str(token_id): {"content": self.tokenizer.id_to_token(token_id), "special": True}
                for token_id in special
            },
        }


def load_tokenizer(model_path: str) -> TokenizerBundle:
    """The tokenizer of a Hugging Face model directory or of a `.gguf` file."""
    if os.path.isfile(model_path) and model_path.endswith(".gguf"):
        return _load_gguf_tokenizer(model_path)
    if os.path.isdir(model_path):
        return _load_hf_tokenizer(model_path)
    raise TokenizerLoadError(f"no model at {model_path!r}: expected a directory or a .gguf file")


@cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}


@cache
def _unicode_to_bytes() -> dict[str, int]:
    return {char: byte for byte, char in _bytes_to_unicode().items()}


def _byte_level_bytes(token: str) -> bytes:
    table = _unicode_to_bytes()
    if all(char in table for char in token):
        return bytes(table[char] for char in token)
    return token.encode("utf-8")


def _sentencepiece_bytes(token: str) -> bytes:
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        return bytes([int(token[3:5], 16)])
    return token.replace("\u2581", " ").encode("utf-8")


def _token_bytes(tokenizer: Tokenizer, special_ids: frozenset[int]) -> tuple[bytes, ...]:
    decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
    byte_level = _mentions_byte_level(decoder)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    out: list[bytes] = []
    for token_id in range(size):
        token = tokenizer.id_to_token(token_id)
        if token is None:
            out.append(b"")
        elif token_id in special_ids:
            out.append(token.encode("utf-8"))
        elif byte_level:
            out.append(_byte_level_bytes(token))
        else:
            out.append(_sentencepiece_bytes(token))
    return tuple(out)


def _mentions_byte_level(decoder: dict[str, Any]) -> bool:
    if decoder.get("type") == "ByteLevel":
        return True
    return any(_mentions_byte_level(d) for d in decoder.get("decoders") or ())


def _gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _load_gguf_tokenizer(path: str) -> TokenizerBundle:
    from stages.text.checkpoint import open_gguf

    reader = open_gguf(path)
    kind = _gguf_field(reader, "tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise TokenizerLoadError(
            f"GGUF tokenizer model {kind!r} in {path!r} is not supported; byte-level BPE "
            "('gpt2') and SentencePiece BPE ('llama') vocabularies are. Use the Hugging Face "
            "directory instead."
        )
    tokens: list[str] = _gguf_field(reader, "tokenizer.ggml.tokens")
    token_types: list[int] = _gguf_field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "llama":
        tokenizer = _sentencepiece_bpe(reader, tokens)
        return _gguf_bundle(reader, tokenizer, tokens, token_types, byte_level=False)
    merges: list[str] = _gguf_field(reader, "tokenizer.ggml.merges") or []
    pre = _gguf_field(reader, "tokenizer.ggml.pre", "default")

    alphabet = set(_bytes_to_unicode().values())
    spelling = _bytes_to_unicode()
    vocab = {}
    for index, token in enumerate(tokens):
        if not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab[token] = index
    pairs = [(left, right) for left, _, right in (merge.partition(" ") for merge in merges)]
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
    )
    if pre in _GGUF_SPLIT_REGEX:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_GGUF_SPLIT_REGEX[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre in _GGUF_GPT2_REGEX_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        raise TokenizerLoadError(
            f"GGUF pre-tokenizer {pre!r} in {path!r} is not supported; known: "
            f"{sorted(_GGUF_GPT2_REGEX_PRE | set(_GGUF_SPLIT_REGEX))}"
        )
    tokenizer.decoder = decoders.ByteLevel()
    return _gguf_bundle(reader, tokenizer, tokens, token_types, byte_level=True)


def _sentencepiece_bpe(reader: Any, tokens: list[str]) -> Tokenizer:
    """A SentencePiece BPE vocabulary (Llama 1/2, Mistral v0.1 files: `tokenizer.ggml.model` is
    "llama") as a `tokenizers` BPE with byte fallback, built as transformers builds it from the
    same file: the merges come from the file or, as these files have none, from the vocabulary
    (every split of a token into two tokens, best score first); `▁` marks spaces and is put
    before the text's start unless the file says `add_space_prefix` is false. Like transformers
    (the reference), and unlike sentencepiece and llama.cpp, no `▁` is added before text that
    already starts with a space."""
    vocab = {token: index for index, token in enumerate(tokens)}
    listed: list[str] | None = _gguf_field(reader, "tokenizer.ggml.merges")
    if listed:
        merges = [(left, right) for left, _, right in (m.partition(" ") for m in listed)]
    else:
        scores: list[float] = _gguf_field(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
        merges = _merges_from_scores(vocab, dict(zip(tokens, scores, strict=True)))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
    add_prefix = bool(_gguf_field(reader, "tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if add_prefix else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies: each token that is two tokens joined, ranked
    by its score (higher merges first), ties in vocabulary order (transformers' generate_merges)."""
    found: list[tuple[str, str, float]] = []
    for merged, score in scores.items():
        local = [
            (merged[:i], merged[i:], score)
            for i in range(1, len(merged))
            if merged[:i] in vocab and merged[i:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        found.extend(local)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _gguf_bundle(
    reader: Any, tokenizer: Tokenizer, tokens: list[str], token_types: list[int], byte_level: bool
) -> TokenizerBundle:
    """The GGUF's special tokens added to `tokenizer`, and the bundle around it."""
    # In a byte-level vocabulary every real token is spelled in the byte alphabet: a "control"
    # token outside it is a llama.cpp mislabel that would grow the vocabulary past the model's.
    alphabet = set(_bytes_to_unicode().values()) if byte_level else None
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, kind_id in zip(tokens, token_types, strict=True)
        if kind_id == _GGUF_TOKEN_CONTROL and (alphabet is None or set(token) <= alphabet)
    ]
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, kind_id in zip(tokens, token_types, strict=True)
        if kind_id == _GGUF_TOKEN_USER_DEFINED
    ]
    tokenizer.add_special_tokens(control)
    tokenizer.add_tokens(user_defined)
    special_ids = frozenset(_ids_of(tokenizer, [t.content for t in control]))

    bos = _gguf_field(reader, "tokenizer.ggml.bos_token_id")
    eos = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
    eot = _gguf_field(reader, "tokenizer.ggml.eot_token_id")
    eos_ids = tuple(dict.fromkeys(int(i) for i in (eos, eot) if i is not None))
    pad = _gguf_field(reader, "tokenizer.ggml.padding_token_id")
    return TokenizerBundle(
        tokenizer=tokenizer,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
        pad_token_id=None if pad is None else int(pad),
        # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise
        add_bos_token=bool(_gguf_field(reader, "tokenizer.ggml.add_bos_token", not byte_level)),
        special_token_ids=special_ids,
        chat_template=_gguf_field(reader, "tokenizer.chat_template"),
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        token_bytes=_token_bytes(tokenizer, special_ids),
        bos_token=None if bos is None else tokens[int(bos)],
        eos_token=None if eos is None else tokens[int(eos)],
    )


def _ids_of(tokenizer: Tokenizer, tokens: list[str]) -> list[int]:
    ids = (tokenizer.token_to_id(token) for token in tokens)
    return [token_id for token_id in ids if token_id is not None]


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _chat_template(directory: str, tokenizer_config: dict[str, Any]) -> str | None:
    jinja_path = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read()
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template}
        return named.get("default") or next(iter(named.values()), None)
    return template


def _load_hf_tokenizer(directory: str) -> TokenizerBundle:
    tokenizer_path = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(tokenizer_path):
        raise TokenizerLoadError(f"{directory!r} has no tokenizer.json")
    tokenizer = Tokenizer.from_file(tokenizer_path)
    tokenizer_config = _read_json(os.path.join(directory, "tokenizer_config.json"))
    generation_config = _read_json(os.path.join(directory, "generation_config.json"))
    model_config = _read_json(os.path.join(directory, "config.json"))

    bos_token = _token_text(tokenizer_config.get("bos_token"))
    eos_token = _token_text(tokenizer_config.get("eos_token"))
    pad_token = _token_text(tokenizer_config.get("pad_token"))
    bos_id = tokenizer.token_to_id(bos_token) if bos_token else None
    if bos_id is None:
        bos_id = generation_config.get("bos_token_id", model_config.get("bos_token_id"))

    eos_ids: list[int] = []
    for source in (generation_config, model_config):
        value = source.get("eos_token_id")
        if value is not None:
            eos_ids.extend(value if isinstance(value, list) else [value])
    eos_token_id = tokenizer.token_to_id(eos_token) if eos_token else None
    if eos_token_id is not None:
        eos_ids.insert(0, eos_token_id)
    pad_id = tokenizer.token_to_id(pad_token) if pad_token else None

    add_bos = tokenizer_config.get("add_bos_token")
    if add_bos is None:
        # No flag: the post-processor in tokenizer.json decides (Llama 3 adds BOS there).
        probe = tokenizer.encode("a", add_special_tokens=True).ids
        add_bos = bos_id is not None and bool(probe) and probe[0] == bos_id
    tokenizer.post_processor = None

    added = tokenizer.get_added_tokens_decoder().values()
    special_ids = frozenset(_ids_of(tokenizer, [t.content for t in added if t.special]))
    return TokenizerBundle(
        tokenizer=tokenizer,
        bos_token_id=None if bos_id is None else int(bos_id),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos_ids)),
        pad_token_id=pad_id,
        add_bos_token=bool(add_bos),
        special_token_ids=special_ids,
        chat_template=_chat_template(directory, tokenizer_config),
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        token_bytes=_token_bytes(tokenizer, special_ids),
        bos_token=bos_token,
        eos_token=eos_token,
    )
