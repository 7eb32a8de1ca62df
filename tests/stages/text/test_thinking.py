"""vLLM's thinking_token_budget: where the thinking begins, how it is counted, and the end tag
forced once the budget is spent."""

from __future__ import annotations

import pytest

from stages.actors.render import grammar_after, thinking_budget
from stages.api import (
    EngineError,
    GenerateRequest,
    SamplingParams,
    StructuredOutput,
    TextPrompt,
)
from stages.config import EngineConfig
from stages.text.thinking import ThinkingBudget, ThinkingTracker

START, END = (1, 2), (3, 4)  # two-token tags, as "<think>" is in a vocabulary without it


def run(tracker: ThinkingTracker, model: list[int]) -> list[int]:
    """The tokens written when the model would write `model`, forced tokens taking their turn."""
    written: list[int] = []
    wants = iter(model)
    while len(written) < len(model):
        forced = tracker.forced()
        token = forced if forced >= 0 else next(wants)
        tracker.consume(token)
        written.append(token)
    return written


def test_the_prompt_says_where_the_thinking_begins():
    opened = ThinkingBudget.of(5, START, END, [9, 1, 2, 7, 7], implied=False)
    assert opened.inside and opened.count == 2  # the two tokens after the open tag count
    closed = ThinkingBudget.of(5, START, END, [1, 2, 7, 3, 4, 9], implied=False)
    assert not closed.inside and closed.count == 0
    assert ThinkingBudget.of(5, START, END, [9, 9], implied=True).inside  # DeepSeek-R1's rule
    assert not ThinkingBudget.of(5, START, END, [9, 9], implied=False).inside


def test_the_end_tag_is_forced_once_the_budget_is_spent():
    tracker = ThinkingTracker(ThinkingBudget(3, START, END, inside=True))
    # three thinking tokens, then the end tag, then the model's own tokens again
    assert run(tracker, [7, 8, 9, 10, 11, 12, 13]) == [7, 8, 9, 3, 4, 10, 11]
    assert not tracker.inside


def test_thinking_opened_in_the_output_is_counted_from_its_tag():
    tracker = ThinkingTracker(ThinkingBudget(2, START, END, inside=False))
    assert run(tracker, [5, 6, 1, 2, 7, 8, 9, 9]) == [5, 6, 1, 2, 7, 8, 3, 4]


def test_a_model_that_ends_its_thinking_in_time_is_left_alone():
    tracker = ThinkingTracker(ThinkingBudget(4, START, END, inside=True))
    assert run(tracker, [7, 3, 4, 9, 9, 9, 9, 9]) == [7, 3, 4, 9, 9, 9, 9, 9]


def test_a_budget_of_zero_ends_the_thinking_at_once():
    tracker = ThinkingTracker(ThinkingBudget(0, START, END, inside=True, count=0))
    assert run(tracker, [7, 7, 7]) == [3, 4, 7]


def test_forced_along_drafts_is_what_taking_them_one_by_one_would_force():
    """Speculative decoding verifies several drafts in one step: each verified position is forced
    as it would be had the drafts before it been taken, and the tracker itself does not move."""
    tracker = ThinkingTracker(ThinkingBudget(3, START, END, inside=True))
    tracker.consume(7)
    drafts = [8, 9, 3, 4, 11]  # the model's two thinking tokens, the close tag, one more
    ahead = tracker.forced_along(drafts)
    walked = ThinkingTracker(ThinkingBudget(3, START, END, inside=True))
    walked.consume(7)
    want = []
    for token in [*drafts, None]:
        want.append(walked.forced())
        if token is not None:
            walked.consume(token)
    # after two more thinking tokens the budget is spent: the close tag, one token at a time
    assert ahead == want == [-1, -1, 3, 4, -1, -1]
    assert tracker.count == 1 and tracker.inside and tracker.forced_along([]) == [-1]


def test_tokens_taken_several_a_step_follow_the_close_tag_forced_among_them():
    """Under speculation a step emits several tokens and forced() is asked only before the first:
    a close tag token taken among them is the forced one, and the tag's rest follows (not the
    tag again from its start)."""
    tracker = ThinkingTracker(ThinkingBudget(2, START, END, inside=True))
    assert tracker.forced() == -1
    for token in (7, 8, 3):  # two thinking tokens, then the close tag's first, forced there
        tracker.consume(token)
    assert tracker.forced() == 4
    tracker.consume(4)
    assert not tracker.inside and tracker.forced() == -1


