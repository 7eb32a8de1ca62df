"""--stream-interval (vLLM's): a stream's first token goes at once, then outputs of at least the
interval's tokens until the last, which goes at once; the text and tokens are those of a stream
sent token by token, and a request's own `stream_interval` only raises the engine's."""

from __future__ import annotations

import asyncio

import msgspec

from stages.api import EngineError, RequestOutput
from stages.engine_readers import next_output
from stages.engine_state import Flight
from tests.stages.test_recovery import request


def token(i: int, finish: str | None = None) -> RequestOutput:
    return RequestOutput("r", f"<{i}>", (i,), None, 3, i + 1, finish_reason=finish)


def test_an_output_waits_for_the_interval_the_first_and_the_last_do_not():
    async def scenario():
        flight = Flight(request(0), asyncio.Queue())
        queue = flight.queue
        queue.put_nowait(token(0))
        first = await next_output(flight, 0)  # the first token: at once
        gathering = asyncio.create_task(next_output(flight, 3))
        for i in (1, 2):
            queue.put_nowait(token(i))
            await asyncio.sleep(0.01)
            assert not gathering.done()  # two tokens of the three it waits for
        queue.put_nowait(token(3))
        second = await asyncio.wait_for(gathering, 1)
        queue.put_nowait(token(4, finish="length"))  # the last: at once, however few
        last = await asyncio.wait_for(next_output(flight, 3), 1)
        queue.put_nowait(token(5))
        queue.put_nowait(EngineError("a stage failed", 500))
        before_error = await asyncio.wait_for(next_output(flight, 3), 1)
        error = await asyncio.wait_for(next_output(flight, 3), 1)
        return first, second, last, before_error, error

    first, second, last, before_error, error = asyncio.run(scenario())
    assert first.token_ids == (0,)
    assert second.token_ids == (1, 2, 3) and second.text == "<1><2><3>"
    assert last.token_ids == (4,) and last.finish_reason == "length"
    assert before_error.token_ids == (5,)  # what came before an error goes first
    assert isinstance(error, EngineError)


async def outputs_of(engine, req):
    return [out async for out in engine.generate(req)]


def test_outputs_gather_the_interval_and_keep_the_text(pipeline):
    one_by_one, runner_1 = pipeline()
    plain = runner_1.run(outputs_of(one_by_one, request(0, max_tokens=23)), 60)
    engine, runner = pipeline(stream_interval=4)
    # 4 is the engine's: a request asking for 2 gets 4, one asking for 6 gets 6
    asked_less = msgspec.structs.replace(request(0, max_tokens=23), stream_interval=2)
    asked_more = msgspec.structs.replace(request(0, max_tokens=23), stream_interval=6)
    for req, interval in ((request(0, max_tokens=23), 4), (asked_less, 4), (asked_more, 6)):
        outs = runner.run(outputs_of(engine, req), 60)
        sizes = [len(out.token_ids) for out in outs]
        assert sum(sizes) == 23, sizes
        assert all(size >= interval for size in sizes[1:-1]), sizes
        assert len(outs) <= 2 + 22 // interval, sizes  # no more outputs than the interval allows
        assert outs[-1].finish_reason == "length"
        assert [t for out in outs for t in out.token_ids] == [
            t for out in plain for t in out.token_ids
        ]
        assert "".join(out.text for out in outs) == "".join(out.text for out in plain)
        assert len(plain) > len(outs)
