"""The forward ring (a broadcast ring, execute rank 0 -> every other tensor-parallel rank): one
step's network inputs, which rank 0 made from the plan, so that every rank runs the same forward."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from pipeline.records import Record, Vocabulary
from stages.rings.common import Views

FORWARD = Record(
    "forward",
    ("input_ids", np.int64),  # [T]
    ("positions", np.int64),  # [T]
    ("query_start_loc", np.int32),  # [R + 1], attention rows
    ("context_lens", np.int32),  # [R]
    ("block_tables", np.int32),  # [R * W], row-major
    ("slot_mapping", np.int64),  # [T]
    ("logits_rows", np.int64),  # [L]
    ("block_copies", np.int32),  # [C * 2], (source, destination) pairs
    ("lora_ids", np.int64),  # [T] each token's adapter id, or [0]: every token the base's
    ("lora_paths", np.uint8),  # JSON {adapter id: directory} of the step's adapters
)
FORWARD_VOCAB = Vocabulary("forward", [FORWARD])


@dataclass(slots=True, frozen=True)
class ForwardStep:
    """What gpu.runner.ForwardInputs holds, as the ring carries it (this package has no torch)."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [R + 1] int32
    context_lens: np.ndarray  # [R] int32
    block_tables: np.ndarray  # [R, W] int32
    slot_mapping: np.ndarray  # [T] int64
    logits_rows: np.ndarray  # [L] int64
    block_copies: np.ndarray  # [C, 2] int32
    lora_ids: np.ndarray  # [T] int64, or empty
    lora_paths: Mapping[int, str]


def pack_forward(step: ForwardStep) -> dict[str, np.ndarray]:
    return {
        "input_ids": step.input_ids,
        "positions": step.positions,
        "query_start_loc": step.query_start_loc,
        "context_lens": step.context_lens,
        "block_tables": step.block_tables.reshape(-1),
        "slot_mapping": step.slot_mapping,
        "logits_rows": step.logits_rows,
        "block_copies": step.block_copies.reshape(-1),
        "lora_ids": step.lora_ids,
        "lora_paths": np.frombuffer(json.dumps(dict(step.lora_paths)).encode(), np.uint8),
    }


def unpack_forward(arrays: Views) -> ForwardStep:
    """The step; the arrays are the reader's own copy (the broadcast ring copies out)."""
    rows = len(arrays["context_lens"])
    tables = arrays["block_tables"]
    return ForwardStep(
        input_ids=arrays["input_ids"],
        positions=arrays["positions"],
        query_start_loc=arrays["query_start_loc"],
        context_lens=arrays["context_lens"],
        block_tables=tables.reshape(rows, len(tables) // rows if rows else 0),
        slot_mapping=arrays["slot_mapping"],
        logits_rows=arrays["logits_rows"],
        block_copies=arrays["block_copies"].reshape(-1, 2),
        lora_ids=arrays["lora_ids"],
        lora_paths={
            int(k): v for k, v in json.loads(arrays["lora_paths"].tobytes() or b"{}").items()
        },
    )
