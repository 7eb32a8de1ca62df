"""Incremental detokenization: UTF-8 across tokens, stop strings with hold-back, special tokens."""

from __future__ import annotations

import json

import numpy as np

from stages.actors.detokenize import DetokenizeActor
from stages.rings import common as m
from stages.rings import deltas, tokens
from stages.rings.common import PromptLogprobs
from stages.rings.tokens import DetokParams, TokenBatch
from stages.text.detokenizer import Detokenizer, held_suffix, stop_match

# A toy vocabulary of raw byte strings: "é" is split over two tokens, "🙂" over three.
VOCAB = (
    b"Hel",
    b"lo",
    b" wor",
    b"ld",
    b"\xc3",
    b"\xa9",
    b"\xf0\x9f",
    b"\x99",
    b"\x82",
    b"<eos>",
    b"!",
    b"END",
)
EOS, SPECIAL = 9, frozenset({9})


def detok(**params) -> Detokenizer:
    d = Detokenizer(VOCAB, SPECIAL, frozenset({EOS}))
    d.add(1, DetokParams(**params))
    return d


def feed_all(d: Detokenizer, tokens, last_finish=m.FINISH_NONE):
    out = []
    for i, t in enumerate(tokens):
        finish = last_finish if i == len(tokens) - 1 else m.FINISH_NONE
        r = d.feed(1, t, finish)
        if r is None:
            break
        out.append(r)
        if r[1] != m.FINISH_NONE:
            break
    return out


def test_multibyte_characters_are_emitted_whole_once_complete():
    d = detok()
    out = feed_all(d, [0, 4, 5, 6, 7, 8, 1], m.FINISH_LENGTH)
    texts = [t for t, _, _ in out]
    assert texts == ["Hel", "", "é", "", "", "🙂", "lo"]
    assert out[-1][1] == m.FINISH_LENGTH


def test_stop_string_across_tokens_is_held_back_and_cut():
    d = detok(stop=["lo wo"])
    out = feed_all(d, [0, 1, 2, 3])
    # "l" might start the stop string: held; then "llo" holds "lo"; then "lo wor" matches.
    assert [t for t, _, _ in out] == ["He", "l", ""]
    assert out[-1][1:] == (m.FINISH_STOP, "lo wo")
    assert "".join(t for t, _, _ in out) == "Hel"


def test_include_stop_str_in_output():
    d = detok(stop=["wor"], include_stop_str_in_output=True)
    out = feed_all(d, [0, 1, 2, 3])
    assert "".join(t for t, _, _ in out) == "Hello wor"


def test_held_text_is_flushed_when_the_request_ends_otherwise():
    d = detok(stop=["!!"])
    out = feed_all(d, [0, 10, 1], m.FINISH_LENGTH)
    assert "".join(t for t, _, _ in out) == "Hel!lo"


def test_eos_text_is_not_shown_and_special_tokens_are_skipped():
    d = detok()
    out = feed_all(d, [0, 9, 1, 9], m.FINISH_STOP)
    assert "".join(t for t, _, _ in out) == "Hello"
    assert out[-1][2] is None  # EOS is not a stop_reason
    d = detok(skip_special_tokens=False)
    out = feed_all(d, [0, 9, 1], m.FINISH_LENGTH)
    assert "".join(t for t, _, _ in out) == "Hel<eos>lo"


def test_stop_token_id_is_the_stop_reason():
    d = detok()
    out = feed_all(d, [0, 11], m.FINISH_STOP)
    assert out[-1][2] == 11 and "".join(t for t, _, _ in out) == "Hel"


def test_helpers():
    assert stop_match("abcdef", ["de", "bc"]) == (1, "bc")
    assert held_suffix("xxab", ["abc"]) == 2 and held_suffix("xx", ["abc"]) == 0


# -- the stage's step: parsing of reasoning and tool calls into the delta records -----------------

PARSE_VOCAB = (
    b"<think>",
    b"plan it",
    b"</think>",
    b"Calling.",
    b"<tool_",
    b"call>",
    b'{"name": "f", ',
    b'"arguments": {"x": 1}}',
    b"</tool_call>",
    b"<eos>",
)


