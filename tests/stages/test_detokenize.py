"""Incremental detokenization: UTF-8 across tokens, stop strings with hold-back, special tokens."""

from __future__ import annotations

from stages import messages as m
from stages.detokenize import Detokenizer, held_suffix, stop_match
from stages.wire import DetokParams

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
