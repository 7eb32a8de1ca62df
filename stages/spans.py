"""Trace span kinds (pipeline/trace.py): what each stage records per unit of work."""

from __future__ import annotations

SPAN_RENDER, SPAN_PLAN, SPAN_RESULT, SPAN_FORWARD, SPAN_DETOKENIZE = 1, 2, 3, 4, 5
# The server's own: one output, from its deltas message's arrival to the server asking for the
# next (the chunk it became encoded and written)
SPAN_DELIVER = 6
SPAN_NAMES = {
    SPAN_RENDER: "render",
    SPAN_PLAN: "plan",
    SPAN_RESULT: "result",
    SPAN_FORWARD: "forward",
    SPAN_DETOKENIZE: "detokenize",
    SPAN_DELIVER: "deliver",
}
# Every span of one engine step (plan, forward, result, detokenize, deliver) carries the step's
# id as its `link`; a forward span's `aux` is the microseconds of it spent sampling.
