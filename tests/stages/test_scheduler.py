"""Scheduler policy: budgets, chunked prefill beside decodes, one step ahead, preemption, aborts."""

from __future__ import annotations

import dataclasses

import numpy as np

from stages.kv_blocks import BlockManager
from stages.rings import common as m
from stages.rings.gauges import GAUGES, StepTokens, pack_gauges, unpack_gauges
from stages.scheduler import Scheduler, SchedulerConfig, Sequence, Status

EOS = 0


def seq(
    handle: int,
    prompt_len: int,
    max_tokens: int = 100,
    priority: int = 0,
    prompt: np.ndarray | None = None,
) -> Sequence:
    """A request whose prompt is its own (no prefix shared with others) unless `prompt` is given."""
    if prompt is None:
        prompt = np.arange(1, prompt_len + 1, dtype=np.int32) + handle * 1000
    return Sequence(
        handle=handle,
        priority=priority,
        arrival_ns=handle,
        prompt_ids=np.asarray(prompt, np.int32),
        max_tokens=max_tokens,
        stop_ids=frozenset({EOS}),
        rendered=b"",
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


def test_the_lowest_priority_yields_first_whenever_it_was_admitted():
    s = make(num_blocks=6, budget=64, block_size=4, max_len=24)
    low, high = seq(1, 8, max_tokens=16, priority=5), seq(2, 8, max_tokens=16, priority=0)
    s.add(low)
    run_step(s)  # low is admitted first
    s.add(high)
    while not (low.num_preemptions or high.num_preemptions):
        run_step(s)
    assert low.num_preemptions and not high.num_preemptions  # admitted first, preempted first
    while s.has_work:
        run_step(s)
    assert len(low.output_ids) == 16 and len(high.output_ids) == 16


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


# -- prefix caching ---------------------------------------------------------------------------


SHARED = np.arange(500, 540, dtype=np.int32)  # 40 tokens: 10 blocks of 4


def test_a_prompt_seen_before_takes_its_cached_blocks():
    s = make(budget=64)
    s.add(seq(1, 40, prompt=SHARED))
    first, _ = run_step(s)
    assert first.seqs[0].num_tokens == 40
    s.add(seq(2, 44, prompt=np.concatenate([SHARED, [7, 8, 9, 10]])))
    second, _ = run_step(s)
    chunk = {x.seq.handle: (x.start, x.num_tokens) for x in second.seqs}
    assert chunk[2] == (40, 4)  # the 40 shared tokens come from the cache
    one, two = s.by_handle[1], s.by_handle[2]
    assert two.blocks[:10] == one.blocks[:10] and two.num_cached_tokens == 40
    # what each put into the cache: all 10 blocks for the first, the 11th for the second
    assert (s.cache_created(one), s.cache_created(two)) == (40, 4)
    assert s.stats()["prefix_cache_hits_total"] == 40
    assert s.stats()["prefix_cache_queries_total"] == 84


def test_the_last_prompt_token_is_always_computed():
    s = make(budget=64)
    s.add(seq(1, 40, prompt=SHARED))
    run_step(s)
    s.add(seq(2, 40, prompt=SHARED))  # the same prompt: every block cached
    step, emitted = run_step(s)
    chunk = {x.seq.handle: (x.start, x.num_tokens, x.sample) for x in step.seqs}
    assert chunk[2] == (36, 4, True)  # the last block is computed again, and samples
    assert s.by_handle[2].blocks[:9] == s.by_handle[1].blocks[:9]
    assert s.by_handle[2].blocks[9] != s.by_handle[1].blocks[9]
    assert [x.handle for x, _ in emitted] == [1, 2]


def test_shared_blocks_outlive_one_holder_and_free_blocks_keep_their_prefix():
    s = make(num_blocks=24, budget=64)
    s.add(seq(1, 40, prompt=SHARED))
    run_step(s)
    s.add(seq(2, 40, prompt=SHARED))
    run_step(s)
    held = s.blocks.num_free
    own = set(s.by_handle[1].blocks) - set(s.by_handle[2].blocks)
    s.abort(1)
    assert s.blocks.num_free == held + len(own)  # the 9 shared blocks stay with 2
    s.abort(2)
    assert s.blocks.num_free == 24 and s.blocks.usage == 0  # free, yet still cached
    s.add(seq(3, 40, prompt=SHARED))
    step, _ = run_step(s)
    assert step.seqs[0].start == 36
    # Blocks are handed out never-used first, then least recently freed, a prefix's tail first:
    # a 64-token chunk takes the 12 never-used blocks and the prefix's last 4.
    s.abort(3)
    s.add(seq(4, 64))
    run_step(s)
    s.abort(4)
    s.add(seq(5, 40, prompt=SHARED))
    step, _ = run_step(s)
    assert step.seqs[0].start == 32 and s.by_handle[5].num_cached_tokens == 32
    s.abort(5)
    s.add(seq(6, 96))  # every block: nothing of the prefix is left
    run_step(s)
    run_step(s)
    s.abort(6)
    s.add(seq(7, 40, prompt=SHARED))
    step, _ = run_step(s)
    assert step.seqs[0].start == 0 and s.by_handle[7].num_cached_tokens == 0


def test_a_prefix_cache_reset_drops_free_blocks_and_keeps_held_ones():
    s = make(num_blocks=24, budget=64)
    s.add(seq(1, 40, prompt=SHARED))
    run_step(s)
    s.abort(1)  # its 10 blocks are free and cached
    s.add(seq(2, 44, prompt=np.concatenate([[7, 8, 9, 10], SHARED])))  # registers 11 of its own
    run_step(s)
    assert s.blocks.num_cached == 21
    assert s.blocks.reset_prefix_cache() == 10  # request 2's stay: it holds them
    assert s.blocks.num_cached == 11 and s.blocks.num_free == 24 - 11
    s.add(seq(3, 40, prompt=SHARED))
    step, _ = run_step(s)
    assert {x.seq.handle: x.start for x in step.seqs}[3] == 0
    assert s.by_handle[3].num_cached_tokens == 0
    s.add(seq(4, 44, prompt=np.concatenate([[7, 8, 9, 10], SHARED])))
    run_step(s)
    assert s.by_handle[4].num_cached_tokens == 40  # a held prefix is still shared
    assert s.blocks.reset_prefix_cache() == 0  # every cached block is held now


def test_requests_that_need_every_prompt_position_skip_the_cache():
    s = make(budget=64)
    s.add(seq(1, 40, prompt=SHARED))
    run_step(s)
    other = seq(2, 40, prompt=SHARED)
    other.cacheable = False  # prompt logprobs, or a repetition penalty
    s.add(other)
    step, _ = run_step(s)
    assert {x.seq.handle: x.start for x in step.seqs}[2] == 0
    off = Scheduler(SchedulerConfig(8, 64, 512, 64, 4, enable_prefix_caching=False))
    off.add(seq(1, 40, prompt=SHARED))
    run_step(off)
    off.add(seq(2, 40, prompt=SHARED))
    step, _ = run_step(off)
    assert {x.seq.handle: x.start for x in step.seqs}[2] == 0


def test_a_preempted_request_comes_back_through_the_cache():
    s = make(num_blocks=16, budget=64, max_seqs=4)
    s.add(seq(1, 40))  # 10 blocks
    s.add(seq(2, 20))  # 5 blocks: 15 of 16 in use
    run_step(s)
    run_step(s)  # 1 takes the 16th block for its 41st token
    run_step(s)  # 2 needs a 6th for its 21st: it is the latest admitted, so it is preempted
    two = s.by_handle[2]
    assert two.num_preemptions == 1 and two.status == Status.WAITING
    s.abort(1)
    step, _ = run_step(s)
    assert [(x.seq.handle, x.start) for x in step.seqs] == [(2, 20)]  # its prompt from the cache
    assert two.num_cached_tokens == 20


def test_requests_share_cached_blocks_only_under_the_same_salt():
    """vLLM's cache_salt: the salt is in the first block's hash, so the whole chain differs."""
    s = make(budget=64)

    def salted(handle: int, salt: str | None) -> Sequence:
        request = seq(handle, 40, prompt=SHARED)
        request.cache_salt = salt
        return request

    s.add(salted(1, "tenant-a"))
    run_step(s)
    for handle, salt, cached in [(2, "tenant-b", 0), (3, None, 0), (4, "tenant-a", 36)]:
        s.add(salted(handle, salt))
        run_step(s)
        assert s.by_handle[handle].num_cached_tokens == cached, salt
    assert s.stats()["prefix_cache_hits_total"] == 36


def test_salted_block_hashes_differ_from_every_unsalted_one():
    from stages.kv_blocks import prompt_block_hashes

    ids = np.arange(16, dtype=np.int32)
    plain = prompt_block_hashes(ids, 4)
    salted = prompt_block_hashes(ids, 4, "s")
    assert prompt_block_hashes(ids, 4, "s") == salted
    assert not set(plain) & set(salted)
    assert not set(salted) & set(prompt_block_hashes(ids, 4, "t"))


def test_requests_share_cached_blocks_only_under_the_same_adapter():
    """A LoRA adapter's KV is its own: the adapter is in the hash chain, as a salt is."""
    s = Scheduler(SchedulerConfig(8, 64, 512, 64, 4, max_loras=4))

    def adapted(handle: int, lora_id: int, salt: str | None = None) -> Sequence:
        request = seq(handle, 40, prompt=SHARED)
        request.lora_id, request.cache_salt = lora_id, salt
        return request

    s.add(adapted(1, 5))
    run_step(s)
    for handle, lora_id, salt, cached in [
        (2, 6, None, 0),
        (3, 0, None, 0),
        (4, 5, "x", 0),
        (5, 5, None, 36),
    ]:
        s.add(adapted(handle, lora_id, salt))
        run_step(s)
        assert s.by_handle[handle].num_cached_tokens == cached, (lora_id, salt)


def test_running_requests_use_at_most_max_loras_adapters():
    """vLLM's rule: a request whose adapter would make the running requests' adapters more than
    --max-loras waits, and one behind it whose adapter is running (or the base) goes first."""
    s = Scheduler(SchedulerConfig(8, 64, 512, 64, 4, max_loras=2))
    for handle, lora_id in [(1, 11), (2, 12), (3, 13), (4, 11), (5, 0)]:
        request = seq(handle, 5, max_tokens=2)
        request.lora_id = lora_id
        s.add(request)
    step, _ = run_step(s)
    assert [x.seq.handle for x in step.seqs] == [1, 2, 4, 5]
    assert s.by_handle[3].status == Status.WAITING
    # vLLM's 'deferred' waiting reason: held back by the adapter slots, not by capacity
    assert s.stats()["num_requests_waiting_deferred"] == 1
    run_step(s)  # 1, 2, 4 and 5 reach max_tokens: adapter 13 may run now
    step, _ = run_step(s)
    assert [x.seq.handle for x in step.seqs] == [3]
    assert s.stats()["num_requests_waiting_deferred"] == 0


def _timed_step(s: Scheduler, clock: list[int], seconds):
    """A step that took seconds(step) in execute, on a clock of ns kept in clock[0]."""
    step = s.schedule()
    assert step is not None
    handles = np.array([x.seq.handle for x in step.seqs])
    tokens = np.array([7 if x.sample else -1 for x in step.seqs])
    start = clock[0]
    clock[0] += int(seconds(step) * 1e9)
    s.complete(step.step_id, handles, tokens, t_start_ns=start, t_end_ns=clock[0])
    return step


def test_a_long_prompt_beside_decodes_takes_at_most_its_share_of_the_time():
    """Steps carrying a long prompt's chunk take 20x a decode step; the streams keep 2/3 of the
    time, and the prompt goes on in the rest."""
    config = SchedulerConfig(
        8, 64, 4096, 1024, 4, max_prefill_tokens_while_decoding=16, long_prefill_token_threshold=100
    )
    s = Scheduler(config)
    for handle in (1, 2):
        s.add(seq(handle, 3, max_tokens=10_000))
    clock = [1]

    def chunk_of(step) -> int:
        return {x.seq.handle: x.num_tokens for x in step.seqs}.get(3, 0)

    _timed_step(s, clock, lambda step: 0.01)  # both prefilled: two streams decode from now on
    s.add(seq(3, 2000, max_tokens=5))
    long_s = decodes_s = 0.0
    for _ in range(600):
        step = _timed_step(s, clock, lambda step: 0.2 if chunk_of(step) else 0.01)
        assert {x.seq.handle for x in step.seqs} >= {1, 2}  # the streams are in every step
        assert chunk_of(step) <= 16
        if chunk_of(step):
            long_s += 0.2
        else:
            decodes_s += 0.01
    share = long_s / (long_s + decodes_s)
    assert 0.25 < share < 0.4, share  # about a third, give or take a step
    assert s.by_handle[3].num_computed >= 16 * 12  # the prompt moved meanwhile: ~3 s of 9


def test_long_prompts_prefill_one_at_a_time_and_shorter_ones_go_past():
    config = SchedulerConfig(8, 64, 4096, 1024, 4, long_prefill_token_threshold=100)
    s = Scheduler(config)
    s.add(seq(1, 300))
    s.add(seq(2, 300))
    s.add(seq(3, 20))
    step, _ = run_step(s)
    # alone: the first long prompt's chunk (at most the threshold), the short one past the second
    assert {x.seq.handle: x.num_tokens for x in step.seqs} == {1: 64}
    step, _ = run_step(s)
    assert 2 not in {x.seq.handle for x in step.seqs}


def test_the_threshold_caps_a_long_prompts_chunk_and_zero_turns_the_rule_off():
    s = Scheduler(SchedulerConfig(8, 64, 4096, 1024, 4, long_prefill_token_threshold=40))
    s.add(seq(1, 300))
    step, _ = run_step(s)
    assert [x.num_tokens for x in step.seqs] == [40]  # vLLM's long_prefill_token_threshold
    s = Scheduler(SchedulerConfig(8, 64, 4096, 1024, 4, long_prefill_token_threshold=0))
    s.add(seq(1, 300))
    s.add(seq(2, 300))
    step, _ = run_step(s)
    assert {x.seq.handle: x.num_tokens for x in step.seqs} == {1: 64}
    step, _ = run_step(s)
    assert {x.seq.handle: x.num_tokens for x in step.seqs} == {1: 64}


def test_max_num_partial_prefills_bounds_the_prompts_in_progress():
    s = Scheduler(SchedulerConfig(8, 32, 4096, 1024, 4, max_num_partial_prefills=1))
    s.add(seq(1, 50))
    s.add(seq(2, 10))
    step, _ = run_step(s)
    assert {x.seq.handle: x.num_tokens for x in step.seqs} == {1: 32}  # 2 waits for 1's prefill
    step, _ = run_step(s)
    assert {x.seq.handle: x.num_tokens for x in step.seqs} == {1: 18, 2: 10}


def test_every_statistic_the_scheduler_keeps_is_a_published_gauge():
    # schedule publishes stats() in GAUGES' order: one missing from GAUGES would never reach
    # /metrics, and one missing from stats() would stop schedule's publishing.
    assert tuple(make().stats()) == GAUGES


def test_the_published_gauges_read_back_with_vllms_waiting_reasons():
    s = make()
    stats = {**s.stats(), "num_requests_waiting": 5, "num_requests_waiting_deferred": 2}
    steps = StepTokens()
    for tokens in (1, 1, 40, 9000):
        steps.observe(tokens)
    read = unpack_gauges(pack_gauges(stats, steps, [7, 3]), num_speculative_tokens=2)
    assert read["num_requests_waiting_by_reason{reason=capacity}"] == 3
    assert read["num_requests_waiting_by_reason{reason=deferred}"] == 2
    assert "num_requests_waiting_deferred" not in read
    assert read["iteration_tokens_total{le=1}"] == 2
    assert read["iteration_tokens_total{le=64}"] == 3
    assert read["iteration_tokens_total{le=+Inf}"] == 4
    assert read["iteration_tokens_total_sum"] == 1 + 1 + 40 + 9000
    assert read["spec_decode_num_accepted_tokens_per_pos_total{position=1}"] == 3


def test_without_async_scheduling_one_step_is_in_flight_at_a_time():
    """vLLM's --no-async-scheduling: schedule plans a step only after the one before returned."""
    config = SchedulerConfig(8, 32, 512, 64, 4)
    assert Scheduler(config).max_in_flight == 2  # planned while the one before runs
    synced = Scheduler(dataclasses.replace(config, async_scheduling=False))
    assert synced.max_in_flight == 1
