"""From a request's prompt to token ids: the chat template, tokenization, truncation and length
checks, and the bad words as token sequences. Errors a client caused are EngineErrors."""

from __future__ import annotations

from collections.abc import Sequence

from stages.api import ChatPrompt, EngineError, Prompt, TextPrompt
from stages.text.chat import render_chat
from stages.text.tokenizer import TokenizerBundle


def prompt_token_ids(bundle: TokenizerBundle, prompt: Prompt) -> list[int]:
    """The prompt's token ids (the chat template applied); EngineError for a bad prompt."""
    if isinstance(prompt, ChatPrompt):
        text = render_chat(
            bundle.chat_template,
            prompt.messages,
            add_generation_prompt=prompt.add_generation_prompt,
            continue_final_message=prompt.continue_final_message,
            tools=prompt.tools,
            template_kwargs=prompt.chat_template_kwargs,
            bos_token=bundle.bos_token,
            eos_token=bundle.eos_token,
        )
        # The template writes BOS itself where the model wants one.
        return bundle.encode(text, add_bos=False)
    if isinstance(prompt, TextPrompt):
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
