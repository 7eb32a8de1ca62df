"""The tokens ring (schedule -> detokenize) and the stop_hits ring (detokenize -> schedule)."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np

from pipeline.records import Record, Vocabulary
from stages.api import RequestMetrics
from stages.rings.common import PROMPT_LOGPROB_FIELDS, PromptLogprobs, Views, blobs, unblobs
from stages.speculative_config import MAX_SPECULATIVE_TOKENS


class DetokParams(msgspec.Struct, frozen=True):
    """What detokenize needs of a request; render writes it, schedule forwards it untouched."""

    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = False  # a kept special token stands apart by a space
    num_logprobs: int = -1  # < 0: none
    num_prompt_logprobs: int = -1  # < 0: none
    reasoning_parser: str | None = None  # stages.text.parsers names
    tool_call_parser: str | None = None
    reasoning_starts_inside: bool = False  # the prompt ended inside an open think tag
    # Resubmitted after a stage failure: the outputs already streamed, replayed through the text
    # state without being emitted again.
    replay_ids: tuple[int, ...] = ()
    # The prompt's ids, for the first delta, when the request asked for them (return_token_ids).
    prompt_token_ids: tuple[int, ...] = ()


_detok_decoder = msgspec.msgpack.Decoder(DetokParams)

# The RequestMetrics fields schedule knows, per row (detokenize adds finished_ns and its own time
# when the request finishes there, which may be on a stop string schedule has not seen yet).
_SCHEDULE_METRICS = (
    "arrival_ns",
    "render_start_ns",
    "rendered_ns",
    "scheduled_ns",
    "first_token_ns",
    "last_token_ns",
    "num_generated_tokens",
    "num_preemptions",
    "num_cached_prompt_tokens",
    "num_cache_creation_tokens",
    "num_recoveries",
    "spec_num_steps",
    "spec_num_draft_tokens",
    "spec_num_accepted_tokens",
)
if missing := {*_SCHEDULE_METRICS, "spec_acceptance_histogram"} - set(
    RequestMetrics.__struct_fields__
):
    raise TypeError(f"METRICS_ROW names fields RequestMetrics lacks: {missing}")
METRICS_ROW = np.dtype(
    [(name, np.int64) for name in _SCHEDULE_METRICS]
    # [i]: verification steps that accepted i drafts, for i < spec_histogram_len (k + 1)
    + [
        ("spec_histogram_len", np.int64),
        ("spec_acceptance_histogram", np.int64, (MAX_SPECULATIVE_TOKENS + 1,)),
    ]
)


def request_metrics(row: np.void, finished_ns: int, detokenize_ns: int) -> RequestMetrics:
    """A finished request's metrics from its METRICS_ROW and what detokenize measured."""
    fields = {name: int(row[name]) for name in _SCHEDULE_METRICS}
    histogram = tuple(row["spec_acceptance_histogram"][: row["spec_histogram_len"]].tolist())
    return RequestMetrics(
        **fields,
        spec_acceptance_histogram=histogram,
        finished_ns=finished_ns,
        detokenize_ns=detokenize_ns,
    )


TOKEN_ROW = np.dtype(
    [
        ("handle", np.int64),
        ("token_id", np.int64),  # -1: no new token (an abort)
        ("logprob", np.float32),
        ("rank", np.int64),
        ("finish", np.int8),
        ("stop_token", np.bool_),  # the finish was a stop token id (not EOS): say which
        ("num_prompt_tokens", np.int32),
        ("num_output_tokens", np.int32),
    ]
)
TOKENS = Record(
    "tokens",
    ("meta", np.int64),  # [step_id, top_k, prompt_top_k]
    ("rows", TOKEN_ROW),  # [B]
    ("top_ids", np.int64),  # [B * top_k]
    ("top_logprobs", np.float32),
    ("new_handles", np.int64),  # [N] requests detokenize sees for the first time
    ("new_offsets", np.int32),  # [N + 1] into new_detok
    ("new_detok", np.uint8),  # msgpack DetokParams, concatenated
    ("metrics", METRICS_ROW),  # [B]
    *PROMPT_LOGPROB_FIELDS,  # prompt logprobs of this step's prefill chunks
)
TOKENS_VOCAB = Vocabulary("tokens", [TOKENS])


FINISHED = Record("finished", ("handles", np.int64))
STOP_HITS = Vocabulary("stop_hits", [FINISHED])


@dataclass(slots=True, frozen=True)
class TokenBatch:
    step_id: int
    rows: np.ndarray  # [B] TOKEN_ROW
    top_ids: np.ndarray  # [B, K] int64
    top_logprobs: np.ndarray  # [B, K] float32
    new: list[tuple[int, DetokParams]]  # requests detokenize sees for the first time
    metrics: np.ndarray  # [B] METRICS_ROW
    prompt: PromptLogprobs


def pack_tokens(
    step_id: int,
    rows: np.ndarray,
    top_ids: np.ndarray,
    top_logprobs: np.ndarray,
    new: list[tuple[int, bytes]],  # (handle, msgpack DetokParams as render wrote it)
    metrics: np.ndarray,  # [B] METRICS_ROW
    prompt: PromptLogprobs,
) -> dict[str, np.ndarray]:
    new_offsets, new_detok = blobs([detok for _, detok in new])
    return {
        "meta": np.array([step_id, top_ids.shape[1], prompt.top_ids.shape[1]], np.int64),
        "rows": rows,
        "top_ids": top_ids.ravel(),
        "top_logprobs": top_logprobs.ravel(),
        "new_handles": np.array([handle for handle, _ in new], np.int64),
        "new_offsets": new_offsets,
        "new_detok": new_detok,
        "metrics": metrics,
        **prompt.pack(),
    }


def unpack_tokens(views: Views) -> TokenBatch:
    step_id, top_k, prompt_top_k = views["meta"].tolist()
    rows = views["rows"].copy()
    handles = views["new_handles"].tolist()
    detoks = unblobs(views["new_offsets"], views["new_detok"])
    return TokenBatch(
        step_id=step_id,
        rows=rows,
        top_ids=views["top_ids"].reshape(len(rows), top_k).copy(),
        top_logprobs=views["top_logprobs"].reshape(len(rows), top_k).copy(),
        new=[(h, _detok_decoder.decode(d)) for h, d in zip(handles, detoks, strict=True)],
        metrics=views["metrics"].copy(),
        prompt=PromptLogprobs.unpack(views, prompt_top_k),
    )


def pack_finished(handles: list[int]) -> dict[str, np.ndarray]:
    return {"handles": np.array(handles, np.int64)}


def unpack_finished(views: Views) -> list[int]:
    return views["handles"].tolist()
