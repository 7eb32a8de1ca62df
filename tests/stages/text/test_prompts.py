"""What render checks of a prompt before it tokenizes it: text that cannot fit is refused."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from stages.api import EngineError, TextPrompt
from stages.text.prompts import LengthBound, prompt_token_ids
from stages.text.tokenizer import TokenizerBundle, load_tokenizer
from tests.stages.text.test_tokenizer import TEXTS


@pytest.fixture(scope="module")
def bundle(tiny_chat_model) -> TokenizerBundle:
    return load_tokenizer(tiny_chat_model)


def test_the_bound_never_refuses_text_that_fits(bundle):
    """chars_per_token is an upper bound: no text has fewer tokens than its characters over it,
    not even runs of the vocabulary's longest token."""
    bound = LengthBound.of(bundle, 512)
    assert bound is not None and bound.chars_per_token == max(map(len, bundle.token_bytes))
    longest = max(range(bundle.vocab_size), key=lambda t: len(bundle.token_bytes[t]))
    runs = [bundle.decode([longest] * 50), *(t * 20 for t in TEXTS if t)]
    for text in runs:
        assert len(bundle.encode(text)) >= len(text) / bound.chars_per_token, text


def test_text_past_the_bound_is_refused_before_it_is_tokenized(bundle):
    bound = LengthBound.of(bundle, 512)
    assert bound is not None
    limit = 512 * bound.chars_per_token
    assert prompt_token_ids(bundle, TextPrompt("a" * (limit - 1)), bound)  # tokenized (a run)
    with pytest.raises(EngineError) as info:
        prompt_token_ids(bundle, TextPrompt("a" * limit), bound)
    assert info.value.status == 400 and info.value.code == "context_length_exceeded"
    assert info.value.param == "prompt" and "512 tokens" in info.value.message


def with_normalizer(bundle: TokenizerBundle, normalizer, pre_tokenizer=None) -> TokenizerBundle:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    return TokenizerBundle(
        tokenizer=tokenizer,
        bos_token_id=None,
        eos_token_ids=(),
        pad_token_id=None,
        add_bos_token=False,
        special_token_ids=frozenset(),
        chat_template=None,
        vocab_size=2,
        token_bytes=(b"abcd", b"e"),
        bos_token=None,
        eos_token=None,
    )


@pytest.mark.parametrize(
    ("normalizer", "pre_tokenizer", "chars_per_token"),
    [
        (None, None, 4),
        (normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]), None, 4),
        (normalizers.NFC(), pre_tokenizers.ByteLevel(), 12),  # composition: 3 characters to 1
        (normalizers.Strip(), None, None),  # drops text: no length is too long
        (normalizers.Replace("  ", " "), None, None),
        (None, pre_tokenizers.WhitespaceSplit(), None),
    ],
)
def test_the_bound_follows_what_the_normalizer_may_drop(
    bundle, normalizer, pre_tokenizer, chars_per_token
):
    bound = LengthBound.of(with_normalizer(bundle, normalizer, pre_tokenizer), 100)
    assert (None if bound is None else bound.chars_per_token) == chars_per_token


def test_a_request_template_replaces_the_models_in_the_sandbox(bundle):
    from stages.api import ChatPrompt

    messages = [{"role": "user", "content": "hi"}]
    own = "{% for m in messages %}[{{ m.role }}|{{ m.content }}|{{ effort }}]{% endfor %}"
    prompt = ChatPrompt(messages, chat_template=own, chat_template_kwargs={"effort": "low"})
    assert bundle.decode(prompt_token_ids(bundle, prompt)) == "[user|hi|low]"
    assert prompt_token_ids(bundle, ChatPrompt(messages)) != prompt_token_ids(bundle, prompt)
    escape = ChatPrompt(messages, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(EngineError) as info:
        prompt_token_ids(bundle, escape)
    assert info.value.status == 400 and info.value.param == "messages"


def test_truncation_keeps_either_end():
    from stages.text.prompts import truncate

    ids = [1, 2, 3, 4, 5]
    assert truncate(ids, 2, "left") == [4, 5]  # vLLM's default: the prompt's end
    assert truncate(ids, 2, "right") == [1, 2]
    assert truncate(ids, 9, "right") == ids
