"""Reasoning and tool-call parsing of generated text, one delta at a time. Torch-free.

The detokenize stage runs one `OutputParser` per chat request that asked for it (the server's
`--reasoning-parser` and `--tool-call-parser`, as `vllm serve` names them). Each delta of text goes
through the reasoning splitter first (what lies between the think tags becomes `reasoning`), then
through the tool-call parser (complete calls come out as `ToolCall`s, the markup never reaches the
content). A parser holds back the tail of the text that could still become a tag, as the stop
strings are held back, and a tool call is emitted whole once its closing markup (or the end of the
output) arrives: its arguments are then known to be valid JSON. Whatever does not parse as a call
goes out as content, unchanged, so a model that writes a malformed call loses nothing.

Feeding a text in any number of pieces gives the same result as feeding it whole.
"""

from __future__ import annotations

import json
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from stages.api import ToolCall

# What json raises for text that is not a JSON value, or one nested past Python's recursion limit
# (a model can write a thousand "[" as readily as anything else): either way, not a tool call.
NOT_JSON = (ValueError, RecursionError)


@dataclass(slots=True)
class Parsed:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


def partial_tail(text: str, tag: str) -> int:
    """Length of the longest tail of text that is a proper prefix of tag."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


# -- reasoning ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ThinkTags:
    start: str
    end: str
    starts_inside: bool  # the output begins in reasoning (the template opened it, or it is implied)


REASONING_PARSERS: dict[str, ThinkTags] = {
    # DeepSeek-R1 and its distills: reasoning from the first token to </think>; a leading <think>
    # the model writes itself is dropped. Without </think> the whole output is reasoning.
    "deepseek_r1": ThinkTags("<think>", "</think>", starts_inside=True),
    # Qwen3 and QwQ-style: reasoning only inside <think>...</think>, unless the prompt already
    # opened the tag (render sees the prompt and says so); enable_thinking=False leaves content.
    "qwen3": ThinkTags("<think>", "</think>", starts_inside=False),
}


class ReasoningSplitter:
    """Splits a stream of text into reasoning (between the tags) and content (the rest), and
    counts the output tokens of the reasoning (vLLM's usage.completion_tokens_details).

    A token counts when any character of its text turns out to be reasoning (the tags are not);
    a token with no text of its own (a partial UTF-8 character, text held back for a stop
    string) takes the kind of the next character, or of where the output ended."""

    def __init__(self, tags: ThinkTags, starts_inside: bool) -> None:
        self.tags = tags
        self.inside = starts_inside
        self.done = False  # the reasoning ended: everything after is content
        self.at_start = starts_inside  # a <think> the model repeats at the start is dropped
        self.held = ""
        self.num_reasoning_tokens = 0
        self._fed = 0  # characters fed so far
        # Each classified character from position _kinds_from on: 1 reasoning, 0 anything else;
        # the characters are classified in order, up to the held-back tail.
        self._kinds = bytearray()
        self._kinds_from = 0
        self._tokens: deque[tuple[int, int]] = deque()  # (start, end) of tokens not yet counted

    def feed(self, text: str, final: bool, token: bool = True) -> tuple[str, str]:
        """(reasoning, content) of the text, holding back what could still be a tag; `token`:
        the text is one output token's (False for text of no token)."""
        if token:
            self._tokens.append((self._fed, self._fed + len(text)))
        self._fed += len(text)
        buf, reasoning, content = self.held + text, list[str](), list[str]()
        self.held = ""
        while buf:
            if self.done:
                content.append(buf)
                self._classify(len(buf), False)
                break
            if self.at_start:
                stripped = buf.lstrip()
                if stripped.startswith(self.tags.start):
                    rest = stripped[len(self.tags.start) :]
                    self._classify(len(buf) - len(rest), False)
                    buf = rest
                elif not final and self.tags.start.startswith(stripped):
                    self.held = buf
                    break
                self.at_start = False
                continue
            tag = self.tags.end if self.inside else self.tags.start
            index = buf.find(tag)
            out = reasoning if self.inside else content
            if index >= 0:
                out.append(buf[:index])
                self._classify(index, self.inside)
                self._classify(len(tag), False)
                buf = buf[index + len(tag) :]
                if self.inside:
                    self.inside, self.done = False, True
                else:
                    self.inside = True
                continue
            keep = 0 if final else partial_tail(buf, tag)
            out.append(buf[: len(buf) - keep])
            self._classify(len(buf) - keep, self.inside)
            self.held = buf[len(buf) - keep :]
            break
        self._count(final)
        return "".join(reasoning), "".join(content)

    def _classify(self, num_chars: int, is_reasoning: bool) -> None:
        self._kinds.extend(b"\x01" * num_chars if is_reasoning else bytes(num_chars))

    def _count(self, final: bool) -> None:
        """Counts the tokens whose characters are all classified now (all of them at the end)."""
        kinds, base = self._kinds, self._kinds_from
        classified = base + len(kinds)
        while self._tokens:
            start, end = self._tokens[0]
            end = max(end, start + 1)  # no text of its own: the next character decides
            if end > classified:
                if not final:
                    break
                # the output ended: what is left takes the state it ended in
                self.num_reasoning_tokens += any(kinds[start - base :]) or (
                    self.inside and not self.done
                )
            else:
                self.num_reasoning_tokens += any(kinds[start - base : end - base])
            self._tokens.popleft()
        # Only the characters of tokens still to count are kept.
        keep_from = self._tokens[0][0] if self._tokens else classified
        del kinds[: keep_from - base]
        self._kinds_from = keep_from


# -- tool calls -----------------------------------------------------------------------------------


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _call_from(value: Any) -> ToolCall | None:
    """A tool call from a parsed JSON value {"name": ..., "arguments" | "parameters": {...}}."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except NOT_JSON:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(new_tool_call_id(), value["name"], json.dumps(arguments, ensure_ascii=False))


def forced_tool_calls(text: str, forced: str) -> tuple[ToolCall, ...] | None:
    """The calls in the output of a request whose tool_choice forced them (its grammar made the
    text JSON): `forced` names the function, whose arguments are the text, or is "required", for
    a JSON list of {"name", "parameters"}. None when the text is not that (cut short by
    max_tokens, say): it then stays content."""
    if forced != "required":
        return (ToolCall(new_tool_call_id(), forced, text),)
    try:
        values = json.loads(text)
    except NOT_JSON:
        return None
    if not isinstance(values, list) or not values:
        return None
    calls = [_call_from(value) for value in values]
    return None if any(call is None for call in calls) else tuple(c for c in calls if c)


def _json_values(text: str, separators: str = "") -> list[Any] | None:
    """Every JSON value in text, back to back (whitespace or `separators` between); None if any
    part of the text is not JSON."""
    decoder, values, index = json.JSONDecoder(), list[Any](), 0
    while True:
        while index < len(text) and (text[index].isspace() or text[index] in separators):
            index += 1
        if index == len(text):
            return values
        try:
            value, index = decoder.raw_decode(text, index)
        except NOT_JSON:
            return None
        values.append(value)


def _calls_from_json(text: str, separators: str = "") -> list[ToolCall] | None:
    values = _json_values(text, separators)
    if not values:
        return None
    flat = [v for value in values for v in (value if isinstance(value, list) else [value])]
    calls = [_call_from(v) for v in flat]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


class ToolCallParser(Protocol):
    """Feed content text, get (content, complete tool calls)."""

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]: ...


class TaggedToolCalls:
    """Calls written between a start tag and an end tag (Hermes / Qwen2.5 `<tool_call>{...}
    </tool_call>`), or from a start marker to the end of the output (Mistral's `[TOOL_CALLS]`)."""

    def __init__(
        self, start: str, end: str | None, parse: Callable[[str], list[ToolCall] | None]
    ) -> None:
        self.start, self.end, self.parse = start, end, parse
        self.inside = False
        self.held = ""
        self.called = False  # once a call began, whitespace between calls is not content
        self.blank = ""  # whitespace after a call, dropped unless more content follows

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        buf, content, calls = self.held + text, list[str](), list[ToolCall]()
        self.held = ""

        def emit(segment: str) -> None:
            if self.called:
                segment, self.blank = self.blank + segment, ""
                if not segment.strip():
                    self.blank = segment
                    return
            content.append(segment)

        while buf:
            if not self.inside:
                index = buf.find(self.start)
                if index >= 0:
                    emit(buf[:index])
                    self.blank = ""
                    buf = buf[index + len(self.start) :]
                    self.inside = self.called = True
                    continue
                keep = 0 if final else partial_tail(buf, self.start)
                emit(buf[: len(buf) - keep])
                self.held = buf[len(buf) - keep :]
                break
            index = buf.find(self.end) if self.end is not None else -1
            if index < 0 and not final:
                self.held = buf
                break
            body = buf if index < 0 else buf[:index]
            buf = "" if index < 0 else buf[index + len(self.end or "") :]
            self.inside = False
            parsed = self.parse(body)
            if parsed:
                calls.extend(parsed)
            else:
                closed = self.end if index >= 0 and self.end is not None else ""
                emit(self.start + body + closed)
        return "".join(content), calls


def _hermes_body(body: str) -> list[ToolCall] | None:
    return _calls_from_json(body)


def _mistral_body(body: str) -> list[ToolCall] | None:
    """`[{"name":..., "arguments":...}, ...]`, or the v11 tokenizer's `name[ARGS]{...}`."""
    calls = _calls_from_json(body)
    if calls is not None:
        return calls
    name, marker, arguments = body.partition("[ARGS]")
    if not marker or not name.strip():
        return None
    return _calls_from_json(json.dumps({"name": name.strip(), "arguments": arguments.strip()}))


class Llama3JsonToolCalls:
    """Llama 3.1/3.2 JSON calls: the whole output is `{"name": ..., "parameters": {...}}` (several
    separated by `;`), maybe after `<|python_tag|>`. Output that starts otherwise is content."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self.held = ""
        self.passthrough = False

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        if self.passthrough:
            return text, []
        buf = self.held + text
        head = buf.lstrip()
        could_be_call = (
            not head
            or head.startswith("{")
            or head.startswith(self.TAG)
            or self.TAG.startswith(head)
        )
        if not could_be_call:
            self.passthrough, self.held = True, ""
            return buf, []
        if not final:
            self.held = buf
            return "", []
        self.held = ""
        body = head[len(self.TAG) :] if head.startswith(self.TAG) else head
        calls = _calls_from_json(body, separators=";")
        return ("", calls) if calls else (buf, [])


def tool_call_parser(name: str) -> ToolCallParser:
    if name == "hermes":
        return TaggedToolCalls("<tool_call>", "</tool_call>", _hermes_body)
    if name == "mistral":
        return TaggedToolCalls("[TOOL_CALLS]", None, _mistral_body)
    if name == "llama3_json":
        return Llama3JsonToolCalls()
    raise ValueError(f"unknown tool-call parser {name!r}; choose from {sorted(TOOL_CALL_PARSERS)}")


TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")


class OutputParser:
    """One request's parsers: reasoning first, then tool calls in what is left."""

    def __init__(
        self,
        reasoning_parser: str | None = None,
        tool_call_parser_name: str | None = None,
        reasoning_starts_inside: bool = False,
    ) -> None:
        self.reasoning: ReasoningSplitter | None = None
        if reasoning_parser is not None:
            tags = REASONING_PARSERS[reasoning_parser]
            self.reasoning = ReasoningSplitter(tags, tags.starts_inside or reasoning_starts_inside)
        self.tools = tool_call_parser(tool_call_parser_name) if tool_call_parser_name else None

    @property
    def num_reasoning_tokens(self) -> int:
        """Output tokens fed so far that lie inside the reasoning (final once `final` was fed)."""
        return 0 if self.reasoning is None else self.reasoning.num_reasoning_tokens

    def feed(self, text: str, final: bool, token: bool = True) -> Parsed:
        """`token`: the text is one output token's (the reasoning counts tokens)."""
        reasoning = ""
        content = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text, final, token)
        calls: list[ToolCall] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content, final)
        return Parsed(content, reasoning, calls)


def prompt_opens_reasoning(prompt_text: str, reasoning_parser: str | None) -> bool:
    """Whether the rendered prompt ends inside an open think tag (templates that start the
    assistant's turn with `<think>`), so the output begins in reasoning."""
    if reasoning_parser is None:
        return False
    return prompt_text.rstrip().endswith(REASONING_PARSERS[reasoning_parser].start)
