"""OpenAI chat messages to prompt text: the request-level rules (continue_final_message, text
content parts) around stages.text.chat_template's sandboxed rendering, with errors as 400s."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from stages.api import EngineError
from stages.text.chat_template import ChatTemplateError, resolve_content_format
from stages.text.chat_template import render_chat as render_template
from stages.text.template_sandbox import TemplateSandbox


def render_chat(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    bos_token: str | None = None,
    eos_token: str | None = None,
    content_format: str = "auto",
    sandbox: TemplateSandbox | None = None,
) -> str:
    """The prompt text for these messages; EngineError (400) for anything the request got wrong.

    `content_format` is --chat-template-content-format: a message's content reaches the
    template as a string (text parts joined by newlines), as OpenAI's list of text parts
    ("openai"), or as the template reads it ("auto"). A `sandbox` renders it in a child process,
    with its time and memory limits (a request's own template)."""
    if template is None:
        raise EngineError("this model has no chat template; use /v1/completions", param="messages")
    if continue_final_message and add_generation_prompt:
        raise EngineError(
            "continue_final_message and add_generation_prompt cannot both be true",
            param="continue_final_message",
        )
    if continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
        raise EngineError(
            "continue_final_message needs a final assistant message", param="messages"
        )
    reserved = {"messages", "add_generation_prompt", "tools", "bos_token", "eos_token"}
    extra = {k: v for k, v in (template_kwargs or {}).items() if k not in reserved}
    as_parts = resolve_content_format(content_format, template) == "openai"
    try:
        text = (sandbox.render if sandbox is not None else render_template)(
            template,
            [_normalise(m, as_parts) for m in messages],
            add_generation_prompt=add_generation_prompt,
            tools=[dict(t) for t in tools] if tools else None,
            bos_token=bos_token,
            eos_token=eos_token,
            **extra,
        )
    except ChatTemplateError as exc:
        raise EngineError(f"chat template error: {exc}", param="messages") from None
    if continue_final_message:
        # as transformers cuts it: after the final message's text (as parts, the last one's)
        texts = _texts_of(messages[-1].get("content"))
        final = (texts[-1] if texts else "") if as_parts else "\n".join(texts)
        cut = text.rfind(final) if final else -1
        if cut >= 0:
            text = text[: cut + len(final)]
    return text


def _normalise(message: Mapping[str, Any], as_parts: bool) -> dict[str, Any]:
    """Content as the template reads it, as vLLM hands it over: a list of text parts becomes
    one string (`as_parts` false), or any content such a list (a tool's text stays a string);
    no content (an assistant's tool-call turn, `null` or left out, as the OpenAI SDK sends it
    back) is "" as a string, which templates that concatenate content can add to, or no parts;
    an assistant's tool-call arguments (JSON text on the wire) become objects, which templates
    render with `tojson`."""
    out = dict(message)
    content = out.get("content")
    if as_parts and out.get("role") != "tool":
        out["content"] = [{"type": "text", "text": text} for text in _texts_of(content)]
    elif content is None or isinstance(content, list):
        out["content"] = _text_of(content)
    calls = out.get("tool_calls")
    if isinstance(calls, list):
        out["tool_calls"] = [_with_parsed_arguments(call) for call in calls]
    return out


def _with_parsed_arguments(call: Any) -> Any:
    """The call with its arguments parsed (the server has checked that they are JSON), and no
    arguments as {} (vLLM's reading of "")."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"]) if function["arguments"] else {}
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def _text_of(content: Any) -> str:
    return "\n".join(_texts_of(content))


def _texts_of(content: Any) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    parts = []
    for part in content:
        if isinstance(part, Mapping) and part.get("type") == "text":
            parts.append(str(part.get("text", "")))
        else:
            raise EngineError("only text content parts are supported", param="messages")
    return parts
