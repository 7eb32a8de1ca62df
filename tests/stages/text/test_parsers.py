"""Reasoning and tool-call parsing: whole outputs as vLLM's parsers read them, and the same result
however the text is split into deltas (every split point, and one character at a time)."""

from __future__ import annotations

import json

import pytest

from stages.text.parsers import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    OutputParser,
    Parsed,
    forced_tool_calls,
    prompt_opens_reasoning,
)


def run(parser: OutputParser, pieces: list[str]) -> Parsed:
    total = Parsed()
    for i, piece in enumerate(pieces):
        out = parser.feed(piece, final=i == len(pieces) - 1)
        total.content += out.content
        total.reasoning += out.reasoning
        total.tool_calls += out.tool_calls
    return total


def splits(text: str) -> list[list[str]]:
    """The text whole, cut in two at every point, and one character at a time."""
    cuts = [[text]] + [[text[:i], text[i:]] for i in range(1, len(text))]
    return [*cuts, list(text)]


def joined(parsed: Parsed) -> list[list[str]]:
    """The calls as a client joins their pieces: [id, name, arguments] by index."""
    calls: list[list[str]] = []
    for piece in parsed.tool_calls:
        if piece.id:
            assert piece.index == len(calls) and piece.name
            calls.append([piece.id, piece.name, piece.arguments])
        else:
            assert not piece.name and piece.index == len(calls) - 1  # pieces come in order
            calls[piece.index][2] += piece.arguments
    return calls


def calls(parsed: Parsed) -> list[tuple[str, dict]]:
    return [(name, json.loads(arguments)) for _, name, arguments in joined(parsed)]


def check_every_split(make, text: str) -> Parsed:
    whole = run(make(), [text])
    expected = [call[1:] for call in joined(whole)]
    for pieces in splits(text):
        got = run(make(), pieces)
        assert (got.content, got.reasoning, [call[1:] for call in joined(got)]) == (
            whole.content,
            whole.reasoning,
            expected,
        ), pieces
    return whole


# -- reasoning ------------------------------------------------------------------------------------


def test_deepseek_r1_reasoning_until_end_tag():
    text = "<think>Let me add 2 and 2.</think>\n\nIt is 4."
    out = check_every_split(lambda: OutputParser("deepseek_r1"), text)
    assert out.reasoning == "Let me add 2 and 2."
    assert out.content == "\n\nIt is 4."
    # The template opened the tag: the output starts inside the reasoning.
    out = check_every_split(lambda: OutputParser("deepseek_r1"), "hmm </think>Four")
    assert (out.reasoning, out.content) == ("hmm ", "Four")


def test_deepseek_r1_without_end_tag_is_all_reasoning():
    out = check_every_split(lambda: OutputParser("deepseek_r1"), "still thinking <thi")
    assert (out.reasoning, out.content) == ("still thinking <thi", "")


def test_qwen3_content_unless_think_tag_opens():
    out = check_every_split(lambda: OutputParser("qwen3"), "No reasoning here, 2 < 3.")
    assert (out.reasoning, out.content) == ("", "No reasoning here, 2 < 3.")
    out = check_every_split(lambda: OutputParser("qwen3"), "<think>\nab</think>\n\ncd")
    assert (out.reasoning, out.content) == ("\nab", "\n\ncd")
    # A prompt that ends inside <think> (thinking templates) starts the output in reasoning.
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n", "qwen3")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n", "qwen3")
    out = check_every_split(
        lambda: OutputParser("qwen3", reasoning_starts_inside=True), "x</think>y"
    )
    assert (out.reasoning, out.content) == ("x", "y")


def test_end_tag_text_after_reasoning_is_plain_content():
    out = check_every_split(lambda: OutputParser("deepseek_r1"), "a</think>b</think><think>c")
    assert (out.reasoning, out.content) == ("a", "b</think><think>c")


def reasoning_tokens(make, tokens: list[str]) -> int:
    """Feeds each piece as one output token's text, the last as the final one."""
    parser = make()
    for i, piece in enumerate(tokens):
        parser.feed(piece, final=i == len(tokens) - 1)
    count: int = parser.num_reasoning_tokens
    return count


