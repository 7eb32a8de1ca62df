"""Chat templates rendered in a Jinja2 sandbox, as transformers' `apply_chat_template` does.

Torch-free: the render process imports it. Templates from model files are untrusted code, hence
the immutable sandbox; every template failure becomes a `ChatTemplateError` (a 400 for the user).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

CONTENT_FORMATS = ("auto", "string", "openai")


class ChatTemplateError(ValueError):
    """The template rejected the conversation or could not be compiled or rendered."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters, which no chat template wants.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format_string: str) -> str:
    return datetime.now().strftime(format_string)


def _environment() -> ImmutableSandboxedEnvironment:
    return ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )


# The model's template and a few of the requests' own (--trust-request-chat-template); bounded,
# since clients choose the latter.
@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = _environment()
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateError as error:
        raise ChatTemplateError(f"the chat template does not compile: {error}") from error


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    bos_token: str | None = None,
    eos_token: str | None = None,
    **template_kwargs: Any,
) -> str:
    """The prompt text for `messages`; tokenize it with `TokenizerBundle.encode`."""
    try:
        return _compile(template).render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token or "",
            eos_token=eos_token or "",
            **template_kwargs,
        )
    except ChatTemplateError:
        raise
    except jinja2.exceptions.TemplateError as error:
        raise ChatTemplateError(f"the chat template rejected the conversation: {error}") from error
    except (TypeError, ValueError, KeyError, AttributeError) as error:
        raise ChatTemplateError(
            f"the chat template failed on this conversation: {error}"
        ) from error


def resolve_content_format(content_format: str, template: str) -> str:
    """--chat-template-content-format for this template: "string" or "openai" as given, and
    for "auto" the one the template reads (detect_content_format)."""
    if content_format not in CONTENT_FORMATS:
        raise ValueError(f"content format {content_format!r} is not one of {CONTENT_FORMATS}")
    return detect_content_format(template) if content_format == "auto" else content_format


@lru_cache(maxsize=16)  # bounded as _compile is
def detect_content_format(template: str) -> str:
    """vLLM's detection: "openai" (content as a list of parts) when the template loops over a
    message's content (`{% for part in message['content'] %}`, through any variable set from
    `messages`), "string" otherwise, and for a template that does not parse."""
    try:
        root = _environment().parse(template)
    except jinja2.exceptions.TemplateError:
        return "string"
    message_names = {name for _, name in _loops_over(root, _names_set_from(root, "messages"))}
    loops = _loops_over(root, message_names, key="content")
    return "openai" if next(loops, None) is not None else "string"


def _reads(node: jinja2.nodes.Node, names: set[str], key: str | None = None) -> bool:
    """Whether `node` is one of `names` (or its `key` item), through filters, tests and
    slices: `messages`, `messages[1:]`, `message['content'] | list`, `message.content`."""
    if isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)):
        return node.node is not None and _reads(node.node, names, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _reads(node.node, names, key)
    if key is None:
        return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name in names
    if isinstance(node, jinja2.nodes.Getitem):
        item = node.arg
        return (
            isinstance(item, jinja2.nodes.Const) and item.value == key and _reads(node.node, names)
        )
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == key and _reads(node.node, names)
    return False


def _names_set_from(root: jinja2.nodes.Template, name: str) -> set[str]:
    """`name` and every variable `{% set %}` from it, or from one of those."""
    names = {name}
    grown = True
    while grown:
        grown = False
        for assign in root.find_all(jinja2.nodes.Assign):
            target = assign.target
            if (
                isinstance(target, jinja2.nodes.Name)
                and target.name not in names
                and _reads(assign.node, names)
            ):
                names.add(target.name)
                grown = True
    return names


def _loops_over(
    root: jinja2.nodes.Template, names: set[str], key: str | None = None
) -> Iterator[tuple[jinja2.nodes.For, str]]:
    """The `{% for x in ... %}` loops over one of `names` (or its `key` item), with x."""
    for loop in root.find_all(jinja2.nodes.For):
        if isinstance(loop.target, jinja2.nodes.Name) and _reads(loop.iter, names, key):
            yield loop, loop.target.name
