"""The results ring (execute -> schedule): one step's sampled tokens and logprobs, and the
requests whose grammar matchers are built."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.records import Record, Vocabulary
from stages.rings.common import PROMPT_LOGPROB_FIELDS, PromptLogprobs, Views

RESULT = Record(
    "result",
    ("meta", np.int64),  # [step_id, top_k, t_start_ns, t_end_ns, prompt_top_k]
    ("handles", np.int64),  # [B]
    ("num_tokens", np.int32),  # [B] entries of each row below: 1, or 1 + accepted drafts
    ("num_drafted", np.int32),  # [B] drafts each row verified (filled into its reserved positions)
    ("token_ids", np.int64),  # [N], -1 where not sampled
    ("logprobs", np.float32),  # [N]
    ("ranks", np.int64),  # [N]
    ("top_ids", np.int64),  # [N * top_k]
    ("top_logprobs", np.float32),  # [N * top_k]
    *PROMPT_LOGPROB_FIELDS,
)
# Requests whose grammar matchers (plan.GRAMMARS) execute has built: schedule may plan them now.
MATCHERS = Record("matchers", ("handles", np.int64))
RESULTS = Vocabulary("results", [RESULT, MATCHERS])


@dataclass(slots=True, frozen=True)
class StepResult:
    step_id: int
    t_start_ns: int  # the forward pass began
    t_end_ns: int  # the step's tokens were sampled
    handles: np.ndarray  # [B] int64, the step's rows in plan order
    num_tokens: np.ndarray  # [B] int32, entries per row (1 + the drafts a row accepted)
    num_drafted: np.ndarray  # [B] int32, drafts each row verified
    token_ids: np.ndarray  # [N] int64, -1 where not sampled
    logprobs: np.ndarray  # [N] float32
    ranks: np.ndarray  # [N] int64
    top_ids: np.ndarray  # [N, K] int64
    top_logprobs: np.ndarray  # [N, K] float32
    prompt: PromptLogprobs


def pack_result(result: StepResult) -> dict[str, np.ndarray]:
    meta = [
        result.step_id,
        result.top_ids.shape[1],
        result.t_start_ns,
        result.t_end_ns,
        result.prompt.top_ids.shape[1],
    ]
    return {
        "meta": np.array(meta, np.int64),
        "handles": np.asarray(result.handles, np.int64),
        "num_tokens": np.asarray(result.num_tokens, np.int32),
        "num_drafted": np.asarray(result.num_drafted, np.int32),
        "token_ids": np.asarray(result.token_ids, np.int64),
        "logprobs": np.asarray(result.logprobs, np.float32),
        "ranks": np.asarray(result.ranks, np.int64),
        "top_ids": np.asarray(result.top_ids, np.int64).ravel(),
        "top_logprobs": np.asarray(result.top_logprobs, np.float32).ravel(),
        **result.prompt.pack(),
    }


def unpack_result(views: Views) -> StepResult:
    step_id, top_k, t_start_ns, t_end_ns, prompt_top_k = views["meta"].tolist()
    count = len(views["token_ids"])
    return StepResult(
        step_id=step_id,
        t_start_ns=t_start_ns,
        t_end_ns=t_end_ns,
        handles=views["handles"].copy(),
        num_tokens=views["num_tokens"].copy(),
        num_drafted=views["num_drafted"].copy(),
        token_ids=views["token_ids"].copy(),
        logprobs=views["logprobs"].copy(),
        ranks=views["ranks"].copy(),
        top_ids=views["top_ids"].reshape(count, top_k).copy(),
        top_logprobs=views["top_logprobs"].reshape(count, top_k).copy(),
        prompt=PromptLogprobs.unpack(views, prompt_top_k),
    )


def pack_matchers(handles: list[int]) -> dict[str, np.ndarray]:
    return {"handles": np.array(handles, np.int64)}


def unpack_matchers(views: Views) -> list[int]:
    return views["handles"].tolist()