def step(actor: DetokenizeActor, token_ids: list[int], params: DetokParams | None) -> list[tuple]:
    """One `tokens` record for request 1 (one row per token, the last one EOS), through process;
    returns (text, finish, extra) per delta row."""
    n = len(token_ids)
    rows = np.zeros(n, tokens.TOKEN_ROW)
    rows["handle"], rows["token_id"] = 1, token_ids
    rows["finish"][-1] = m.FINISH_STOP
    batch = TokenBatch(
        step_id=0,
        rows=rows,
        top_ids=np.zeros((n, 0), np.int64),
        top_logprobs=np.zeros((n, 0), np.float32),
        new=[(1, params)] if params is not None else [],
        metrics=np.zeros(n, tokens.METRICS_ROW),
        prompt=PromptLogprobs.empty(),
    )
    arrays, _ = actor.process(batch)
    assert arrays is not None
    batch = deltas.unpack_deltas(arrays)
    extras = [batch.extra(row) for row in range(len(batch.handles))]
    return [
        (batch.text(row), batch.finishes[row], None if extra is deltas.PLAIN else extra)
        for row, extra in enumerate(extras)
    ]


def test_the_stage_splits_reasoning_and_tool_calls_into_delta_extras():
    actor = DetokenizeActor.__new__(DetokenizeActor)
    actor.token_bytes = PARSE_VOCAB
    actor.detok = Detokenizer(PARSE_VOCAB, frozenset({9}), frozenset({9}))
    params = DetokParams(reasoning_parser="qwen3", tool_call_parser="hermes")
    out = step(actor, list(range(10)), params)
    texts = "".join(text for text, _, _ in out)
    reasoning = "".join(e.reasoning for _, _, e in out if e is not None)
    pieces = [c for _, _, e in out if e is not None and e.tool_calls for c in e.tool_calls]
    assert (texts, reasoning) == ("Calling.", "plan it")
    assert [(p.index, p.name) for p in pieces] == [(0, "f")]
    assert json.loads(pieces[0].arguments) == {"x": 1}
    # the call goes out on the row whose token wrote its name and arguments, and the request
    # then ends normally
    assert out[7][2].tool_calls and out[-1][1] == m.FINISH_STOP
    assert 1 not in actor.detok.states


def test_the_stage_without_parsers_streams_the_markup_as_text():
    actor = DetokenizeActor.__new__(DetokenizeActor)
    actor.token_bytes = PARSE_VOCAB
    actor.detok = Detokenizer(PARSE_VOCAB, frozenset({9}), frozenset({9}))
    out = step(actor, list(range(10)), DetokParams())
    assert "".join(t for t, _, _ in out) == b"".join(PARSE_VOCAB[:9]).decode()
    assert all(e is None for _, _, e in out[:-1])  # plain rows carry no extra bytes
    assert out[-1][2].metrics is not None and out[-1][2].tool_calls == ()


def test_spaces_between_special_tokens_sets_kept_special_tokens_apart():
    """vLLM's default with special tokens kept: each one stands apart from its neighbours by a
    space (HF's detokenizer joins text and special tokens with spaces); false writes them as
    they are."""
    spaced = detok(skip_special_tokens=False, spaces_between_special_tokens=True)
    out = feed_all(spaced, [9, 0, 1, 9, 9, 2], m.FINISH_LENGTH)
    # " wor" keeps its own space too, as HF's " ".join of the pieces keeps it
    assert "".join(t for t, _, _ in out) == "<eos> Hello <eos> <eos>  wor"
    tight = detok(skip_special_tokens=False, spaces_between_special_tokens=False)
    out = feed_all(tight, [9, 0, 1, 9, 9, 2], m.FINISH_LENGTH)
    assert "".join(t for t, _, _ in out) == "<eos>Hello<eos><eos> wor"


def test_spaces_between_special_tokens_keeps_a_split_character_whole():
    d = detok(skip_special_tokens=False, spaces_between_special_tokens=True)
    out = feed_all(d, [0, 4, 5, 9, 10], m.FINISH_LENGTH)
    assert "".join(t for t, _, _ in out) == "Helé <eos> !"