@pytest.mark.parametrize(
    ("parser", "starts_inside", "tokens", "expected"),
    [
        # single-token tags, as Qwen3's and DeepSeek-R1's vocabularies have: the tags never count
        ("deepseek_r1", False, ["<think>", "Let", " me", " add", "</think>", "\n\n", "4"], 3),
        ("deepseek_r1", False, ["Let", " me", "</think>", "4"], 2),  # no <think>: from the start
        ("deepseek_r1", False, ["still", " thinking", ""], 3),  # no end tag: to the end (EOS)
        ("qwen3", False, ["No", " think", " here"], 0),
        ("qwen3", False, ["Hi", "<think>", "a", "b", "</think>", "c"], 2),
        ("qwen3", True, ["a", "b", "</think>", "c"], 2),  # the prompt opened the tag
        # tags written in several tokens: their pieces are not reasoning
        ("qwen3", False, ["<", "think", ">", "x", "y", "</", "think", ">", "z"], 2),
        # a token that only looked like a tag's start is reasoning once it is not one
        ("qwen3", False, ["<think>", "a", " <", "b", "</think>"], 3),
        # a token with no text of its own (half a UTF-8 character) goes with the next character
        ("qwen3", False, ["<think>", "", "\U0001f642", "</think>", "", "ok"], 2),
        ("qwen3", False, ["<think>", "a", "</think>", "", ""], 1),
    ],
)
def test_reasoning_tokens_are_the_tokens_inside_the_tags(
    parser: str, starts_inside: bool, tokens: list[str], expected: int
) -> None:
    make = lambda: OutputParser(parser, reasoning_starts_inside=starts_inside)  # noqa: E731
    assert reasoning_tokens(make, tokens) == expected


def test_reasoning_tokens_ignore_text_of_no_token_and_need_a_reasoning_parser() -> None:
    parser = OutputParser("deepseek_r1")
    parser.feed("a", False)
    parser.feed("b", False)
    parser.feed("", True, token=False)  # a finishing row without a token
    assert parser.num_reasoning_tokens == 2
    plain = OutputParser(tool_call_parser_name="hermes")
    plain.feed("<think>a</think>", True)
    assert plain.num_reasoning_tokens == 0


# -- tool calls -----------------------------------------------------------------------------------

HERMES = (
    'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
    '"unit": "°C"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def test_hermes_calls_are_parsed_and_their_markup_never_streams():
    out = check_every_split(lambda: OutputParser(tool_call_parser_name="hermes"), HERMES)
    assert out.content == "Let me check."
    assert calls(out) == [("get_weather", {"city": "Paris", "unit": "°C"}), ("get_time", {})]
    ids = [call[0] for call in joined(out)]
    assert len(set(ids)) == 2 and all(i.startswith("chatcmpl-tool-") for i in ids)
    # arguments are the text the model wrote, non-ASCII as is
    assert joined(out)[0][2] == '{"city": "Paris", "unit": "°C"}'


def test_hermes_call_cut_by_the_end_of_output_still_parses_if_complete():
    text = '<tool_call>{"name": "f", "arguments": {"x": 1}}'
    out = check_every_split(lambda: OutputParser(tool_call_parser_name="hermes"), text)
    assert (out.content, calls(out)) == ("", [("f", {"x": 1})])


def test_streamed_calls_open_with_their_name_then_follow_as_written():
    """The id and name go out once the name and the `{` of the arguments are written, before
    the arguments are; then each piece of the arguments as it comes, joining to their text."""
    make = {
        "hermes": (lambda: OutputParser(tool_call_parser_name="hermes"), HERMES),
        "llama3_json": (
            lambda: OutputParser(tool_call_parser_name="llama3_json"),
            '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "°C"}}',
        ),
        "mistral": (
            lambda: OutputParser(tool_call_parser_name="mistral"),
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}]',
        ),
        "mistral v11": (
            lambda: OutputParser(tool_call_parser_name="mistral"),
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "°C"}',
        ),
    }
    for label, (parser, text) in make.items():
        check_every_split(parser, text)
        out, seen = parser(), []
        for i, char in enumerate(text):
            seen.append((text[: i + 1], out.feed(char, False).tool_calls))
        seen.append((text, out.feed("", True).tool_calls))
        opened = next(i for i, (_, pieces) in enumerate(seen) if pieces)
        written, (opening,) = seen[opened]
        assert opening.name == "get_weather" and opening.id and opening.index == 0, label
        assert written.endswith("{") and opening.arguments == "{", label
        rest = [p for _, pieces in seen[opened + 1 :] for p in pieces if p.index == 0]
        assert len(rest) > 10 and not any(p.id or p.name for p in rest), label  # piece by piece
        arguments = opening.arguments + "".join(p.arguments for p in rest)
        assert arguments == '{"city": "Paris", "unit": "°C"}', label
        assert json.loads(arguments) == {"city": "Paris", "unit": "°C"}


