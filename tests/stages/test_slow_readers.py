"""A client that stops reading a stream cannot make the engine hold its output without bound:
past --max-unread-tokens (tokens, each top logprob counted as one more) the request is aborted
with a logged reason and its KV blocks freed; what was queued before stays for the client, then
the error. A client that reads, with the same limit, gets all of its tokens."""

from __future__ import annotations

import asyncio
import time

import pytest
import structlog

from stages.api import EngineError
from tests.stages.test_recovery import request

LIMIT = 30  # a token and its two top logprobs count 3: about ten tokens unread


@pytest.fixture
def engine(pipeline):
    return pipeline(max_unread_tokens=LIMIT)


def test_a_stream_left_unread_is_aborted_and_frees_its_blocks(engine):
    engine, runner = engine
    stats = engine.stats

    async def read_all():
        tokens = []
        async for out in engine.generate(request(1, max_tokens=120, logprobs=2)):
            tokens += out.token_ids
        return tokens

    # a client that reads gets every token under the same limit
    assert len(runner.run(read_all(), 60)) == 120
    assert stats()["num_requests_aborted_unread_total"] == 0

    async def stalled_then_read():
        outputs = engine.generate(request(0, max_tokens=200, logprobs=2))
        first = await anext(outputs)
        deadline = time.monotonic() + 30
        while stats()["num_requests_aborted_unread_total"] == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # the client reads nothing meanwhile
        while stats()["num_requests_running"] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        blocks_free = stats()["num_free_blocks"] == stats()["num_blocks"]
        tokens = list(first.token_ids)
        with pytest.raises(EngineError) as raised:
            async for out in outputs:  # what was queued before the abort, then the error
                tokens += out.token_ids
        return blocks_free, tokens, raised.value

    with structlog.testing.capture_logs() as logs:
        blocks_free, tokens, error = runner.run(stalled_then_read(), 60)
    assert stats()["num_requests_aborted_unread_total"] == 1
    assert blocks_free
    assert 3 <= len(tokens) < 200  # it was stopped well before max_tokens
    assert error.status == 408 and "--max-unread-tokens" in error.message
    assert any(line["event"] == "request aborted: its client is not reading" for line in logs)
