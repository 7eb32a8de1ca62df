"""The deltas ring (detokenize -> server): one step's text deltas, finishes and extras."""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import msgspec
import numpy as np

from pipeline.records import Record, Vocabulary
from stages.api import RequestMetrics, TokenLogprob, ToolCall
from stages.rings.common import Views, blobs


class DeltaExtra(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """What a delta row carries beyond its token and text; rows with none of it carry no bytes."""

    logprobs: tuple[TokenLogprob, ...] | None = None
    stop_reason: str | int | None = None
    metrics: RequestMetrics | None = None
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    # on a request's first delta, when asked for: the prompt's tokens from position 0, each with
    # its logprob (position 0 has none: rank 0) and top-k
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


PLAIN = DeltaExtra()  # a row with only a token and its text
_extra_decoder = msgspec.msgpack.Decoder(DeltaExtra)
_encoder = msgspec.msgpack.Encoder()

DELTA_ROW = np.dtype(
    [
        ("handle", np.int64),
        ("finish", np.int8),
        ("num_prompt_tokens", np.int32),
        ("num_output_tokens", np.int32),
        ("token_id", np.int64),  # the new token, -1 if none
    ]
)
DELTAS = Record(
    "deltas",
    ("rows", DELTA_ROW),  # [n]
    ("text_offsets", np.int32),  # [n + 1] into text
    ("text", np.uint8),  # UTF-8
    ("extra_offsets", np.int32),  # [n + 1] into extra
    ("extra", np.uint8),  # msgpack DeltaExtra of the rows that have one
)
DELTAS_VOCAB = Vocabulary("deltas", [DELTAS])


class Delta(NamedTuple):  # a NamedTuple: the server unpacks one per streamed token
    handle: int
    finish: int
    num_prompt_tokens: int
    num_output_tokens: int
    token_id: int  # -1 if none
    text: str
    extra: DeltaExtra


def pack_deltas(
    rows: list[tuple[int, int, int, int, int]],  # DELTA_ROW's fields
    texts: list[str],
    extras: list[DeltaExtra | None],  # None: a plain row
) -> dict[str, np.ndarray]:
    text_offsets, text = blobs([t.encode("utf-8") for t in texts])
    extra_offsets, extra = blobs([b"" if e is None else _encoder.encode(e) for e in extras])
    return {
        "rows": np.array(rows, DELTA_ROW),
        "text_offsets": text_offsets,
        "text": text,
        "extra_offsets": extra_offsets,
        "extra": extra,
    }


def unpack_deltas(views: Views) -> Iterator[Delta]:
    """The deltas in row order; copied out of the message before the first is yielded."""
    rows = views["rows"].tolist()
    text_offsets = views["text_offsets"].tolist()
    text = views["text"].tobytes()
    extra_offsets = views["extra_offsets"].tolist()
    extra = views["extra"].tobytes()
    return _deltas(rows, text_offsets, text, extra_offsets, extra)


def _deltas(
    rows: list[tuple[int, int, int, int, int]],
    text_offsets: list[int],
    text: bytes,
    extra_offsets: list[int],
    extra: bytes,
) -> Iterator[Delta]:
    for i, (handle, finish, n_prompt, n_output, token) in enumerate(rows):
        start, end = extra_offsets[i], extra_offsets[i + 1]
        yield Delta(
            handle,
            finish,
            n_prompt,
            n_output,
            token,
            text[text_offsets[i] : text_offsets[i + 1]].decode("utf-8"),
            _extra_decoder.decode(extra[start:end]) if end > start else PLAIN,
        )
