"""Each ring's codec: what is packed is what comes out, through the byte layout the ring uses."""

from __future__ import annotations

import numpy as np

from pipeline.records import Record, encode
from stages.api import (
    ChatPrompt,
    EngineError,
    GenerateRequest,
    RequestMetrics,
    SamplingParams,
    StructuredOutput,
    TokenLogprob,
    ToolCallDelta,
)
from stages.rings import common, deltas, plan, prompts, requests, results, tokens
from stages.rings.common import PROMPT_LOGPROB_ROW, PromptLogprobs
from stages.rings.prompts import RenderedPrompt, RenderedRequest
from stages.rings.tokens import DetokParams
from stages.scheduler import ScheduledSeq, Sequence, Step


def through(record: Record, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The views a consumer would read after the producer wrote these arrays."""
    body = encode(record, arrays)
    return record.read_views(body, 0, len(body))


def prompt_logprobs(handles: list[int], top_k: int) -> PromptLogprobs:
    rows = np.zeros(len(handles), PROMPT_LOGPROB_ROW)
    rows["handle"] = handles
    rows["position"] = np.arange(1, len(handles) + 1)
    rows["token_id"] = np.arange(len(handles)) + 7
    rows["logprob"] = -0.5
    rows["rank"] = 2
    top_ids = np.arange(len(handles) * top_k, dtype=np.int64).reshape(len(handles), top_k)
    return PromptLogprobs(rows, top_ids, -np.ones((len(handles), top_k), np.float32))


def test_requests_carry_the_request_as_it_is():
    request = GenerateRequest(
        "chatcmpl-1",
        ChatPrompt([{"role": "user", "content": "héllo"}], tools=[{"type": "function"}]),
        SamplingParams(
            temperature=0.3,
            seed=-5,
            stop=("x",),
            logit_bias={3: -1.5},
            structured=StructuredOutput("regex", "[a-z]+", "guided_regex"),
            bad_words=("no",),
        ),
        priority=-2,
        arrival_ns=123,
        tool_call_parser="hermes",
    )
    assert requests.unpack_submit(through(requests.SUBMIT, requests.pack_submit(9, request))) == (
        9,
        request,
        None,
    )
    resume = common.Resume(output_ids=(5, 0, 7), first_token_ns=11, num_recoveries=2)
    packed = requests.pack_submit(9, request, resume)
    assert requests.unpack_submit(through(requests.SUBMIT, packed)) == (9, request, resume)
    assert common.unpack_abort(through(common.ABORT, common.pack_abort([4, 5]))) == [4, 5]


def test_errors_keep_status_and_every_openai_field():
    error = EngineError("too long", 400, "BadRequestError", "messages", "context_length_exceeded")
    handle, back = requests.unpack_error(through(requests.ERROR, requests.pack_error(3, error)))
    assert handle == 3
    assert (back.message, back.status, back.type, back.param, back.code) == (
        "too long",
        400,
        "BadRequestError",
        "messages",
        "context_length_exceeded",
    )


def test_prompts_round_trip_and_the_rendered_request_decodes():
    rendered = RenderedRequest(
        SamplingParams(prompt_logprobs=2), 17, (0, 5), ((1, 2), (3,)), grammar="start: /a/"
    )
    prompt = RenderedPrompt(
        handle=8,
        priority=3,
        arrival_ns=10,
        render_start_ns=11,
        rendered_ns=12,
        prompt_ids=np.array([4, 5, 6], np.int32),
        rendered=common.encoder.encode(rendered),
        detok=common.encoder.encode(DetokParams(stop=("END",))),
    )
    back = prompts.unpack_prompt(through(prompts.PROMPT, prompts.pack_prompt(prompt)))
    assert back.prompt_ids.tolist() == [4, 5, 6]
    assert (back.handle, back.priority, back.arrival_ns, back.rendered_ns) == (8, 3, 10, 12)
    assert back.request() == rendered and not back.request().cacheable
    assert back.detok == prompt.detok


def _sequence(handle: int, prompt: list[int], outputs: list[int], blocks: list[int]) -> Sequence:
    seq = Sequence(
        handle=handle,
        priority=0,
        arrival_ns=0,
        prompt_ids=np.array(prompt, np.int32),
        max_tokens=8,
        stop_ids=frozenset(),
        rendered=common.encoder.encode(RenderedRequest(SamplingParams(top_k=handle), 8, ())),
        detok=b"",
    )
    seq.output_ids = outputs
    seq.blocks = blocks
    return seq


def test_a_step_unpacks_into_what_the_runner_needs():
    block_size = 4
    chunked = _sequence(1, list(range(10, 16)), [], [7, 2])  # prompt tokens 2..5 this step
    decoding = _sequence(2, [1, 2, 3], [40], [5])  # its output token at position 3
    ahead = _sequence(3, [9, 9], [], [6])  # sampled last step, not back yet: -1
    ahead.pending_outputs = 1
    step = Step(
        step_id=41,
        seqs=[
            ScheduledSeq(chunked, 2, 4, True),
            ScheduledSeq(decoding, 3, 1, True),
            ScheduledSeq(ahead, 2, 1, True),
        ],
        new_for_execute=[chunked, ahead],
        free_handles=[99],
        block_copies=[(3, 8), (3, 9)],
    )
    back = plan.unpack_step(through(plan.STEP, plan.pack_step(step, block_size, 555)))
    assert (back.step_id, back.scheduled_ns) == (41, 555)
    assert back.seqs["handle"].tolist() == [1, 2, 3]
    assert back.query_start_loc.tolist() == [0, 4, 5, 6]
    assert back.seqs["context_len"].tolist() == [6, 4, 3]
    assert back.input_ids.tolist() == [12, 13, 14, 15, 40, -1]
    assert back.positions.tolist() == [2, 3, 4, 5, 3, 2]
    # block 7 holds positions 0-3 of request 1, block 2 positions 4-7
    assert back.slot_mapping.tolist() == [30, 31, 8, 9, 23, 26]
    assert back.block_tables.tolist() == [[7, 2], [5, 0], [6, 0]]
    assert [(h, r.sampling.top_k) for h, r in back.new_requests] == [(1, 1), (3, 3)]
    assert back.free_handles.tolist() == [99]
    assert back.block_copies.tolist() == [[3, 8], [3, 9]]


def test_a_step_sends_new_requests_known_tokens_where_execute_proposes():
    """With a model-free speculative method, each request's known tokens go with its first
    step: execute's proposer looks up n-grams in prompt blocks it never computes (cached)."""
    resumed = _sequence(1, [10, 11, 12, 13], [40, 41], [7, 2])
    fresh = _sequence(2, [1, 2, 3], [], [5])
    step = Step(
        step_id=3,
        seqs=[ScheduledSeq(resumed, 4, 2, True), ScheduledSeq(fresh, 0, 3, True)],
        new_for_execute=[resumed, fresh],
        free_handles=[],
        send_tokens=True,
    )
    back = plan.unpack_step(through(plan.STEP, plan.pack_step(step, 4, 0)))
    assert {h: t.tolist() for h, t in back.new_tokens.items()} == {
        1: [10, 11, 12, 13, 40, 41],
        2: [1, 2, 3],
    }
    step.send_tokens = False
    assert plan.unpack_step(through(plan.STEP, plan.pack_step(step, 4, 0))).new_tokens == {}


def test_results_round_trip():
    result = results.StepResult(
        step_id=5,
        t_start_ns=100,
        t_end_ns=200,
        handles=np.array([3, 4], np.int64),
        num_tokens=np.array([3, 1], np.int32),  # row 3 verified drafts: two accepted, then one
        num_drafted=np.array([4, 0], np.int32),
        token_ids=np.array([11, 12, 13, -1], np.int64),
        logprobs=np.array([-0.25, -0.5, -1.0, np.nan], np.float32),
        ranks=np.array([1, 1, 2, 0], np.int64),
        top_ids=np.array([[11, 12], [12, 11], [14, 13], [-1, -1]], np.int64),
        top_logprobs=np.array(
            [[-0.25, -2.0], [-0.5, -1.5], [-0.9, -1.0], [-np.inf, -np.inf]], np.float32
        ),
        prompt=prompt_logprobs([4, 4, 4], top_k=3),
    )
    back = results.unpack_result(through(results.RESULT, results.pack_result(result)))
    assert (back.step_id, back.t_start_ns, back.t_end_ns) == (5, 100, 200)
    names = (
        "handles",
        "num_tokens",
        "num_drafted",
        "token_ids",
        "logprobs",
        "ranks",
        "top_ids",
        "top_logprobs",
    )
    for name in names:
        np.testing.assert_array_equal(getattr(back, name), getattr(result, name))
    np.testing.assert_array_equal(back.prompt.rows, result.prompt.rows)
    np.testing.assert_array_equal(back.prompt.top_ids, result.prompt.top_ids)


def test_tokens_round_trip_with_new_requests_and_metrics():
    rows = np.zeros(2, tokens.TOKEN_ROW)
    rows["handle"], rows["token_id"], rows["finish"] = [1, 2], [5, 6], [0, common.FINISH_LENGTH]
    metrics = np.zeros(2, tokens.METRICS_ROW)
    metrics["arrival_ns"], metrics["num_generated_tokens"] = [10, 20], [1, 7]
    detok = DetokParams(stop=("a", "b"), num_logprobs=2)
    arrays = tokens.pack_tokens(
        8,
        rows,
        np.array([[1, 2], [3, 4]], np.int64),
        np.zeros((2, 2), np.float32),
        [(2, common.encoder.encode(detok))],
        metrics,
        PromptLogprobs.empty(),
    )
    back = tokens.unpack_tokens(through(tokens.TOKENS, arrays))
    assert back.step_id == 8 and back.new == [(2, detok)]
    np.testing.assert_array_equal(back.rows, rows)
    assert back.top_ids.tolist() == [[1, 2], [3, 4]]
    finished = tokens.request_metrics(back.metrics[1], finished_ns=99, detokenize_ns=3)
    assert finished == RequestMetrics(20, 0, 0, 0, 0, 0, 7, finished_ns=99, detokenize_ns=3)
    assert tokens.unpack_finished(through(tokens.FINISHED, tokens.pack_finished([7]))) == [7]


def test_deltas_round_trip_plain_rows_carry_no_extra():
    logprob = TokenLogprob(5, "é", "é".encode(), -0.1, 1, ((5, "é", "é".encode(), -0.1),))
    extra = deltas.DeltaExtra(
        logprobs=(logprob,),
        stop_reason="END",
        tool_calls=(ToolCallDelta(0, "call_1", "f", "{"), ToolCallDelta(0, arguments="}")),
    )
    arrays = deltas.pack_deltas(
        17, [(1, 0, 3, 1, 5), (2, common.FINISH_STOP, 4, 2, -1)], ["é", ""], [None, extra]
    )
    assert arrays["extra_offsets"].tolist()[:2] == [0, 0]
    back = deltas.unpack_deltas(through(deltas.DELTAS, arrays))
    assert back.step_id == 17
    assert (back.handles, back.finishes, back.token_ids) == (
        [1, 2],
        [0, common.FINISH_STOP],
        [5, -1],
    )
    assert (back.num_prompt_tokens, back.num_output_tokens) == ([3, 4], [1, 2])
    assert (back.text(0), back.extra(0)) == ("é", deltas.PLAIN)
    assert (back.text(1), back.extra(1)) == ("", extra)
