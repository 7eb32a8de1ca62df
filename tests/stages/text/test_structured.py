"""Structured outputs: grammars compiled from each kind of spec, the masks execute writes, and
the sampler held to them."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch

from gpu.sampler import SamplingArrays, TokenHistory, sample
from stages.api import EngineError, StructuredOutput
from stages.text.structured import (
    GRAMMAR_STACK_BYTES,
    MAX_CHOICES,
    MAX_GRAMMAR_CHARS,
    GrammarMatchers,
    compile_grammar,
)
from stages.text.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def bundle(tiny_chat_model):
    return load_tokenizer(tiny_chat_model)


@pytest.fixture()
def matchers(bundle):
    return GrammarMatchers(bundle.tokenizer.to_str(), bundle.vocab_size, bundle.eos_token_ids)


def allowed(mask_row: np.ndarray, vocab_size: int) -> set[int]:
    bits = np.unpackbits(mask_row.view(np.uint8), bitorder="little")[:vocab_size]
    return set(np.flatnonzero(bits).tolist())


def follow(matchers, bundle, handle: int, pick) -> str:
    """Walks the grammar to its end, taking `pick(allowed ids)` each step; the text written."""
    ids = []
    for _ in range(64):
        mask = matchers.masks([handle], [True])
        choices = allowed(mask[0], bundle.vocab_size)
        assert choices, "a live grammar always allows some token"
        token = pick(sorted(choices))
        if token in bundle.eos_token_ids:
            return bundle.decode(ids)
        matchers.consume(handle, token)
        ids.append(token)
    raise AssertionError("the grammar never let the request end")


@pytest.mark.parametrize(
    ("spec", "check"),
    [
        (
            StructuredOutput(
                "json",
                json.dumps(
                    {
                        "type": "object",
                        "properties": {"color": {"enum": ["red", "blue"]}},
                        "required": ["color"],
                        "additionalProperties": False,
                    }
                ),
            ),
            lambda text: json.loads(text)["color"] in ("red", "blue"),
        ),
        (StructuredOutput("regex", "[0-9]{3}"), lambda text: text.isdigit() and len(text) == 3),
        (
            StructuredOutput("choice", json.dumps(["yes", "no", "héllo"])),
            lambda text: text in ("yes", "no", "héllo"),
        ),
        (
            StructuredOutput("grammar", 'root ::= "a" ("b" | "c")'),  # GBNF, converted
            lambda text: text in ("ab", "ac"),
        ),
        (
            StructuredOutput("grammar", 'start: "x" ("y" | "w") "z"'),  # Lark
            lambda text: text in ("xyz", "xwz"),
        ),
    ],
)
def test_any_path_through_the_masks_writes_a_valid_output(spec, check, matchers, bundle):
    grammar = compile_grammar(spec)
    for handle, pick in enumerate((min, max, lambda ids: ids[len(ids) // 2])):
        matchers.add(handle, matchers.build(grammar))
        text = follow(matchers, bundle, handle, pick)
        assert check(text), text
        matchers.drop(handle)
    assert len(matchers) == 0


def test_json_object_allows_only_an_object(matchers, bundle):
    matchers.add(1, matchers.build(compile_grammar(StructuredOutput("json_object"))))
    first = allowed(matchers.masks([1], [True])[0], bundle.vocab_size)
    assert first and all(bundle.decode([t]).startswith("{") for t in first)


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutput("json", "{not json", param="guided_json"),
        StructuredOutput("json", json.dumps({"type": "nonsense"})),
        StructuredOutput("regex", "[0-9", param="structured_outputs.regex"),
        StructuredOutput("choice", json.dumps([])),
        StructuredOutput("grammar", "start: undefined_rule"),
        StructuredOutput("grammar", "neither Lark nor GBNF", param="guided_grammar"),
        StructuredOutput("xml", "<a/>"),
    ],
)
def test_what_cannot_be_compiled_is_a_400_naming_its_field(spec):
    with pytest.raises(EngineError) as info:
        compile_grammar(spec)
    assert info.value.status == 400 and info.value.param == spec.param


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        (
            StructuredOutput("choice", json.dumps([f"{i:06d}" for i in range(100_000)]), "c"),
            f"at most {MAX_GRAMMAR_CHARS} are allowed",
        ),
        (
            StructuredOutput("choice", json.dumps([str(i) for i in range(MAX_CHOICES + 1)]), "c"),
            f"{MAX_CHOICES + 1} choices; at most {MAX_CHOICES}",
        ),
        (StructuredOutput("regex", "a" * (MAX_GRAMMAR_CHARS + 1), "r"), "characters"),
    ],
)
def test_grammars_over_the_limits_are_400s(spec, says):
    with pytest.raises(EngineError) as info:
        compile_grammar(spec)
    assert info.value.status == 400 and info.value.param == spec.param
    assert says in info.value.message


def deep_specs() -> list[StructuredOutput]:
    """Grammars just within MAX_GRAMMAR_CHARS that nest as deeply as that allows: a chain of
    $refs, a chain of Lark rules."""
    count = MAX_GRAMMAR_CHARS // 80
    defs = {
        f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}}
        for i in range(count)
    }
    defs[f"d{count}"] = {"type": "string"}
    schema = json.dumps({"$ref": "#/$defs/d0", "$defs": defs})
    rules = MAX_GRAMMAR_CHARS // 24
    lark = "\n".join(
        ["start: a0", *(f'a{i}: "x" a{i + 1} | "y"' for i in range(rules)), f'a{rules}: "z"']
    )
    specs = [StructuredOutput("json", schema), StructuredOutput("grammar", lark)]
    assert all(len(spec.value) <= MAX_GRAMMAR_CHARS for spec in specs)
    return specs


def test_the_deepest_grammars_within_the_limits_compile_on_a_grammar_thread(matchers):
    """llguidance recurses a native frame or more per level: on a default 8 MiB stack a chain of
    1,000 $refs kills the process. Render and execute compile on threads of GRAMMAR_STACK_BYTES."""
    built = []

    def compile_and_build() -> None:
        for spec in deep_specs():
            built.append(matchers.build(compile_grammar(spec))[0])

    previous = threading.stack_size(GRAMMAR_STACK_BYTES)
    try:
        worker = threading.Thread(target=compile_and_build)
        worker.start()
    finally:
        threading.stack_size(previous)
    worker.join()
    assert len(built) == 2 and not any(m.is_error() for m in built)


def test_a_matcher_built_for_a_resumed_request_continues_its_output(matchers, bundle):
    grammar = compile_grammar(StructuredOutput("regex", "quick brown"))
    written = bundle.encode("quick", add_bos=False)
    matchers.add(1, matchers.build(grammar, written))
    assert follow(matchers, bundle, 1, min) == " brown"


def test_rows_without_a_grammar_or_not_sampling_allow_everything(matchers, bundle):
    assert matchers.masks([1, 2], [True, True]).shape == (2, 0)  # nobody constrained: no masks
    matchers.add(2, matchers.build(compile_grammar(StructuredOutput("regex", "a"))))
    masks = matchers.masks([1, 2, 2], [True, True, False])
    assert masks.shape == (3, (bundle.vocab_size + 31) // 32)
    assert (masks[0] == -1).all() and (masks[2] == -1).all()
    assert len(allowed(masks[1], bundle.vocab_size)) < bundle.vocab_size


def test_the_sampler_only_samples_allowed_tokens():
    vocab = 70
    words = np.zeros((2, 3), np.int32)
    words.view(np.uint32)[0, 2] = 1 << (65 - 64)  # row 0: only token 65
    words[1] = -1  # row 1: unconstrained
    logits = torch.zeros(2, vocab)
    logits[:, 3] = 10.0  # the favourite everywhere
    params = SamplingArrays.defaults(2, token_bitmask=words)
    history = [TokenHistory.of([1], [])] * 2
    out = sample(logits, params, history)
    assert out.token_ids.tolist() == [65, 3]
    random = SamplingArrays.defaults(
        2, token_bitmask=words, temperature=np.ones(2, np.float32), seed=np.array([1, 2])
    )
    for _ in range(5):
        assert sample(logits, random, history).token_ids[0].item() == 65


def test_draft_masks_follow_the_drafts_and_leave_the_matcher_where_it_was(matchers, bundle):
    grammar = compile_grammar(StructuredOutput("regex", "(ab|cd)+x"))
    matchers.add(1, matchers.build(grammar))
    ab, cd = bundle.encode("ab", add_bos=False), bundle.encode("cd", add_bos=False)
    before = matchers.masks([1], [True])[0].copy()
    drafts = ab + cd + [bundle.encode(" ", add_bos=False)[0]] + ab  # a space: refused
    masks = matchers.draft_masks(1, drafts)
    assert masks.shape == (len(drafts) + 1, before.shape[0])
    assert (masks[0] == before).all()
    # after each accepted draft, the mask is the one a matcher that took it would give
    probe, _ = matchers.build(grammar)
    for j, token in enumerate(ab + cd, start=1):
        probe.consume_token(token)
        want = np.full_like(before, -1)
        probe.unsafe_compute_mask_ptr(want.ctypes.data, want.nbytes)
        assert (masks[j] == want).all()
    refused = len(ab + cd) + 1
    assert (masks[refused:] == masks[refused - 1]).all()  # past the refused draft: repeated
    # the mask after them all alone (a draft model's next draft), without the ones before
    for j in range(len(drafts) + 1):
        last = matchers.draft_masks(1, drafts[:j], last_only=True)
        assert last.shape == (1, before.shape[0]) and (last[0] == masks[j]).all()
    # the matcher itself took nothing
    assert (matchers.masks([1], [True])[0] == before).all()


STRUCTURAL_TAG = json.dumps(
    {
        "structures": [
            {
                "begin": "<function=add>",
                "schema": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}},
                    "required": ["a"],
                    "additionalProperties": False,
                },
                "end": "</function>",
            }
        ],
        "triggers": ["<function="],
    }
)


def test_a_structural_tag_leaves_text_free_and_holds_the_tag_to_its_schema(matchers, bundle):
    """vLLM's structural tag, as its guidance backend compiles it: any text, and after a
    trigger the structure's begin, JSON of its schema, and its end."""
    grammar = compile_grammar(StructuredOutput("structural_tag", STRUCTURAL_TAG))
    matchers.add(1, matchers.build(grammar))
    free = allowed(matchers.masks([1], [True])[0], bundle.vocab_size)
    assert len(free) > bundle.vocab_size // 2  # text: (almost) any token
    for token in bundle.encode("Sum: <function=", add_bos=False):
        matchers.consume(1, token)
    text = follow(matchers, bundle, 1, lambda ids: ids[0])
    assert text.startswith("add>")
    body = text.removeprefix("add>")
    arguments, end, _ = body.partition("</function>")
    assert end and isinstance(json.loads(arguments)["a"], int), text


