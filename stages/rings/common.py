"""What several rings share: finish codes, the abort record, prompt-logprob rows, msgpack."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import msgspec
import numpy as np

from pipeline.records import Record


class Views(Protocol):
    """A received message's arrays by field name: a ring Message, or a dict (tests)."""

    def __getitem__(self, name: str, /) -> np.ndarray: ...


FINISH_NONE, FINISH_STOP, FINISH_LENGTH, FINISH_ABORT = 0, 1, 2, 3
FINISH_NAMES = {FINISH_STOP: "stop", FINISH_LENGTH: "length", FINISH_ABORT: "abort"}

encoder = msgspec.msgpack.Encoder()

ABORT = Record("abort", ("handles", np.int64))
# Drop every cached prefix block no request holds (POST /reset_prefix_cache): server -> render ->
# schedule, in order with the requests around it, so every request sent after it finds no prefix.
RESET_PREFIX_CACHE = Record("reset_prefix_cache", ("reset_id", np.int64))


class Resume(msgspec.Struct, frozen=True, array_like=True):
    """A request the engine submits again after a stage failure: what its client has already been
    sent. The stages rebuild its state from these tokens (schedule recomputes their KV as for a
    preemption, execute feeds them to the request's grammar, detokenize replays them through its
    text state without emitting them) and generation continues after them."""

    output_ids: tuple[int, ...]  # the output tokens streamed so far, in order
    first_token_ns: int  # when the first of them reached the server (CLOCK_MONOTONIC)
    num_recoveries: int  # stage failures this request has lived through, this one included


def pack_abort(handles: list[int] | np.ndarray) -> dict[str, np.ndarray]:
    return {"handles": np.asarray(handles, np.int64)}


def unpack_abort(views: Views) -> list[int]:
    return views["handles"].tolist()


def pack_reset_prefix_cache(reset_id: int) -> dict[str, np.ndarray]:
    return {"reset_id": np.array([reset_id], np.int64)}


def unpack_reset_prefix_cache(views: Views) -> int:
    return int(views["reset_id"][0])


# The logprob of one prompt token given the ones before it (requests that asked for
# prompt_logprobs); a prompt's rows arrive with the steps that prefill it, one chunk at a time.
PROMPT_LOGPROB_ROW = np.dtype(
    [
        ("handle", np.int64),
        ("position", np.int32),  # in the prompt; position 0 has no logprob (logprob nan, rank 0)
        ("token_id", np.int64),
        ("logprob", np.float32),
        ("rank", np.int64),
    ]
)


class PromptLogprob(NamedTuple):
    """One PROMPT_LOGPROB_ROW with its top-k, by name."""

    handle: int
    position: int
    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]  # (token id, logprob), best first; id -1 pads


@dataclass(slots=True, frozen=True)
class PromptLogprobs:
    """One step's prompt-logprob rows and their top-k (results and tokens rings)."""

    rows: np.ndarray  # [P] PROMPT_LOGPROB_ROW
    top_ids: np.ndarray  # [P, Kp] int64, -1 padded
    top_logprobs: np.ndarray  # [P, Kp] float32

    @classmethod
    def empty(cls) -> PromptLogprobs:
        return cls(
            np.zeros(0, PROMPT_LOGPROB_ROW),
            np.zeros((0, 0), np.int64),
            np.zeros((0, 0), np.float32),
        )

    def pack(self) -> dict[str, np.ndarray]:
        return {
            "prompt_rows": self.rows,
            "prompt_top_ids": self.top_ids.ravel(),
            "prompt_top_logprobs": self.top_logprobs.ravel(),
        }

    def entries(self) -> list[PromptLogprob]:
        top_ids, top_logprobs = self.top_ids.tolist(), self.top_logprobs.tolist()
        return [
            PromptLogprob(handle, position, token, logprob, rank, list(zip(ids, lps, strict=True)))
            for (handle, position, token, logprob, rank), ids, lps in zip(
                self.rows.tolist(), top_ids, top_logprobs, strict=True
            )
        ]

    @classmethod
    def unpack(cls, views: Views, top_k: int) -> PromptLogprobs:
        rows = views["prompt_rows"].copy()
        return cls(
            rows,
            views["prompt_top_ids"].reshape(len(rows), top_k).copy(),
            views["prompt_top_logprobs"].reshape(len(rows), top_k).copy(),
        )


PROMPT_LOGPROB_FIELDS = (
    ("prompt_rows", PROMPT_LOGPROB_ROW),  # [P]
    ("prompt_top_ids", np.int64),  # [P * Kp]
    ("prompt_top_logprobs", np.float32),  # [P * Kp]
)


def blobs(items: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Byte strings as (offsets [N + 1] int32, concatenation uint8)."""
    return np.cumsum([0, *map(len, items)], dtype=np.int32), np.frombuffer(
        b"".join(items), np.uint8
    )


def unblobs(offsets: np.ndarray, data: np.ndarray) -> list[bytes]:
    raw, bounds = data.tobytes(), offsets.tolist()
    return [raw[bounds[i] : bounds[i + 1]] for i in range(len(bounds) - 1)]
