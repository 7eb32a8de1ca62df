"""Structured outputs: the grammar a request's output must follow, and the token masks that hold
the sampler to it. Torch-free.

The server turns OpenAI's `response_format`, vLLM's `structured_outputs` (and its older
`guided_*` fields) and a forced `tool_choice` into a `StructuredOutput` (stages.api). Render
compiles it to an llguidance grammar, so a schema or regex that cannot be compiled is the client's
400 before anything is scheduled. Execute keeps one matcher per constrained request: before a step
it writes the mask of the tokens each constrained row may sample next, and after it feeds the
matcher the token that was sampled. llguidance is what llama.cpp, vLLM and TensorRT-LLM use for
this; its masks take tens of microseconds per row.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark

from stages.api import EngineError, StructuredOutput

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the type stubs only

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# Compile time grows faster than the grammar (100,000 choices took render 33 s and execute 16 s;
# 10,000 take about 0.15 s each on a 49k vocabulary, a 256 KiB schema about as long): larger specs
# are the client's 400. Real ones are far smaller.
MAX_GRAMMAR_CHARS = 256 * 1024  # the schema, regex or grammar text, or the choices as JSON
MAX_CHOICES = 10_000
# llguidance compiles grammars recursively, a native stack frame or more per level of nesting:
# a chain of 1,000 $refs overflows a default 8 MiB stack and kills the process. Threads that
# compile grammars or build matchers get this much (virtual; touched only as deep as used), enough
# for any grammar within MAX_GRAMMAR_CHARS (chains of tens of thousands of rules).
GRAMMAR_STACK_BYTES = 256 * 1024 * 1024
# JSON on one line with the separators json.dumps writes: free whitespace lets a small model
# pad its output with newlines until max_tokens (the reason vLLM grew --disable-any-whitespace).
_JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


def compile_grammar(spec: StructuredOutput) -> str:
    """The llguidance grammar for a request's structured output; EngineError (400) when the schema,
    regex, choices or grammar is too large or cannot be compiled. Call it on a thread whose stack
    is GRAMMAR_STACK_BYTES."""
    param = spec.param
    if len(spec.value) > MAX_GRAMMAR_CHARS:
        raise EngineError(
            f"the {spec.kind} for structured output has {len(spec.value)} characters; "
            f"at most {MAX_GRAMMAR_CHARS} are allowed",
            param=param,
        )
    try:
        grammar = _grammar(spec)
    except Exception as error:  # a bad spec, in whatever way the compilers say so: the client's 400
        raise EngineError(
            f"invalid {spec.kind} for structured output: {error}", param=param
        ) from error
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise EngineError(f"invalid {spec.kind} for structured output: {problem}", param=param)
    return grammar


def _grammar(spec: StructuredOutput) -> str:
    kind, value = spec.kind, spec.value
    if kind == "json":
        schema = json.loads(value)
        if schema is True:
            schema = {}  # the schema every JSON value satisfies
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema must be an object")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, _JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, _JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        choices = json.loads(value)
        if (
            not isinstance(choices, list)
            or not choices
            or not all(isinstance(c, str) for c in choices)
        ):
            raise ValueError("choices must be a non-empty list of strings")
        if len(choices) > MAX_CHOICES:
            raise ValueError(f"{len(choices)} choices; at most {MAX_CHOICES} are allowed")
        # A Lark rule of string literals: JSON's string escapes are Lark's.
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
        )
    if kind == "grammar":
        # Lark, as llguidance takes it; GBNF (llama.cpp's grammars) is converted.
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(value))
    if kind == "structural_tag":
        return _structural_tag(json.loads(value))
    raise ValueError(f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")


def _structural_tag(spec: object) -> str:
    """vLLM's structural tag (`structures` of {begin, schema, end} and their `triggers`), as
    vLLM's guidance backend compiles it: free text, in which each trigger opens its structure, a
    JSON schema between its begin and end strings."""
    if not isinstance(spec, dict):
        raise ValueError("a structural tag must be an object")
    triggers, structures = spec.get("triggers"), spec.get("structures")
    if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("triggers must be a list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structures must be a non-empty list")
    tags = []
    for structure in structures:
        if not isinstance(structure, dict):
            raise ValueError("each structure must be {begin, schema, end}")
        begin, end, schema = structure.get("begin"), structure.get("end"), structure.get("schema")
        if not isinstance(begin, str) or not isinstance(end, str):
            raise ValueError("each structure needs begin and end strings")
        if not isinstance(schema, dict):
            raise ValueError("each structure needs a JSON schema object")
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            raise ValueError(f"the begin {begin!r} starts with none of the triggers {triggers}")
        tags.append(llguidance.StructTag(trigger=trigger, begin=begin, grammar=schema, end=end))
    return llguidance.StructTag.to_grammar(tags)


class ReasoningGate:
    """A constrained request that reasons first (vLLM's enable_in_reasoning false): its grammar
    holds only once the output has ended the reasoning with `end_ids` (the parser's close tag);
    until then the request samples freely and its matcher takes no token."""

    __slots__ = ("_end", "_tail")

    def __init__(self, end_ids: Sequence[int]) -> None:
        self._end = list(end_ids)
        self._tail: deque[int] = deque(maxlen=len(self._end))

    def passes(self, token: int) -> bool:
        """Feed an output token; True once it ended the reasoning (the grammar holds from the
        token after it)."""
        self._tail.append(token)
        return len(self._tail) == len(self._end) and list(self._tail) == self._end

    def copy(self) -> ReasoningGate:
        probe = ReasoningGate(self._end)
        probe._tail.extend(self._tail)
        return probe


class GrammarMatchers:
    """Execute's matchers, one per constrained request, and the masks they write for a step.

    `tokenizer_json` is the model's `tokenizers` JSON; `vocab_size` the width of the logits (which
    may exceed the tokenizer's); `eos_ids` the tokens that end a request, the only ones a finished
    grammar allows.
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self._tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_ids)
        )
        self.vocab_size = vocab_size
        self.width = (vocab_size + 31) // 32  # int32 words per mask row
        self._eos_ids = list(eos_ids)
        self._matchers: dict[int, llguidance.LLMatcher] = {}
        self._gates: dict[int, ReasoningGate] = {}  # requests still reasoning, grammar waiting

    def __len__(self) -> int:
        return len(self._matchers)

    def __contains__(self, handle: int) -> bool:
        return handle in self._matchers

    def build(
        self, grammar: str, consumed: Sequence[int] = (), after: Sequence[int] = ()
    ) -> tuple[llguidance.LLMatcher, ReasoningGate | None]:
        """A matcher of the grammar that has taken the tokens `consumed` (a request resumed after
        a stage failure), and with `after` (the tokens that end the reasoning) the gate that
        holds it back until they were written. Up to seconds for a large grammar, with the GIL
        released: execute calls it in a worker thread (with a stack of GRAMMAR_STACK_BYTES),
        then `add`s what it built."""
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        gate = ReasoningGate(after) if after else None
        for token in consumed:
            if gate is not None:
                gate = None if gate.passes(token) else gate
            elif not matcher.is_error():
                matcher.consume_token(token)
        return matcher, gate

    def add(self, handle: int, built: tuple[llguidance.LLMatcher, ReasoningGate | None]) -> None:
        self._matchers[handle], gate = built
        if gate is not None:
            self._gates[handle] = gate

    def drop(self, handle: int) -> None:
        self._matchers.pop(handle, None)
        self._gates.pop(handle, None)

    def consume(self, handle: int, token: int) -> None:
        """The token sampled for the request (a constrained one; others are ignored)."""
        gate = self._gates.get(handle)
        if gate is not None:
            if gate.passes(token):
                del self._gates[handle]
            return
        matcher = self._matchers.get(handle)
        if matcher is not None and not matcher.is_error():
            matcher.consume_token(token)

    def draft_masks(
        self, handle: int, drafts: Sequence[int], last_only: bool = False
    ) -> np.ndarray:
        """[1 + D, width] int32: the request's mask at its next position and after each of the
        drafts in turn, as if it had taken them; the matcher is rolled back after. Past a draft
        the grammar refuses, the rows repeat the last mask: the draft cannot be sampled there, so
        verification stops before they matter. `last_only`: [1, width], the mask after them all
        (a draft model sampling its next draft), the others not computed."""
        matcher = self._matchers[handle]
        out = np.full((1 if last_only else 1 + len(drafts), self.width), -1, np.int32)
        if matcher.is_error():
            return self.masks([handle] * len(out), [True] * len(out))
        gate = self._gates.get(handle)
        start = 0  # the positions before the reasoning's end sample freely (rows of all ones)
        if gate is not None:
            probe = gate.copy()
            # the grammar holds after the draft that ends the reasoning, if one does
            start = next((j for j, t in enumerate(drafts, 1) if probe.passes(int(t))), 0)
            if not start:
                return out
            drafts = drafts[start:]
        if not last_only:
            matcher.unsafe_compute_mask_ptr(out[start].ctypes.data, out[start].nbytes)
        return self._masks_after(matcher, drafts, out, start, last_only)

    def _masks_after(
        self,
        matcher: llguidance.LLMatcher,
        drafts: Sequence[int],
        out: np.ndarray,
        start: int,
        last_only: bool,
    ) -> np.ndarray:
        """draft_masks from row `start` on, its mask written: the drafts taken in turn."""
        consumed = 0
        for j, token in enumerate(drafts, start=start + 1):
            if matcher.is_stopped() or matcher.try_consume_tokens([int(token)]) != 1:
                if not last_only:
                    out[j:] = out[j - 1]
                break
            consumed += 1
            if not last_only:
                matcher.unsafe_compute_mask_ptr(out[j].ctypes.data, out[j].nbytes)
        if last_only:
            matcher.unsafe_compute_mask_ptr(out[0].ctypes.data, out[0].nbytes)
        if consumed:
            matcher.rollback(consumed)
        return out

    def masks(self, handles: Sequence[int], sampling: Sequence[bool]) -> np.ndarray:
        """[rows, width] int32 bit masks (bit t of row r: token t allowed); every bit set for
        rows without a grammar or not sampling; shape [rows, 0] when no row is constrained."""
        rows = [
            (row, self._matchers[handle])
            for row, (handle, samples) in enumerate(zip(handles, sampling, strict=True))
            if samples and handle in self._matchers and handle not in self._gates
        ]
        if not rows:
            return np.zeros((len(handles), 0), np.int32)
        out = np.full((len(handles), self.width), -1, np.int32)
        for row, matcher in rows:
            if matcher.is_error():
                # A matcher that failed (it should not: every token it allowed was sampled)
                # ends the request rather than letting it run unconstrained.
                words = out.view(np.uint32)[row]
                words[:] = 0
                for eos in self._eos_ids:
                    words[eos // 32] |= np.uint32(1 << (eos % 32))
                continue
            view = out[row]
            matcher.unsafe_compute_mask_ptr(view.ctypes.data, view.nbytes)
        return out
