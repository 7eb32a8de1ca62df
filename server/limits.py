"""What a request body may be: how many bytes, how deeply its JSON nests, how long it may take
to arrive and how many one client may send at once. Size and depth are checked before the body
is parsed, so that neither a huge body nor a deep one costs more than a look."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from server.errors import APIError

# Arrays and objects inside one another. OpenAI bodies nest about 4 deep and tool or response
# JSON schemas a few levels more; 64 leaves room for any real schema and keeps every recursive
# walk of the value (msgspec, json, the chat template, llguidance) far from Python's 1,000-frame
# limit, whose RecursionError would otherwise be a 500.
MAX_JSON_DEPTH = 64
DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024
# A body must arrive within this many seconds (the largest, 4 MiB, needs 1.2 Mbit/s), and one
# client address may send this many at once: a client sending bodies a byte at a time holds at
# most that many connections (descriptors), each for at most the timeout.
DEFAULT_REQUEST_BODY_TIMEOUT_S = 30.0
DEFAULT_MAX_BODY_READS_PER_CLIENT = 64
# A body still arriving after this long is being sent slowly; only those count against the
# limit above. A burst of requests from one address (a load test at 256 streams) keeps many
# bodies in reading for a moment, since each waits for the loop to hand it over, and none is slow.
BODY_READ_GRACE_S = 1.0

# What nesting depends on: brackets and (unescaped) quotes; the rest of the text is dropped.
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'[]{}"')
# Each kept byte's change of nesting: +1 for [ and {, -1 for ] and }, 0 for a quote.
_STEP = np.zeros(256, np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1


def json_depth(raw: bytes) -> int:
    """How deeply arrays and objects nest in JSON text (0 for a scalar), brackets inside strings
    not counted; for text that is not JSON the number means nothing (the parser refuses it anyway).
    Byte-string passes in C and numpy on what is left, so a body of megabytes costs milliseconds."""
    if b"\\" in raw:
        # Escapes read left to right: drop the escaped backslashes, then the escaped quotes.
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    structure = np.frombuffer(raw.translate(None, _NOT_STRUCTURE), np.uint8)  # [K] [ ] { } "
    if not len(structure):
        return 0
    # A bracket after an odd number of quotes is inside a string.
    outside = np.cumsum(structure == ord('"'), dtype=np.int32) % 2 == 0
    return int(np.cumsum(_STEP[structure[outside]], dtype=np.int32).max(initial=0))


def check_json_depth(raw: bytes | str, param: str | None = None) -> None:
    """APIError (400) for JSON nested deeper than MAX_JSON_DEPTH: a body, or JSON text in a field
    (`param`)."""
    depth = json_depth(raw.encode() if isinstance(raw, str) else raw)
    if depth > MAX_JSON_DEPTH:
        where = "the request body" if param is None else param
        raise APIError(
            f"{where} nests arrays and objects {depth} deep; at most {MAX_JSON_DEPTH} are allowed",
            param=param,
            code="invalid_json",
        )


def body_too_large(limit: int, size: int | None = None) -> APIError:
    """The 413 of a body over --max-request-body-bytes (`size` unknown for a chunked body)."""
    given = "" if size is None else f" ({size} bytes)"
    return APIError(
        f"The request body{given} is larger than {limit} bytes, the most this server takes "
        "(--max-request-body-bytes)",
        status=413,
    )


class BodyReads:
    """The requests of each client address still sending their bodies. A client with `limit` of
    them at once, each reading for more than `grace_s`, gets a 429 for the next, its body unread
    (Hypercorn then closes the connection), so a slow-body client cannot hold the server's
    descriptors; a burst of quick ones is let in."""

    def __init__(self, limit: int, grace_s: float = BODY_READ_GRACE_S) -> None:
        self.limit, self.grace_s = limit, grace_s
        self._started: dict[str, dict[int, float]] = {}  # by client: each read's start, in order
        self._keys = itertools.count()

    @contextmanager
    def reading(self, client: str) -> Iterator[None]:
        started = self._started.setdefault(client, {})
        now = time.monotonic()
        slow = 0
        for since in started.values():  # oldest first: stop at the first one still quick
            if now - since <= self.grace_s:
                break
            slow += 1
        if slow >= self.limit:
            raise APIError(
                f"{self.limit} requests from {client} are still sending their bodies, the most "
                "one client may send at once (--max-body-reads-per-client)",
                status=429,
                retry_after_s=1.0,
            )
        key = next(self._keys)
        started[key] = now
        try:
            yield
        finally:
            del started[key]
            if not started:
                del self._started[client]
