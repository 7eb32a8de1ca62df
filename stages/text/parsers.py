"""Reasoning and tool-call parsing of generated text, one delta at a time. Torch-free.

The detokenize stage runs one `OutputParser` per chat request that asked for it (the server's
`--reasoning-parser` and `--tool-call-parser`, as `vllm serve` names them). Each delta of text goes
through the reasoning splitter first (what lies between the think tags becomes `reasoning`), then
through the tool-call parser (calls come out as `ToolCallDelta`s, the markup never reaches the
content). A parser holds back the tail of the text that could still become a tag, as the stop
strings are held back. A call streams as vLLM's parsers stream it: its id and name as soon as the
name is written, then its arguments piece by piece as the model writes them (joined, they are the
arguments' JSON text); markup of another shape is parsed whole once it closes. Whatever does not
parse as a call goes out as content, unchanged, so a model that writes a malformed call loses
nothing written outside a call's arguments.

Feeding a text in any number of pieces gives the same calls and content as feeding it whole.
"""

from __future__ import annotations

import json
import re
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from stages.api import ToolCall, ToolCallDelta

# What json raises for text that is not a JSON value, or one nested past Python's recursion limit
# (a model can write a thousand "[" as readily as anything else): either way, not a tool call.
NOT_JSON = (ValueError, RecursionError)


@dataclass(slots=True)
class Parsed:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


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
    """Feed content text, get (content, pieces of tool calls)."""

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]: ...


class _NotACall(ValueError):
    """The text cannot be the start of a call in the streamed shape."""


# Between calls: whitespace, a JSON list's brackets and commas, Llama 3's `;`.
_SEPARATORS = frozenset(" \t\r\n[],;")
_ARGUMENT_KEYS = ("arguments", "parameters")
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.\-]*")
_ARGS_MARKER = "[ARGS]"  # Mistral's v11 tokenizer: `name[ARGS]{...}`


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _expect(text: str, i: int, char: str) -> int | None:
    """The index after `char` (after whitespace) at text[i]; None if the text ends first."""
    i = _skip_space(text, i)
    if i == len(text):
        return None
    if text[i] != char:
        raise _NotACall
    return i + 1


def _string(text: str, i: int) -> tuple[str, int] | None:
    """The JSON string (after whitespace) at text[i] and the index after it; None if it does not
    end in the text yet."""
    i = _skip_space(text, i)
    if i == len(text):
        return None
    if text[i] != '"':
        raise _NotACall
    end = i + 1
    while True:
        end = text.find('"', end)
        if end < 0:
            return None
        backslashes = 0
        while text[end - 1 - backslashes] == "\\":
            backslashes += 1
        if backslashes % 2 == 0:
            break
        end += 1
    try:
        value = json.loads(text[i : end + 1])
    except NOT_JSON:
        raise _NotACall from None
    return value, end + 1


def _json_call_head(text: str, i: int) -> tuple[str, int] | None:
    """`{"name": "...", "arguments": ` ("parameters" too) from text[i]: (the name, the index of
    the arguments' `{`); None while the text could still become that."""
    after = _expect(text, i, "{")
    key = None if after is None else _string(text, after)
    if key is None:
        return None
    if key[0] != "name":
        raise _NotACall
    after = _expect(text, key[1], ":")
    name = None if after is None else _string(text, after)
    if name is None:
        return None
    after = _expect(text, name[1], ",")
    arguments_key = None if after is None else _string(text, after)
    if arguments_key is None:
        return None
    if arguments_key[0] not in _ARGUMENT_KEYS:
        raise _NotACall
    after = _expect(text, arguments_key[1], ":")
    return None if after is None else _arguments_start(text, name[0], after)


def _named_args_head(text: str, i: int) -> tuple[str, int] | None:
    """Mistral's `name[ARGS]` from text[i]: (the name, the index of the arguments' `{`)."""
    marker = text.find(_ARGS_MARKER, i)
    if marker < 0:
        written = text[i : len(text) - partial_tail(text[i:], _ARGS_MARKER)].strip()
        if not _FUNCTION_NAME.fullmatch(written):
            raise _NotACall
        return None
    name = text[i:marker].strip()
    if not name or not _FUNCTION_NAME.fullmatch(name):
        raise _NotACall
    return _arguments_start(text, name, marker + len(_ARGS_MARKER))


def _arguments_start(text: str, name: str, i: int) -> tuple[str, int] | None:
    i = _skip_space(text, i)
    if i == len(text):
        return None
    if text[i] != "{":
        raise _NotACall
    return name, i


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except NOT_JSON:
        return False


