"""Trace span kinds (pipeline/trace.py): what each stage records per unit of work."""

from __future__ import annotations

SPAN_RENDER, SPAN_PLAN, SPAN_RESULT, SPAN_FORWARD, SPAN_DETOKENIZE = 1, 2, 3, 4, 5
SPAN_NAMES = {
    SPAN_RENDER: "render",
    SPAN_PLAN: "plan",
    SPAN_RESULT: "result",
    SPAN_FORWARD: "forward",
    SPAN_DETOKENIZE: "detokenize",
}
