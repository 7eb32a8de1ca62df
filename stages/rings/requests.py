"""The requests ring (server -> render) and the errors ring (render -> server).

Besides generation, the requests ring carries render-only requests (the /render endpoints), which
render answers on the errors ring with what it rendered (or the error), and prefix-cache resets,
which render forwards to schedule in order."""

from __future__ import annotations

import msgspec
import numpy as np

from pipeline.records import Record, Vocabulary
from stages.api import EngineError, GenerateRequest, RenderedPromptInfo
from stages.rings.common import ABORT, RESET_PREFIX_CACHE, Resume, Views, encoder

SUBMIT = Record(
    "submit",
    ("handle", np.int64),
    ("request", np.uint8),  # msgpack GenerateRequest
    ("resume", np.uint8),  # msgpack common.Resume after a stage failure; empty for a new request
)
# Render a request as for generation and answer with the result instead of scheduling it.
RENDER = Record("render", ("handle", np.int64), ("request", np.uint8))  # msgpack GenerateRequest
REQUESTS = Vocabulary("requests", [SUBMIT, ABORT, RENDER, RESET_PREFIX_CACHE])

ERROR = Record("error", ("handle", np.int64), ("status", np.int32), ("body", np.uint8))
RENDERED = Record(
    "rendered",
    ("handle", np.int64),
    ("prompt_ids", np.int32),  # [P] what schedule would get
    ("max_tokens", np.int64),  # [1] resolved against the context
    ("text", np.uint8),  # UTF-8: the prompt ids decoded, special tokens kept
)
ERRORS = Vocabulary("errors", [ERROR, RENDERED])

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


def pack_render(handle: int, request: GenerateRequest) -> dict[str, np.ndarray]:
    return {
        "handle": np.array([handle], np.int64),
        "request": np.frombuffer(encoder.encode(request), np.uint8),
    }


def unpack_render(views: Views) -> tuple[int, GenerateRequest]:
    return int(views["handle"][0]), _request_decoder.decode(views["request"].tobytes())


def pack_rendered(
    handle: int, prompt_ids: np.ndarray, max_tokens: int, text: str
) -> dict[str, np.ndarray]:
    return {
        "handle": np.array([handle], np.int64),
        "prompt_ids": np.asarray(prompt_ids, np.int32),
        "max_tokens": np.array([max_tokens], np.int64),
        "text": np.frombuffer(text.encode("utf-8"), np.uint8),
    }


def unpack_rendered(views: Views) -> tuple[int, RenderedPromptInfo]:
    return int(views["handle"][0]), RenderedPromptInfo(
        token_ids=views["prompt_ids"].tolist(),
        text=views["text"].tobytes().decode("utf-8"),
        max_tokens=int(views["max_tokens"][0]),
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
