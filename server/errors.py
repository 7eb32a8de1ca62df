"""OpenAI-shaped errors: the exception the routes raise and the JSON body clients expect."""

from __future__ import annotations

import math
import re
from typing import Any

import msgspec

from stages.api import EngineError

_TYPE_BY_STATUS = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestEntityTooLargeError",
    415: "UnsupportedMediaTypeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    431: "RequestHeaderFieldsTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}

# msgspec ends its validation messages with "- at `$.path`"; the path is OpenAI's `param`.
_MSGSPEC_PATH = re.compile(r"\s*-\s*at `\$\.?([^`]*)`$")


def error_type_for(status: int) -> str:
    return _TYPE_BY_STATUS.get(status, "BadRequestError" if status < 500 else "InternalServerError")


class APIError(Exception):
    """An error answered to the client as `{"error": {...}}` with `status`."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type or error_type_for(status)
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s  # sent as Retry-After (whole seconds, at least 1)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    @classmethod
    def from_engine(cls, error: EngineError) -> APIError:
        return cls(
            error.message, error.status, error.type, error.param, error.code, error.retry_after_s
        )

    @classmethod
    def from_decode(cls, error: msgspec.MsgspecError) -> APIError:
        """A body that is not JSON, or JSON that does not fit the request schema."""
        if isinstance(error, msgspec.ValidationError):
            message = str(error)
            match = _MSGSPEC_PATH.search(message)
            # msgspec writes a dict value's key as "[...]"; the dict itself is the param
            param = (match.group(1).replace("[...]", "") or None) if match else None
            kind = _pydantic_kind(message)
            if kind is not None:  # pydantic's (so vLLM's) name of the broken bound, for clients
                message = f"{message} ({kind})"  # that look for it, as vLLM's own tests do
            return cls(f"Invalid request: {message}", param=param, code="invalid_value")
        return cls(f"Invalid JSON body: {error}", code="invalid_json")


_BOUND_KINDS = (
    ("length >= ", "too_short"),
    ("length <= ", "too_long"),
    (">= ", "greater_than_equal"),
    ("<= ", "less_than_equal"),
    ("> ", "greater_than"),
    ("< ", "less_than"),
)


def _pydantic_kind(message: str) -> str | None:
    """pydantic's error type for msgspec's "Expected `int` <= 10" (less_than_equal), if any."""
    expected = message.partition(" - at ")[0]
    for marker, kind in _BOUND_KINDS:
        if f" {marker}" in expected or expected.startswith(f"Expected {marker}"):
            return kind
    return None


def retry_after_header(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
