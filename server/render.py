"""The answer of /v1/chat/completions/render and /v1/completions/render: a rendered request in
vLLM's shape of a token-in request (`GenerateRequest` of vllm.entrypoints.serve.disagg), plus the
prompt's text."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from stages.api import GenerateRequest, RenderedPromptInfo, SamplingParams, StructuredOutput


def token_in_request(
    body: Any, model: str, request: GenerateRequest, rendered: RenderedPromptInfo
) -> dict[str, Any]:
    """`body` is the validated chat or text completion request `request` was made from."""
    stream_options = body.stream_options
    return {
        "request_id": request.request_id,
        "token_ids": rendered.token_ids,
        "prompt": rendered.text,
        "sampling_params": sampling_params_body(request.sampling, rendered.max_tokens, body.n),
        "model": model,
        "stream": body.stream,
        "stream_options": None if stream_options is None else msgspec.to_builtins(stream_options),
        "priority": request.priority,
    }


def sampling_params_body(sampling: SamplingParams, max_tokens: int, n: int) -> dict[str, Any]:
    """Every sampling field under vLLM's name, max_tokens as render resolved it."""
    fields = msgspec.structs.asdict(sampling)
    structured = fields.pop("structured")
    return {
        **msgspec.to_builtins(fields),
        "n": n,
        "max_tokens": max_tokens,
        "structured_outputs": None if structured is None else _structured_outputs(structured),
    }


def _structured_outputs(spec: StructuredOutput) -> dict[str, Any]:
    """vLLM's StructuredOutputsParams: the one constraint under its kind's key."""
    if spec.kind == "json_object":
        return {"json_object": True}
    if spec.kind in ("json", "choice"):  # carried as JSON text
        return {spec.kind: json.loads(spec.value)}
    return {spec.kind: spec.value}
