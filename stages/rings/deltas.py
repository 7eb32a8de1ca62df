"""The deltas ring (detokenize -> server): one step's text deltas, finishes and extras."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np

from pipeline.records import Record, Vocabulary
from stages.api import RequestMetrics, TokenLogprob, ToolCallDelta
from stages.rings.common import Views, blobs


class DeltaExtra(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """What a delta row carries beyond its token and text; rows with none of it carry no bytes."""

    logprobs: tuple[TokenLogprob, ...] | None = None
    stop_reason: str | int | None = None
    metrics: RequestMetrics | None = None
    reasoning: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    # on a request's first delta, when asked for: the prompt's tokens from position 0, each with
    # its logprob (position 0 has none: rank 0) and top-k
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    # on a request's final delta, with a reasoning parser: its output tokens inside the reasoning
    num_reasoning_tokens: int = 0
    prompt_token_ids: tuple[int, ...] | None = None  # on the first delta, when asked for


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
    ("meta", np.int64),  # [step_id]: the engine step whose tokens these are
    ("rows", DELTA_ROW),  # [n]
    ("text_offsets", np.int32),  # [n + 1] into text
    ("text", np.uint8),  # UTF-8
    ("extra_offsets", np.int32),  # [n + 1] into extra
    ("extra", np.uint8),  # msgpack DeltaExtra of the rows that have one
)
DELTAS_VOCAB = Vocabulary("deltas", [DELTAS])


@dataclass(slots=True)
class DeltaBatch:
    """One deltas message copied out, by column; `text` and `extra` decode one row on demand,
    so rows nobody waits for any more cost nothing."""

    step_id: int
    handles: list[int]
    finishes: list[int]
    num_prompt_tokens: list[int]
    num_output_tokens: list[int]
    token_ids: list[int]  # -1 if none
    text_offsets: list[int]
    text_bytes: bytes
    extra_offsets: list[int]
    extra_bytes: bytes

    def text(self, row: int) -> str:
        return self.text_bytes[self.text_offsets[row] : self.text_offsets[row + 1]].decode("utf-8")

    def extra(self, row: int) -> DeltaExtra:
        start, end = self.extra_offsets[row], self.extra_offsets[row + 1]
        return _extra_decoder.decode(self.extra_bytes[start:end]) if end > start else PLAIN


def pack_deltas(
    step_id: int,
    rows: list[tuple[int, int, int, int, int]],  # DELTA_ROW's fields
    texts: list[str],
    extras: list[DeltaExtra | None],  # None: a plain row
) -> dict[str, np.ndarray]:
    text_offsets, text = blobs([t.encode("utf-8") for t in texts])
    extra_offsets, extra = blobs([b"" if e is None else _encoder.encode(e) for e in extras])
    return {
        "meta": np.array([step_id], np.int64),
        "rows": np.array(rows, DELTA_ROW),
        "text_offsets": text_offsets,
        "text": text,
        "extra_offsets": extra_offsets,
        "extra": extra,
    }


def unpack_deltas(views: Views) -> DeltaBatch:
    rows = views["rows"]
    return DeltaBatch(
        step_id=int(views["meta"][0]),
        handles=rows["handle"].tolist(),
        finishes=rows["finish"].tolist(),
        num_prompt_tokens=rows["num_prompt_tokens"].tolist(),
        num_output_tokens=rows["num_output_tokens"].tolist(),
        token_ids=rows["token_id"].tolist(),
        text_offsets=views["text_offsets"].tolist(),
        text_bytes=views["text"].tobytes(),
        extra_offsets=views["extra_offsets"].tolist(),
        extra_bytes=views["extra"].tobytes(),
    )
