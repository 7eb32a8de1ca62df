"""Scheduler policy: budgets, chunked prefill beside decodes, one step ahead, preemption, aborts."""

from __future__ import annotations

import numpy as np

from stages import messages as m
from stages.scheduler import BlockManager, Scheduler, SchedulerConfig, Sequence, Status

EOS = 0


def seq(handle: int, prompt_len: int, max_tokens: int = 100, priority: int = 0) -> Sequence:
    return Sequence(
        handle=handle,
        priority=priority,
        arrival_ns=handle,
        prompt_ids=np.arange(1, prompt_len + 1, dtype=np.int32),
        max_tokens=max_tokens,
        stop_ids=frozenset({EOS}),
        sampling=np.zeros(1, m.SAMPLING_ROW),
        stop_list=np.array([EOS], np.int32),
        bias_ids=np.zeros(0, np.int32),
        bias_values=np.zeros(0, np.float32),
        allowed_ids=np.zeros(0, np.int32),
        detok=b"",
    )


def make(num_blocks=64, budget=32, max_seqs=8, block_size=4, max_len=512) -> Scheduler:
    return Scheduler(SchedulerConfig(max_seqs, budget, max_len, num_blocks, block_size))


def run_step(s: Scheduler, token: int = 7):
    step = s.schedule()
    assert step is not None
    handles = np.array([x.seq.handle for x in step.seqs])
    tokens = np.array([token if x.sample else -1 for x in step.seqs])
    return step, s.complete(step.step_id, handles, tokens)[0]


def test_block_manager_grows_and_frees():
    blocks = BlockManager(4, 16)
    table: list[int] = []
    assert blocks.grow(table, 17) and len(table) == 2
    assert not blocks.grow(table, 16 * 5) and len(table) == 2  # no partial growth
    blocks.free(table)
    assert table == [] and blocks.num_free == 4 and blocks.usage == 0


def test_long_prompt_is_chunked_and_decodes_keep_running():
    s = make(budget=16)
    s.add(seq(1, 3))
    run_step(s)  # request 1 prefilled and sampled its first token
    s.add(seq(2, 40))
    step, _ = run_step(s)
    by = {x.seq.handle: x for x in step.seqs}
    assert by[1].num_tokens == 1 and by[1].sample  # the decode goes first
    assert by[2].num_tokens == 15 and not by[2].sample  # the prompt gets the rest of the budget
    step, _ = run_step(s)
    assert {x.seq.handle: x.num_tokens for x in step.seqs} == {1: 1, 2: 15}
    step, _ = run_step(s)
    assert {x.seq.handle: x.num_tokens for x in step.seqs} == {1: 1, 2: 10}
    assert [x.sample for x in step.seqs] == [True, True]


def test_planning_one_step_ahead_marks_unknown_inputs():
    s = make()
    s.add(seq(1, 5))
    first = s.schedule()
    second = s.schedule()  # planned before the first step's result
    assert first is not None and second is not None
    decode = second.seqs[0]
    assert decode.start == 5 and decode.num_tokens == 1
    assert decode.seq.token_at(5) == -1  # execute fills in what it sampled
    s.complete(first.step_id, np.array([1]), np.array([9]))
    assert decode.seq.token_at(5) == 9


def test_stop_token_and_max_tokens_finish():
    s = make()
    s.add(seq(1, 2, max_tokens=3))
    s.add(seq(2, 2, max_tokens=50))
    _, out = run_step(s, token=5)
    _, out = run_step(s, token=EOS)  # both sample EOS; request 1 stops, request 2 too
    assert all(q.finish == m.FINISH_STOP for q, _ in out)
    assert not s.has_work and s.blocks.num_free == 64
    s.add(seq(3, 2, max_tokens=3))
    for _ in range(3):
        _, out = run_step(s, token=5)
    assert out[0][0].finish == m.FINISH_LENGTH and len(out[0][0].output_ids) == 3
    assert s.schedule() is None


def test_never_schedules_past_max_tokens_with_a_step_in_flight():
    s = make()
    s.add(seq(1, 2, max_tokens=1))
    first = s.schedule()
    assert first is not None and s.schedule() is None  # its only token is already in flight


def test_preemption_by_recompute_when_blocks_run_out():
    s = make(num_blocks=6, budget=64, block_size=4, max_len=24)  # the cache holds one full request
    first, second = seq(1, 8, max_tokens=16), seq(2, 8, max_tokens=16)  # 2 blocks each
    s.add(first)
    s.add(second)
    run_step(s)
    for _ in range(8):  # each grows by one token a step: a third block each, then a fourth
        run_step(s)
    preempted = [q for q in s.by_handle.values() if q.num_preemptions]
    assert preempted and s.num_preemptions >= 1
    victim = preempted[0]
    assert victim.handle == 2  # the later request yields
    # The victim comes back and recomputes its prompt and outputs, then continues.
    while s.has_work:
        run_step(s)
    # Both finish with every token they asked for, the victim after recomputing its context.
    assert len(first.output_ids) == 16 and len(second.output_ids) == 16
    assert victim.status == Status.FINISHED and s.blocks.num_free == 6


def test_abort_frees_blocks_and_waiting_requests():
    s = make(max_seqs=1)
    s.add(seq(1, 10))
    s.add(seq(2, 10))
    run_step(s)
    assert s.abort(1) is not None and s.abort(2) is not None
    assert s.blocks.num_free == 64 and not s.has_work
    assert s.abort(1) is None


def test_priority_orders_admission():
    s = make(max_seqs=1)
    s.add(seq(1, 4, priority=5))
    s.add(seq(2, 4, priority=0))
    step = s.schedule()
    assert step is not None and [x.seq.handle for x in step.seqs] == [2]


def test_prefill_beside_decodes_is_capped_but_alone_takes_the_budget():
    s = Scheduler(SchedulerConfig(8, 64, 512, 64, 4, max_prefill_tokens_while_decoding=10))
    s.add(seq(1, 40))
    step, _ = run_step(s)
    assert [x.num_tokens for x in step.seqs] == [40]  # nothing decoding: the whole prompt at once
    s.add(seq(2, 40))
    s.add(seq(3, 40))
    step, _ = run_step(s)
    assert {x.seq.handle: x.num_tokens for x in step.seqs} == {
        1: 1,
        2: 10,
    }  # capped beside a decode
    step, _ = run_step(s)
    assert {x.seq.handle: x.num_tokens for x in step.seqs} == {1: 1, 2: 10}


def test_complete_says_which_step_row_each_token_came_from() -> None:
    s = make(budget=8, max_seqs=4)
    s.add(seq(1, prompt_len=3))
    s.add(seq(2, prompt_len=3))
    run_step(s)  # both prompts: they now decode
    s.add(seq(3, prompt_len=20))  # a long prompt, chunked beside the decodes
    step = s.schedule()
    assert step is not None
    assert [(x.seq.handle, x.sample) for x in step.seqs] == [(1, True), (2, True), (3, False)]
    s.abort(1)  # gone while its step runs: its row yields nothing
    emitted, rows = s.complete(step.step_id, np.array([1, 2, 3]), np.array([5, 6, -1]))
    assert [(x.handle, token) for x, token in emitted] == [(2, 6)]
    assert rows == [1]