class _CallMarkup:
    """The calls written in one stretch of call markup (the body of `<tool_call>...</tool_call>`,
    what follows [TOOL_CALLS], a Llama 3 JSON output), as they are written.

    A call in the usual shape, `{"name": ..., "arguments": {...}}` (or Mistral's `name[ARGS]
    {...}`), opens (id and name) as soon as its name and the `{` of its arguments are in; its
    arguments follow piece by piece, exactly as written, so the pieces join to the arguments'
    JSON text. Markup in any other shape is held until the stretch ends and parsed whole by
    `parse`. A call the stretch cuts short (the output ends, or the markup closes, inside its
    arguments) keeps what was written of them."""

    def __init__(
        self,
        first_index: int,
        parse: Callable[[str], list[ToolCall] | None],
        marker: str = "",
        named_args: bool = False,
    ) -> None:
        self.text = ""
        self.pos = 0  # where reading resumes
        self.next_index = first_index
        self.parse = parse
        self.marker = marker  # a start marker that may come again between calls (Mistral's)
        self.named_args = named_args
        self.opened = 0  # calls streamed from this stretch
        self.held_from: int | None = None  # text not in the streamed shape: parsed at the end
        self.in_arguments = False
        self.needs_close = False  # the call object's `}` after its arguments (not Mistral v11)
        self.arguments_start = self.sent = 0
        self.depth, self.in_string, self.escaped = 0, False, False

    def feed(self, text: str) -> list[ToolCallDelta]:
        self.text += text
        out: list[ToolCallDelta] = []
        while self.held_from is None:
            if self.in_arguments:
                closed = self._read_arguments()
                if self.pos > self.sent:
                    piece = self.text[self.sent : self.pos]
                    out.append(ToolCallDelta(self.next_index - 1, arguments=piece))
                    self.sent = self.pos
                if not closed:
                    break
                self.in_arguments = False
                if not _is_json_object(self.text[self.arguments_start : self.pos]):
                    self.held_from = self.pos
                continue
            if self.needs_close:
                after = _skip_space(self.text, self.pos)
                if after == len(self.text):
                    break
                if self.text[after] != "}":
                    self.held_from = after
                    break
                self.pos, self.needs_close = after + 1, False
                continue
            try:
                head = self._head()
            except _NotACall:
                self.held_from = self.pos
                break
            if head is None:
                break
            name, self.pos, self.needs_close = head
            out.append(ToolCallDelta(self.next_index, new_tool_call_id(), name))
            self.next_index += 1
            self.opened += 1
            self.in_arguments = True
            self.arguments_start = self.sent = self.pos
            self.depth, self.in_string, self.escaped = 0, False, False
        return out

    def close(self) -> tuple[list[ToolCallDelta], str]:
        """At the end of the stretch: the calls in the text held (parsed whole) and the text
        that is no call; with nothing streamed, the whole stretch is parsed (no calls: the
        caller gives the markup back as content)."""
        if not self.opened:
            rest = self.text
        elif self.in_arguments:
            return [], ""
        else:
            start = self.pos if self.held_from is None else self.held_from
            rest = self.text[start:]
            if all(c in _SEPARATORS for c in rest):
                return [], ""
        calls = self.parse(rest) if self.opened == 0 else _calls_from_json(rest, ",;[]")
        if not calls:
            return [], rest
        pieces = [
            ToolCallDelta(self.next_index + i, call.id, call.name, call.arguments)
            for i, call in enumerate(calls)
        ]
        self.next_index += len(pieces)
        return pieces, ""

    def _head(self) -> tuple[str, int, bool] | None:
        """The next call's (name, arguments' start, whether its object closes after them)."""
        text, i = self.text, self.pos
        while i < len(text):
            if self.marker and text.startswith(self.marker, i):
                i += len(self.marker)
            elif self.marker and self.marker.startswith(text[i:]):
                return None
            elif text[i] in _SEPARATORS:
                i += 1
            else:
                break
        self.pos = i
        if i == len(text):
            return None
        if text[i] == "{":
            head = _json_call_head(text, i)
            return None if head is None else (head[0], head[1], True)
        if self.named_args:
            head = _named_args_head(text, i)
            return None if head is None else (head[0], head[1], False)
        raise _NotACall

    def _read_arguments(self) -> bool:
        """Reads on through the arguments' JSON; True once their object has closed."""
        text, i = self.text, self.pos
        depth, in_string, escaped = self.depth, self.in_string, self.escaped
        closed = False
        while i < len(text):
            char = text[i]
            i += 1
            if in_string:
                if escaped:
                    escaped = False
                elif char == "\\":
                    escaped = True
                elif char == '"':
                    in_string = False
            elif char == '"':
                in_string = True
            elif char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    closed = True
                    break
        self.pos, self.depth, self.in_string, self.escaped = i, depth, in_string, escaped
        return closed


class TaggedToolCalls:
    """Calls written between a start tag and an end tag (Hermes / Qwen2.5 `<tool_call>{...}
    </tool_call>`), or from a start marker to the end of the output (Mistral's `[TOOL_CALLS]`)."""

    def __init__(
        self,
        start: str,
        end: str | None,
        parse: Callable[[str], list[ToolCall] | None],
        named_args: bool = False,
    ) -> None:
        self.start, self.end, self.parse = start, end, parse
        self.named_args = named_args
        self.markup: _CallMarkup | None = None  # inside a call's markup
        self.num_calls = 0
        self.held = ""
        self.called = False  # once a call began, whitespace between calls is not content
        self.blank = ""  # whitespace after a call, dropped unless more content follows

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        buf, content, calls = self.held + text, list[str](), list[ToolCallDelta]()
        self.held = ""

        def emit(segment: str) -> None:
            if self.called:
                segment, self.blank = self.blank + segment, ""
                if not segment.strip():
                    self.blank = segment
                    return
            content.append(segment)

        while buf or (final and self.markup is not None):
            if self.markup is None:
                index = buf.find(self.start)
                if index >= 0:
                    emit(buf[:index])
                    self.blank = ""
                    buf = buf[index + len(self.start) :]
                    marker = self.start if self.end is None else ""
                    self.markup = _CallMarkup(self.num_calls, self.parse, marker, self.named_args)
                    self.called = True
                    continue
                keep = 0 if final else partial_tail(buf, self.start)
                emit(buf[: len(buf) - keep])
                self.held = buf[len(buf) - keep :]
                break
            markup = self.markup
            index = buf.find(self.end) if self.end is not None else -1
            if index < 0 and not final:
                keep = partial_tail(buf, self.end) if self.end is not None else 0
                calls += markup.feed(buf[: len(buf) - keep])
                self.held = buf[len(buf) - keep :]
                break
            calls += markup.feed(buf if index < 0 else buf[:index])
            buf = "" if index < 0 else buf[index + len(self.end or "") :]
            whole, rest = markup.close()
            calls += whole
            if not markup.opened and not whole:
                closed = self.end if index >= 0 and self.end is not None else ""
                emit(self.start + markup.text + closed)
            elif rest:
                emit(rest)
            self.num_calls = markup.next_index
            self.markup = None
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
        self.written = ""  # the output so far, given back whole if it holds no call
        self.passthrough = False
        self.markup: _CallMarkup | None = None

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        if self.passthrough:
            return text, []
        self.written += text
        calls: list[ToolCallDelta] = []
        if self.markup is None:
            head = self.written.lstrip()
            if head.startswith(self.TAG) or head.startswith("{"):
                body = head[len(self.TAG) :] if head.startswith(self.TAG) else head
                self.markup = _CallMarkup(0, lambda t: _calls_from_json(t, separators=";"))
                calls = self.markup.feed(body)
            elif head and not self.TAG.startswith(head):
                self.passthrough = True
                return self.written, []
            elif final:
                return self.written, []
        else:
            calls = self.markup.feed(text)
        if not final or self.markup is None:
            return "", calls
        whole, rest = self.markup.close()
        if not self.markup.opened and not whole:
            return self.written, []
        return rest, calls + whole


def tool_call_parser(name: str) -> ToolCallParser:
    if name == "hermes":
        return TaggedToolCalls("<tool_call>", "</tool_call>", _hermes_body)
    if name == "mistral":
        return TaggedToolCalls("[TOOL_CALLS]", None, _mistral_body, named_args=True)
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
        calls: list[ToolCallDelta] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content, final)
        return Parsed(content, reasoning, _joined(calls))


def _joined(pieces: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Consecutive pieces of one call as one (a call that opens and is written in one delta)."""
    out: list[ToolCallDelta] = []
    for piece in pieces:
        last = out[-1] if out else None
        if last is not None and last.index == piece.index and not piece.id:
            out[-1] = ToolCallDelta(
                last.index, last.id, last.name, last.arguments + piece.arguments
            )
        else:
            out.append(piece)
    return out


def prompt_opens_reasoning(prompt_text: str, reasoning_parser: str | None) -> bool:
    """Whether the rendered prompt ends inside an open think tag (templates that start the
    assistant's turn with `<think>`), so the output begins in reasoning."""
    if reasoning_parser is None:
        return False
    return prompt_text.rstrip().endswith(REASONING_PARSERS[reasoning_parser].start)
