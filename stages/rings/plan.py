"""The plan ring (schedule -> execute): one engine step, flattened, as the runner takes it; and the
requests whose grammar matchers execute is to build before they are planned."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pipeline.records import Record, Vocabulary
from stages.rings.common import Views, blobs, unblobs
from stages.rings.prompts import RenderedRequest, rendered_decoder

if TYPE_CHECKING:  # the server reads this ring's layout and must not load the scheduler
    from stages.scheduler import Step

STEP_SEQ = np.dtype(
    [
        ("handle", np.int64),
        ("query_start", np.int32),
        ("query_len", np.int32),
        ("context_len", np.int32),  # KV length after this step
        ("prompt_len", np.int32),
        ("sample", np.bool_),
        ("num_draft", np.int32),  # the row's last num_draft inputs are drafts to verify
    ]
)
STEP = Record(
    "step",
    ("meta", np.int64),  # [step_id, block_table_width, scheduled_ns]
    ("seqs", STEP_SEQ),  # [B]
    ("input_ids", np.int32),  # [T]; -1: the token execute sampled at that position last step
    ("positions", np.int32),  # [T]
    ("slot_mapping", np.int64),  # [T]
    ("block_tables", np.int32),  # [B * width], padded with 0
    ("new_handles", np.int64),  # [N] requests execute sees for the first time
    ("new_offsets", np.int32),  # [N + 1] into new_requests
    ("new_requests", np.uint8),  # msgpack RenderedRequest of each, concatenated
    # With a model-free speculative method: each new request's known tokens (prompt, outputs)
    ("new_token_offsets", np.int32),  # [N + 1] into new_token_ids; [] without
    ("new_token_ids", np.int32),
    ("free_handles", np.int64),  # requests execute may forget
    ("block_copies", np.int32),  # [C * 2] (source, destination) KV blocks to copy first (beams)
)
# Requests with a grammar, sent before any step plans them: execute builds their matchers in a
# worker thread (that takes up to seconds) and says on `results` when each is ready to schedule.
GRAMMARS = Record(
    "grammars",
    ("handles", np.int64),  # [N]
    ("offsets", np.int32),  # [N + 1] into requests
    ("requests", np.uint8),  # msgpack RenderedRequest of each, concatenated
)
PLAN = Vocabulary("plan", [STEP, GRAMMARS])


@dataclass(slots=True, frozen=True)
class PlannedStep:
    step_id: int
    scheduled_ns: int
    seqs: np.ndarray  # [B] STEP_SEQ
    input_ids: np.ndarray  # [T] int32, -1 where execute fills in its last sampled token
    positions: np.ndarray  # [T] int32
    slot_mapping: np.ndarray  # [T] int64
    block_tables: np.ndarray  # [B, W] int32
    new_requests: list[tuple[int, RenderedRequest]]
    # each new request's known tokens, by handle, where a model-free proposer reads them
    new_tokens: dict[int, np.ndarray]  # [P + O] int32
    free_handles: np.ndarray  # [F] int64
    block_copies: np.ndarray  # [C, 2] int32, (source, destination) blocks to copy before the step

    @property
    def query_start_loc(self) -> np.ndarray:  # -> [B + 1] int32
        seqs = self.seqs
        return np.append(seqs["query_start"], seqs["query_start"][-1] + seqs["query_len"][-1])


def prompt_tokens(seqs: np.ndarray) -> int:  # seqs: [B] STEP_SEQ
    """How many of a step's inputs are prompt tokens (prefill), the rest being decode inputs
    and drafts."""
    end = seqs["context_len"].astype(np.int64)
    start = end - seqs["query_len"]
    return int(np.clip(np.minimum(end, seqs["prompt_len"]) - start, 0, None).sum())


def pack_step(step: Step, block_size: int, scheduled_ns: int) -> dict[str, np.ndarray]:
    planned = step.seqs
    count = len(planned)
    starts = np.array([s.start for s in planned], np.int64)
    query_lens = np.array([s.num_tokens for s in planned], np.int64)
    query_start = np.zeros(count, np.int64)
    np.cumsum(query_lens[:-1], out=query_start[1:])
    total = int(query_lens.sum())
    seqs = np.zeros(count, STEP_SEQ)
    seqs["handle"] = [s.seq.handle for s in planned]
    seqs["query_start"] = query_start
    seqs["query_len"] = query_lens
    seqs["context_len"] = starts + query_lens
    seqs["prompt_len"] = [s.seq.num_prompt for s in planned]
    seqs["sample"] = [s.sample for s in planned]
    seqs["num_draft"] = [s.num_draft for s in planned]
    tables = [s.seq.blocks for s in planned]
    width = max(map(len, tables))
    # Padding points at block 0: never read past context_len, and always a valid index.
    block_tables = np.array([t + [0] * (width - len(t)) for t in tables], np.int32)
    # positions and slots of every token: row b's tokens are start_b, start_b + 1, ...
    row_of_token = np.repeat(np.arange(count), query_lens)
    positions = np.arange(total, dtype=np.int64) - query_start[row_of_token] + starts[row_of_token]
    slot_mapping = block_tables[row_of_token, positions // block_size].astype(np.int64) * block_size
    slot_mapping += positions % block_size
    new = step.new_for_execute
    new_offsets, new_requests = blobs([seq.rendered for seq in new])
    known = (
        [seq.token_ids(0, seq.num_prompt + len(seq.output_ids)) for seq in new]
        if step.send_tokens
        else []
    )
    token_offsets = np.cumsum([0, *map(len, known)], dtype=np.int32)
    return {
        "meta": np.array([step.step_id, width, scheduled_ns], np.int64),
        "seqs": seqs,
        "input_ids": _input_ids(step, total, query_start),
        "positions": positions.astype(np.int32),
        "slot_mapping": slot_mapping,
        "block_tables": block_tables.ravel(),
        "new_handles": np.array([s.handle for s in new], np.int64),
        "new_offsets": new_offsets,
        "new_requests": new_requests,
        "new_token_offsets": token_offsets if step.send_tokens else np.zeros(0, np.int32),
        "new_token_ids": np.concatenate(known, dtype=np.int32) if known else np.zeros(0, np.int32),
        "free_handles": np.array(step.free_handles, np.int64),
        "block_copies": np.array(step.block_copies, np.int32).reshape(-1),
    }


def _input_ids(step: Step, total: int, query_start: np.ndarray) -> np.ndarray:  # -> [T] int32
    planned = step.seqs
    if total == len(planned):  # all decodes (or one-token chunks): one token each
        return np.array([s.seq.token_at(s.start) for s in planned], np.int32)
    # Chunks are copied as slices; the one-token rows beside them (decodes, mostly) are gathered
    # into one scatter instead of an array each.
    input_ids = np.empty(total, np.int32)
    single_rows: list[int] = []
    single_tokens: list[int] = []
    at = 0
    for row, s in enumerate(planned):
        if s.num_tokens == 1:
            single_rows.append(row)
            single_tokens.append(s.seq.token_at(s.start))
        elif s.draft is not None:  # the input token (maybe still -1), then the drafts
            input_ids[at] = s.seq.token_at(s.start)
            input_ids[at + 1 : at + s.num_tokens] = s.draft
        else:
            input_ids[at : at + s.num_tokens] = s.seq.token_ids(s.start, s.start + s.num_tokens)
        at += s.num_tokens
    input_ids[query_start[single_rows]] = single_tokens
    return input_ids


def unpack_step(views: Views) -> PlannedStep:
    step_id, width, scheduled_ns = views["meta"].tolist()
    seqs = views["seqs"].copy()
    handles = views["new_handles"].tolist()
    requests = unblobs(views["new_offsets"], views["new_requests"])
    return PlannedStep(
        step_id=step_id,
        scheduled_ns=scheduled_ns,
        seqs=seqs,
        input_ids=views["input_ids"].copy(),
        positions=views["positions"].copy(),
        slot_mapping=views["slot_mapping"].copy(),
        block_tables=views["block_tables"].reshape(len(seqs), width).copy(),
        new_requests=[
            (h, rendered_decoder.decode(r)) for h, r in zip(handles, requests, strict=True)
        ],
        new_tokens=_new_tokens(handles, views["new_token_offsets"], views["new_token_ids"]),
        free_handles=views["free_handles"].copy(),
        block_copies=views["block_copies"].reshape(-1, 2).copy(),
    )


def _new_tokens(
    handles: list[int], offsets: np.ndarray, token_ids: np.ndarray
) -> dict[int, np.ndarray]:
    if not len(offsets):
        return {}
    bounds = offsets.tolist()
    return {h: token_ids[bounds[i] : bounds[i + 1]].copy() for i, h in enumerate(handles)}


def pack_grammars(requests: list[tuple[int, bytes]]) -> dict[str, np.ndarray]:
    """(handle, msgpack RenderedRequest) of each request whose matcher execute is to build."""
    offsets, data = blobs([rendered for _, rendered in requests])
    handles = np.array([handle for handle, _ in requests], np.int64)
    return {"handles": handles, "offsets": offsets, "requests": data}


def unpack_grammars(views: Views) -> list[tuple[int, RenderedRequest]]:
    requests = unblobs(views["offsets"], views["requests"])
    return [
        (handle, rendered_decoder.decode(r))
        for handle, r in zip(views["handles"].tolist(), requests, strict=True)
    ]
