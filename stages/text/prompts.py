"""From a request's prompt to token ids: the chat template, tokenization, truncation and length
checks, and the bad words as token sequences. Errors a client caused are EngineErrors."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from stages.api import ChatPrompt, EngineError, Prompt, TextPrompt, TokensPrompt
from stages.text.chat import render_chat
from stages.text.template_sandbox import TemplateSandbox
from stages.text.tokenizer import TokenizerBundle

# Normalizers that never shorten text, and those that shorten it by at most a factor of three
# (Unicode composition: a Hangul syllable from three jamo); pre-tokenizers that drop no text.
# Any other may drop text outright (Strip, WhitespaceSplit), and then no length is too long.
_LENGTH_KEEPING = frozenset({"Prepend", "NFD", "NFKD", "Lowercase", "ByteLevel"})
_COMPOSING = frozenset({"NFC", "NFKC"})
_KEEPING_SPLITS = frozenset({"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"})


@dataclass(slots=True, frozen=True)
class LengthBound:
    """Refuses, before it is tokenized, text that cannot fit in max_model_len tokens: a token
    stands for at most `chars_per_token` characters, so longer text has too many tokens."""

    max_model_len: int
    chars_per_token: int

    @classmethod
    def of(cls, bundle: TokenizerBundle, max_model_len: int) -> LengthBound | None:
        """The bound for this vocabulary: its longest token's bytes (a character is at least
        one), times what its normalizer may shorten text by; None when that is unbounded."""
        described = json.loads(bundle.tokenizer.to_str())
        shrink = _normalizer_shrink(described.get("normalizer"))
        if shrink is None or not _keeps_text(described.get("pre_tokenizer")):
            return None
        return cls(max_model_len, shrink * max(map(len, bundle.token_bytes), default=1))

    def check(self, text: str, param: str) -> None:
        if len(text) >= self.max_model_len * self.chars_per_token:
            raise EngineError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your request has {len(text)} characters of input, more than {self.max_model_len}"
                " tokens can hold. Please reduce the length of the input.",
                param=param,
                code="context_length_exceeded",
            )


def _normalizer_shrink(normalizer: dict[str, Any] | None) -> int | None:
    """By how much a tokenizer's normalizer may shorten text at most (None: without bound)."""
    if normalizer is None or normalizer.get("type") in _LENGTH_KEEPING:
        return 1
    kind = normalizer.get("type")
    if kind in _COMPOSING:
        return 3
    if kind == "Replace":  # SentencePiece's " " -> "\u2581" keeps the length
        pattern = (normalizer.get("pattern") or {}).get("String")
        content = normalizer.get("content") or ""
        return 1 if isinstance(pattern, str) and len(content) >= len(pattern) else None
    if kind == "Sequence":
        factor = 1
        for inner in normalizer.get("normalizers") or ():
            shrink = _normalizer_shrink(inner)
            if shrink is None:
                return None
            factor *= shrink
        return factor
    return None


def _keeps_text(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None or pre_tokenizer.get("type") in _KEEPING_SPLITS:
        return True
    if pre_tokenizer.get("type") == "Split":
        return pre_tokenizer.get("behavior") != "Removed"
    if pre_tokenizer.get("type") == "Sequence":
        return all(_keeps_text(inner) for inner in pre_tokenizer.get("pretokenizers") or ())
    return False


def prompt_size(prompt: Prompt) -> int:
    """About how much text a prompt is before the chat template: characters, or token ids."""
    if isinstance(prompt, TextPrompt):
        return len(prompt.text)
    if isinstance(prompt, TokensPrompt):
        return len(prompt.token_ids)
    tools = len(json.dumps(prompt.tools)) if prompt.tools else 0
    template = len(prompt.chat_template or "")  # a request's own is compiled before it renders
    return template + tools + sum(len(str(m.get("content") or "")) for m in prompt.messages)


def prompt_token_ids(
    bundle: TokenizerBundle,
    prompt: Prompt,
    bound: LengthBound | None = None,
    content_format: str = "auto",
    sandbox: TemplateSandbox | None = None,
) -> list[int]:
    """The prompt's token ids (the chat template applied, message content passed to it as
    `content_format` says: stages.text.chat.render_chat); EngineError for a bad prompt, and for
    text past `bound` (which is then not tokenized). A request's own chat template renders in
    `sandbox` where one is given."""
    if isinstance(prompt, ChatPrompt):
        text = render_chat(
            prompt.chat_template or bundle.chat_template,
            prompt.messages,
            add_generation_prompt=prompt.add_generation_prompt,
            continue_final_message=prompt.continue_final_message,
            tools=prompt.tools,
            template_kwargs=prompt.chat_template_kwargs,
            bos_token=bundle.bos_token,
            eos_token=bundle.eos_token,
            content_format=content_format,
            # a request's own template renders in the sandbox, the model's in this process
            sandbox=sandbox if prompt.chat_template is not None else None,
        )
        if bound is not None:
            bound.check(text, "messages")
        # The template writes BOS itself where the model wants one (unless asked, as in vLLM).
        return bundle.encode(text, add_bos=prompt.add_special_tokens)
    if isinstance(prompt, TextPrompt):
        if bound is not None:
            bound.check(prompt.text, "prompt")
        return bundle.encode(prompt.text, add_bos=prompt.add_special_tokens)
    ids = list(prompt.token_ids)
    bad = [t for t in ids if not 0 <= t < bundle.vocab_size]
    if bad:
        raise EngineError(
            f"token id {bad[0]} is out of vocabulary (size {bundle.vocab_size})", param="prompt"
        )
    return ids


def bad_word_ids(bundle: TokenizerBundle, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words as token sequences: each word alone and after a space, the two ways a
    tokenizer may see it."""
    sequences: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(bundle.encode(text, add_bos=False))
            if ids:
                sequences[ids] = None
    return tuple(sequences)


def truncate(ids: list[int], keep: int, side: str) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens ("left" cuts the start,
    the default) or its first ("right" cuts the end)."""
    if len(ids) <= keep:
        return ids
    return ids[:keep] if side == "right" else ids[-keep:]


def check_lengths(num_prompt: int, max_tokens: int | None, max_model_len: int) -> int:
    """The max_tokens to run with; EngineError when prompt (+ max_tokens) does not fit."""
    if num_prompt == 0:
        raise EngineError("the prompt is empty", param="prompt")
    if num_prompt >= max_model_len:
        raise EngineError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {num_prompt} input tokens. Please reduce the length of the input messages.",
            param="messages",
            code="context_length_exceeded",
        )
    room = max_model_len - num_prompt
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise EngineError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{max_tokens + num_prompt} tokens ({num_prompt} in the messages, {max_tokens} in the "
            f"completion). Please reduce the length of the messages or completion.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens
