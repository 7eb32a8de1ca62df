"""Chat templates rendered in a Jinja2 sandbox, as transformers' `apply_chat_template` does.

Torch-free: the render process imports it. Templates from model files are untrusted code, hence
the immutable sandbox; every template failure becomes a `ChatTemplateError` (a 400 for the user).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


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


# The model's template and a few of the requests' own (--trust-request-chat-template); bounded,
# since clients choose the latter.
@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
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