def test_a_forced_end_of_its_own_is_forced_and_the_close_tag_still_ends_the_thinking():
    """--reasoning-config's reasoning_end_str: a transition phrase and the close tag are forced
    when the budget is spent; a model that closes the tag itself in time is left alone."""
    forced = (9, 9, *END)  # "Time to answer." then the close tag
    spent = ThinkingTracker(ThinkingBudget(2, START, END, inside=True, forced_ids=forced))
    assert run(spent, [7, 8, 5, 5, 5, 5, 6]) == [7, 8, 9, 9, 3, 4, 5]
    assert not spent.inside
    in_time = ThinkingTracker(ThinkingBudget(5, START, END, inside=True, forced_ids=forced))
    assert run(in_time, [7, 3, 4, 5, 5, 5, 5]) == [7, 3, 4, 5, 5, 5, 5]


def test_a_forced_end_equal_to_the_close_tag_is_not_stored_twice():
    assert ThinkingBudget.of(5, START, END, [9], implied=False, forced_ids=END).forced_ids == ()


class _Words:
    """A tokenizer of one token per known word (what render's budget needs of one)."""

    VOCAB = {"<think>": (1, 2), "</think>": (3, 4), "[begin]": (6,), "Answer now.": (9, 9)}

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return list(self.VOCAB.get(text, (8,)))


def _budgeted(parser: str | None) -> GenerateRequest:
    sampling = SamplingParams(thinking_token_budget=3)
    return GenerateRequest("r", TextPrompt("x"), sampling, reasoning_parser=parser)


def test_render_takes_the_tags_of_the_reasoning_config_before_the_parsers():
    words = _Words()
    plain = EngineConfig(model_path="m")
    # the parser's tags alone
    qwen = thinking_budget(_budgeted("qwen3"), [5], words, plain)
    assert qwen is not None and (qwen.start_ids, qwen.end_ids, qwen.forced_ids) == (START, END, ())
    # a forced end of its own: the parser's close tag still ends the thinking
    ending = EngineConfig(model_path="m", reasoning_end_str="Answer now.")
    forced = thinking_budget(_budgeted("qwen3"), [5], words, ending)
    assert forced is not None and (forced.end_ids, forced.forced_ids) == (END, (9, 9))
    # both texts given: a budget needs no parser, the forced text also ends the thinking
    both = EngineConfig(model_path="m", reasoning_start_str="[begin]", reasoning_end_str="</think>")
    alone = thinking_budget(_budgeted(None), [6, 5], words, both)
    assert alone is not None and (alone.start_ids, alone.end_ids) == ((6,), END)
    assert alone.inside and alone.count == 1  # the prompt opened it
    with pytest.raises(EngineError) as refused:
        thinking_budget(_budgeted(None), [5], words, plain)
    assert refused.value.param == "thinking_token_budget" and "--reasoning-config" in str(
        refused.value
    )


def test_a_constrained_request_reasons_first_unless_told_otherwise():
    """vLLM's enable_in_reasoning false (its default): with a reasoning parser the grammar waits
    for the close tag, unless the prompt's last think tag already closed the reasoning."""
    words = _Words()
    plain = EngineConfig(model_path="m")
    structured = SamplingParams(structured=StructuredOutput("regex", "[0-9]+"))

    def request(parser: str | None) -> GenerateRequest:
        return GenerateRequest("r", TextPrompt("x"), structured, reasoning_parser=parser)

    assert grammar_after(request("qwen3"), [5], words, plain) == END
    assert grammar_after(request("qwen3"), [*START, 5, *END], words, plain) == ()  # closed
    assert grammar_after(request("deepseek_r1"), [5, *START], words, plain) == END
    assert grammar_after(request(None), [5], words, plain) == ()  # no reasoning to wait for
    in_reasoning = EngineConfig(model_path="m", structured_outputs_in_reasoning=True)
    assert grammar_after(request("qwen3"), [5], words, in_reasoning) == ()
    assert grammar_after(_budgeted("qwen3"), [5], words, plain) == ()  # no grammar