def test_markup_of_another_shape_is_parsed_whole_when_it_closes():
    # arguments first, or as JSON text: not streamable, still a call once the markup closes
    text = '<tool_call>{"arguments": "{\\"x\\": 1}", "name": "f"}</tool_call>'
    out = OutputParser(tool_call_parser_name="hermes")
    assert out.feed(text[:-12], False).tool_calls == []
    (call,) = out.feed(text[-12:], True).tool_calls
    assert (call.index, call.name, json.loads(call.arguments)) == (0, "f", {"x": 1}) and call.id
    check_every_split(lambda: OutputParser(tool_call_parser_name="hermes"), text)


def test_a_call_cut_short_keeps_the_arguments_written():
    """As a stream must: what went out stays out (the client sees finish_reason length, or the
    markup closing early); the text after a call that is not a call is content."""
    make = lambda: OutputParser(tool_call_parser_name="hermes")  # noqa: E731
    out = check_every_split(make, '<tool_call>{"name": "f", "arguments": {"x": 1</tool_call>ok')
    assert [c[1:] for c in joined(out)] == [["f", '{"x": 1']] and out.content == "ok"
    out = check_every_split(
        make, '<tool_call>{"name": "f", "arguments": {"x": 1}} and so</tool_call>'
    )
    assert calls(out) == [("f", {"x": 1})] and out.content == "and so"


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        "<tool_call>{not json",
    ],
)
def test_malformed_hermes_calls_come_back_as_content(text):
    out = check_every_split(lambda: OutputParser(tool_call_parser_name="hermes"), text)
    assert out.tool_calls == [] and out.content == text


def test_plain_text_with_a_lone_angle_bracket_passes_through():
    text = "x < y and <tool is not a call"
    out = check_every_split(lambda: OutputParser(tool_call_parser_name="hermes"), text)
    assert (out.content, out.tool_calls) == (text, [])


def test_llama3_json_calls():
    make = lambda: OutputParser(tool_call_parser_name="llama3_json")  # noqa: E731
    text = '{"name": "search", "parameters": {"q": "llamas"}}; {"name": "f", "parameters": {}}'
    out = check_every_split(make, text)
    assert (out.content, calls(out)) == ("", [("search", {"q": "llamas"}), ("f", {})])
    out = check_every_split(make, '<|python_tag|>{"name": "f", "arguments": {"a": [1, 2]}}')
    assert calls(out) == [("f", {"a": [1, 2]})]
    out = check_every_split(make, "Sure, here it is: {not a call}")
    assert (out.content, out.tool_calls) == ("Sure, here it is: {not a call}", [])
    out = check_every_split(make, "{this is not json}")
    assert (out.content, out.tool_calls) == ("{this is not json}", [])


def test_mistral_calls_both_formats():
    make = lambda: OutputParser(tool_call_parser_name="mistral")  # noqa: E731
    text = 'ok [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]'
    out = check_every_split(make, text)
    assert (out.content, calls(out)) == ("ok ", [("f", {"a": 1}), ("g", {})])
    out = check_every_split(make, '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}')
    assert calls(out) == [("get_weather", {"city": "Oslo"})]


def test_reasoning_then_tool_call_in_the_content():
    text = '<think>need the weather</think><tool_call>{"name": "w", "arguments": {}}</tool_call>'
    out = check_every_split(lambda: OutputParser("qwen3", "hermes"), text)
    assert (out.reasoning, out.content, calls(out)) == ("need the weather", "", [("w", {})])
    # A call written inside the reasoning is reasoning, not a call.
    text = '<think><tool_call>{"name": "w", "arguments": {}}</tool_call></think>done'
    out = check_every_split(lambda: OutputParser("qwen3", "hermes"), text)
    assert out.tool_calls == [] and out.content == "done"


def test_parser_names_are_checked():
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}
    assert set(TOOL_CALL_PARSERS) == {"hermes", "llama3_json", "mistral"}
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        OutputParser(tool_call_parser_name="nope")


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_json_nested_past_the_recursion_limit_stays_text(parser):
    """A model can write a thousand "[" as readily as anything: that is not a tool call, and it
    must not raise out of the detokenize stage (or the server, for a forced tool_choice)."""
    deep = "[" * 5000 + "]" * 5000
    text = {
        "hermes": f"<tool_call>{deep}</tool_call>",
        "llama3_json": '{"name": "f", "parameters": ' + deep + "}",
        "mistral": f"[TOOL_CALLS]{deep}",
    }[parser]
    out = OutputParser(tool_call_parser_name=parser).feed(text, True)
    assert out.tool_calls == [] and out.content
    assert forced_tool_calls(deep, "required") is None
    assert forced_tool_calls('[{"name": "f", "parameters": "' + deep + '"}]', "required") is None
