"""The requests ring (server -> render) and the errors ring (render -> server)."""

from __future__ import annotations

import msgspec
import numpy as np

from pipeline.records import Record, Vocabulary
from stages.api import EngineError, GenerateRequest
from stages.rings.common import ABORT, Resume, Views, encoder

SUBMIT = Record(
    "submit",
    ("handle", np.int64),
    ("request", np.uint8),  # msgpack GenerateRequest
    ("resume", np.uint8),  # msgpack common.Resume after a stage failure; empty for a new request
)
REQUESTS = Vocabulary("requests", [SUBMIT, ABORT])

ERROR = Record("error", ("handle", np.int64), ("status", np.int32), ("body", np.uint8))
ERRORS = Vocabulary("errors", [ERROR])

_request_decoder = msgspec.msgpack.Decoder(GenerateRequest)
_resume_decoder = msgspec.msgpack.Decoder(Resume)
_error_decoder = msgspec.msgpack.Decoder(tuple[str, str, str | None, str | None])


def pack_submit(
    handle: int, request: GenerateRequest, resume: Resume | None = None
) -> dict[str, np.ndarray]:
    return {
        "handle": np.array([handle], np.int64),
        "request": np.frombuffer(encoder.encode(request), np.uint8),
        "resume": np.frombuffer(b"" if resume is None else encoder.encode(resume), np.uint8),
    }


def unpack_submit(views: Views) -> tuple[int, GenerateRequest, Resume | None]:
    """(handle, request, resume); msgspec.DecodeError for a body that is not a GenerateRequest."""
    resume = views["resume"].tobytes()
    return (
        int(views["handle"][0]),
        _request_decoder.decode(views["request"].tobytes()),
        _resume_decoder.decode(resume) if resume else None,
    )


def pack_error(handle: int, error: EngineError) -> dict[str, np.ndarray]:
    body = encoder.encode((error.message, error.type, error.param, error.code))
    return {
        "handle": np.array([handle], np.int64),
        "status": np.array([error.status], np.int32),
        "body": np.frombuffer(body, np.uint8),
    }


def unpack_error(views: Views) -> tuple[int, EngineError]:
    message, kind, param, code = _error_decoder.decode(views["body"].tobytes())
    status = int(views["status"][0])
    return int(views["handle"][0]), EngineError(message, status, kind, param, code)