@pytest.mark.parametrize(
    "tag",
    [
        {"structures": [], "triggers": ["<f"]},
        {"structures": [{"begin": "<g>", "schema": {}, "end": "</g>"}], "triggers": ["<f"]},
        {"structures": [{"begin": "<f>", "end": "</f>"}], "triggers": ["<f"]},
        {
            "structures": [{"begin": "<f>", "schema": {"type": 5}, "end": "</f>"}],
            "triggers": ["<f"],
        },
    ],
)
def test_a_malformed_structural_tag_is_a_400(tag):
    spec = StructuredOutput("structural_tag", json.dumps(tag), param="response_format")
    with pytest.raises(EngineError) as info:
        compile_grammar(spec)
    assert info.value.status == 400 and info.value.param == "response_format"


def test_a_request_that_reasons_first_is_free_until_its_reasoning_ends(matchers, bundle):
    """vLLM's structured outputs with a reasoning parser (enable_in_reasoning false): the
    grammar holds once the close tag is written, and the matcher takes nothing before it."""
    grammar = compile_grammar(StructuredOutput("regex", "[0-9]{3}"))
    end = bundle.encode("</think>", add_bos=False)
    matchers.add(1, matchers.build(grammar, after=end))
    thinking = bundle.encode("<think>Let me see", add_bos=False)
    for token in thinking + end[:-1]:
        assert matchers.masks([1], [True]).shape == (1, 0)  # free: no row is constrained
        matchers.consume(1, token)
    matchers.consume(1, end[-1])  # the reasoning ends: the grammar holds from here
    assert follow(matchers, bundle, 1, min).isdigit()
    # resumed after a stage failure with part of the output written: the same split
    resumed = bundle.encode("<think>ok", add_bos=False) + end + bundle.encode("12", add_bos=False)
    matchers.add(2, matchers.build(grammar, resumed, after=end))
    assert len(follow(matchers, bundle, 2, min)) == 1


def test_draft_masks_of_a_reasoning_request_hold_after_the_draft_that_ends_it(matchers, bundle):
    grammar = compile_grammar(StructuredOutput("regex", "[0-9]{3}"))
    end = bundle.encode("</think>", add_bos=False)
    matchers.add(1, matchers.build(grammar, after=end))
    thought = bundle.encode("hm", add_bos=False) + end
    drafts = thought + bundle.encode("12", add_bos=False)
    masks = matchers.draft_masks(1, drafts)
    opened = len(thought)  # the position after the close tag's last token
    assert (masks[:opened] == -1).all()  # before it: free
    digits = allowed(masks[opened], bundle.vocab_size)
    assert digits and all(bundle.decode([t]).isdigit() for t in digits)
    assert (masks[-1] != -1).any()
    last = matchers.draft_masks(1, drafts, last_only=True)
    assert (last[0] == masks[-1]).all()
    free = matchers.draft_masks(1, bundle.encode("hm", add_bos=False), last_only=True)
    assert (free == -1).all()  # the reasoning not ended: still free
    assert matchers.masks([1], [True]).shape == (1, 0)  # and the gate itself did not move
