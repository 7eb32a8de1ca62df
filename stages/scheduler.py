"""Continuous batching: which tokens of which requests run in the next engine step.

Each step has a token budget (`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`).
Running requests go first, so new prompts never stall running streams: each decode takes one token,
an unfinished prefill takes a chunk of what is left of the budget; then waiting requests are admitted
by (priority, arrival) while blocks and budget last, their prompts chunked to fit. When the KV cache
runs out, the most recently admitted running request is preempted: its blocks are freed and it
waits to be recomputed from its prompt and the tokens it has generated.

Steps are planned one ahead of the results (the scheduler plans step N+1 while execute runs step
N), so a decode's input token may not be known yet: it is sent as -1 and execute uses the token it
sampled for that request last step. A request that stops on a token id is found one step late; the
extra token is dropped.

With speculative decoding a decode may carry draft positions after its input, as many as
stages/draft_policy.py says pay: -1 placeholders that execute fills in once it has the request's
last tokens (a model-free proposal, stages/speculation.py, or the draft model's), dropping those
it has no draft for. The step verifies them and emits 1 + the accepted ones. A plan made while
the step before it verifies drafts of the same request assumes all of them accepted; execute
moves the row back by those rejected (stages/draft_rows.py), and so does the result here, which
gives the KV slots of rejected drafts back at once. Drafting costs no overlap: steps stay two in
flight. How many positions to reserve is judged on the tokens known here (a step stale for a
request with a step in flight).
"""

from __future__ import annotations

import enum
import functools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from stages import draft_policy
from stages.beam_group import BeamGroup, BeamRequest, Decode
from stages.draft_policy import StepCost
from stages.kv_blocks import BlockManager, prompt_block_hashes
from stages.rings import common as m
from stages.speculation import SuffixCache, propose
from stages.speculative_config import SpeculativeConfig

# The window over which long prefills' share of the decoding steps' time is measured
LONG_SHARE_WINDOW_S = 5.0


class Status(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2
    PARKED = 3  # a beam search's choice: waits for the others, then for the search's end


@dataclass(slots=True)
class Sequence:
    """One request as the scheduler tracks it."""

    handle: int
    priority: int
    arrival_ns: int
    prompt_ids: np.ndarray  # [P] int32
    max_tokens: int
    stop_ids: frozenset[int]
    rendered: bytes  # msgpack RenderedRequest, for execute
    detok: bytes  # msgpack DetokParams, for detokenize
    render_start_ns: int = 0
    rendered_ns: int = 0
    scheduled_ns: int = 0  # first scheduled
    first_token_ns: int = 0
    last_token_ns: int = 0
    num_prompt: int = 0  # set from prompt_ids
    output_ids: list[int] = field(default_factory=list)  # confirmed outputs
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens fed to the model (KV written, or being written in flight)
    # tokens steps in flight will sample: 1 a row, 1 + its drafts for one verifying drafts (as if
    # all were accepted; the result moves it back)
    pending_outputs: int = 0
    steps_in_flight: int = 0
    status: Status = Status.WAITING
    finish: int = m.FINISH_NONE
    num_preemptions: int = 0
    num_recoveries: int = 0  # stage failures it was resubmitted after
    sent_to_execute: bool = False
    sent_to_detok: bool = False
    # Prefix caching: off for requests that need every prompt position computed (prompt
    # logprobs) or seen by execute (the repetition penalty reads the prompt's ids), and for all
    # when the scheduler's config turns it off (add() folds that in).
    cacheable: bool = True
    num_cached_tokens: int = 0  # prompt tokens taken from the cache when last admitted
    num_registered: int = 0  # prompt blocks registered in the cache
    block_hashes: list[bytes] | None = None  # the prompt's, computed at first admission
    # Speculative decoding: whether drafts may be proposed for it (not for a beam search's
    # beams), its acceptance so far (stages.draft_policy), and what its steps verified: steps
    # with drafts, drafts, accepted, and steps by drafts accepted.
    can_draft: bool = True
    acceptance: float = draft_policy.PRIOR_ACCEPTANCE
    spec_steps: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_histogram: list[int] = field(default_factory=list)  # [i]: steps that accepted i drafts
    # The last proposal and the (outputs, pending outputs) it was made for (Scheduler._proposal).
    proposal_key: tuple[int, int] = (-1, -1)
    proposal: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    cache_salt: str | None = None  # only requests with the same salt share cached blocks
    lora_id: int = 0  # its LoRA adapter (stages.api.LoraRequest.lora_id); 0: the base model
    # Beam search (stages.beam_group): a choice of such a request brings `beam_request`, and
    # `add` puts it in its group (`beam`); a beam is a sequence of the leader's handle (`beam_of`)
    # with blocks of its own, planned with the others of its group.
    beam_request: BeamRequest | None = None
    beam: BeamGroup | None = None
    beam_of: Sequence | None = None

    def __post_init__(self) -> None:
        self.num_prompt = len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens that exist or will once the steps in flight return."""
        return self.num_prompt + len(self.output_ids) + self.pending_outputs

    def token_at(self, position: int) -> int:
        """The token at a position, or -1 if it is still being sampled."""
        if position < self.num_prompt:
            return int(self.prompt_ids[position])
        index = position - self.num_prompt
        return self.output_ids[index] if index < len(self.output_ids) else -1

    def token_ids(self, start: int, end: int) -> np.ndarray:
        """Tokens at positions [start, end); -1 for any still being sampled."""
        if end <= self.num_prompt:
            return self.prompt_ids[start:end]
        out = np.full(end - start, -1, np.int32)
        known = min(end, self.num_prompt + len(self.output_ids))
        prompt_end = min(known, self.num_prompt)
        if start < prompt_end:
            out[: prompt_end - start] = self.prompt_ids[start:prompt_end]
        first = max(start, self.num_prompt)
        if known > first:
            out[first - start : known - start] = self.output_ids[
                first - self.num_prompt : known - self.num_prompt
            ]
        return out


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # first position fed
    num_tokens: int  # including the drafts
    sample: bool
    # [D] int32 -1: draft positions after the input token, which execute fills and verifies
    draft: np.ndarray | None = None

    @property
    def num_draft(self) -> int:
        return 0 if self.draft is None else len(self.draft)


@dataclass(slots=True)
class Step:
    step_id: int
    seqs: list[ScheduledSeq]
    new_for_execute: list[Sequence]
    free_handles: list[int]
    # (source, destination) KV blocks execute copies before the step: beams' copy on write
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    beside_decodes: bool = False  # it carries decodes: its time counts in the long-prefill share
    carries_long_prefill: bool = False  # a chunk of a long prompt (long_prefill_token_threshold)
    # Execute proposes drafts from the requests' tokens (a model-free method): each new one's
    # known tokens go with it (its prefix-cached prompt blocks are never fed).
    send_tokens: bool = False


# A running request this step may advance, and the tokens it has left to compute.
_Work = tuple[Sequence, int]


@dataclass(slots=True)
class _StepPlan:
    """A step as Scheduler.schedule plans it: what is planned so far and what is left to plan."""

    budget: int  # tokens the step may still carry
    seqs: list[ScheduledSeq] = field(default_factory=list)
    taken: set[int] = field(default_factory=set)  # handles in it: never preempted for another
    copies: list[tuple[int, int]] = field(default_factory=list)  # beams' copy on write
    hold_long: bool = False  # the streams are owed time: no long prompt's chunk this step
    # Prompts partly prefilled after this step (those it finishes are not counted), and of them
    # the long ones
    partial: int = 0
    partial_long: int = 0
    carries_long: bool = False  # a chunk of a long prompt


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    num_blocks: int
    block_size: int
    # Prefill tokens a step may carry beside decodes (the whole budget when none run).
    max_prefill_tokens_while_decoding: int = 64
    # vLLM's levers for long prompts. A prompt with more than long_prefill_token_threshold tokens
    # left to compute is long (0: none is): it takes at most that many a step, at most
    # max_long_partial_prefills of them prefill at once (shorter ones are admitted past them),
    # and while decodes run, steps carrying their chunks take at most long_prefill_share of the
    # time, so the streams keep the rest. max_num_partial_prefills bounds all prompts partly
    # prefilled at once (0: no bound).
    long_prefill_token_threshold: int = 512
    max_long_partial_prefills: int = 1
    max_num_partial_prefills: int = 0
    long_prefill_share: float = 1 / 3
    enable_prefix_caching: bool = True
    speculative: SpeculativeConfig | None = None
    # vLLM's --async-scheduling (the default): a step is planned while the one before it runs;
    # False: each after the results of the one before
    async_scheduling: bool = True
    # --max-loras: adapters the running requests may use at once (execute's weight slots, so
    # every step fits them); 0: no adapters.
    max_loras: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, decode: Decode | None = None) -> None:
        """`decode`: texts of token lists, for beam searches with stop strings."""
        self.config = config
        self.decode = decode
        self.beam_groups: dict[int, BeamGroup] = {}  # by BeamSearchParams.group
        self.blocks = BlockManager(config.num_blocks, config.block_size)
        self.waiting: list[Sequence] = []  # kept sorted by (priority, arrival)
        self.running: list[Sequence] = []  # in admission order
        self.by_handle: dict[int, Sequence] = {}
        self.in_flight: deque[Step] = deque()
        self._next_step = 0
        self._to_free: list[int] = []  # handles execute may forget, sent with the next step
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_cache_hits = 0  # of which found there
        self.cost = StepCost()
        self.num_spec_drafts = 0  # steps of a request that verified drafts, over all requests
        self.num_spec_draft_tokens = 0
        self.num_spec_accepted = 0
        self.accepted_per_pos = [0] * (
            config.speculative.num_speculative_tokens if config.speculative else 0
        )
        # Suffix decoding looks in the outputs of recent requests too.
        spec = config.speculative
        self._execute_proposes = spec is not None and not spec.drafts_with_a_model
        self.suffix_cache = (
            SuffixCache(spec.suffix.max_cached_requests)
            if spec is not None and spec.suffix is not None
            else None
        )
        # Time of recent steps beside decodes, and of those carrying a long prompt's chunk, with
        # exponential forgetting over LONG_SHARE_WINDOW_S: their ratio is the long prefills' share.
        self._decoding_s = 0.0
        self._long_prefill_s = 0.0

    # -- requests in and out ---------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.cacheable = seq.cacheable and self.config.enable_prefix_caching
        self.by_handle[seq.handle] = seq
        if seq.beam_request is None:
            self._enqueue(seq)
            return
        # A beam search's choices park until all have come; then the leader runs the search.
        params = seq.beam_request.params
        group = self.beam_groups.setdefault(params.group, BeamGroup(seq.beam_request))
        seq.beam, seq.status = group, Status.PARKED
        group.members[params.index] = seq
        # Resubmitted after a stage failure: the search runs again from the prompt (it is
        # deterministic), and the choice emits only what its client does not have yet.
        group.resumed[params.index] = len(seq.output_ids)
        seq.output_ids = []
        if len(group.members) == group.width and group.leader is not None:
            self._enqueue(group.leader)

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        key = (seq.priority, seq.arrival_ns)
        index = len(self.waiting)
        while (
            index > 0
            and (self.waiting[index - 1].priority, self.waiting[index - 1].arrival_ns) > key
        ):
            index -= 1
        self.waiting.insert(index, seq)

    def finish(self, seq: Sequence, reason: int) -> None:
        """Finish a request now: free its blocks; execute forgets it with the next step."""
        if seq.status == Status.FINISHED:
            return
        if seq.status == Status.WAITING:
            self.waiting.remove(seq)
        elif seq.status == Status.RUNNING:
            self.running.remove(seq)
        seq.status = Status.FINISHED
        seq.finish = reason
        if seq.beam is not None:
            self._leave_beam_group(seq, reason)
        if self.suffix_cache is not None and reason in (m.FINISH_STOP, m.FINISH_LENGTH):
            self.suffix_cache.add(seq.output_ids)
        # Blocks are safe to reuse at once: execute runs steps in order, so a step in flight that
        # still writes them runs before any step that gives them to another request.
        self.blocks.free(seq.blocks)
        if seq.sent_to_execute:
            self._to_free.append(seq.handle)
        if seq.steps_in_flight == 0:
            self.by_handle.pop(seq.handle, None)

    def forget(self, handle: int) -> None:
        """Execute may forget a request this scheduler never planned (one aborted while execute
        built its grammar matcher): it learns so with the next step."""
        self._to_free.append(handle)

    def abort(self, handle: int) -> Sequence | None:
        seq = self.by_handle.get(handle)
        if seq is None or seq.status == Status.FINISHED:
            return None
        self.finish(seq, m.FINISH_ABORT)
        return seq

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def max_in_flight(self) -> int:
        """Steps to keep in flight: two overlap planning with execution (drafts or not)."""
        return 2 if self.config.async_scheduling else 1

    # -- planning --------------------------------------------------------------------------------

    def schedule(self) -> Step | None:
        """The next step, or None when nothing can run: the running requests first (beam
        searches' rows, decodes, then chunks of unfinished prefills), then waiting requests
        admitted while budget, blocks and sequence slots last. A request that needs a block when
        none is free preempts others (_make_room)."""
        decodes, prefills, searches = self._running_work()
        plan = _StepPlan(self.config.max_num_batched_tokens)
        drafts = self._drafts(decodes, prefills, plan.budget)
        for leader in searches:
            rows = self._plan_beams(leader, plan.budget, plan.taken, plan.copies)
            plan.seqs.extend(rows)
            plan.budget -= len(rows)
        decoding = bool(decodes or searches)
        # Counted after the searches' rows: making room for those may have preempted a prefill.
        plan.hold_long = decoding and self._long_prefill_s > self.config.long_prefill_share * (
            self._decoding_s
        )
        plan.partial = len(prefills)
        plan.partial_long = sum(1 for seq, _ in prefills if self._is_long(seq))
        self._schedule_running(plan, decodes, drafts, prefill=False)
        # Beside decodes, prefills share a bounded allowance, which bounds the running streams'
        # inter-token latency.
        if plan.seqs:
            plan.budget = min(plan.budget, self.config.max_prefill_tokens_while_decoding)
        self._schedule_running(plan, prefills, drafts, prefill=True)
        self._admit_waiting(plan)
        if not plan.seqs:
            return None
        return self._dispatch(plan, decoding)

    def _running_work(self) -> tuple[list[_Work], list[_Work], list[Sequence]]:
        """The running requests this step may advance: decodes and unfinished prefills, each with
        the tokens it has left to compute, and beam searches' leaders whose beams are due a step."""
        decodes: list[_Work] = []
        prefills: list[_Work] = []
        searches: list[Sequence] = []
        for seq in self.running:
            if seq.beam is not None and (seq.beam.beams or seq.pending_outputs):
                if seq.beam.beams and not seq.steps_in_flight:
                    searches.append(seq)
                continue  # a search's next step waits for the candidates of its last
            num_outputs = len(seq.output_ids) + seq.pending_outputs
            if num_outputs >= seq.max_tokens:
                continue  # its last token is in flight
            left = seq.num_prompt + num_outputs - seq.num_computed  # num_tokens - num_computed
            (decodes if left == 1 else prefills).append((seq, left))
        return decodes, prefills, searches

    def _schedule_running(
        self,
        plan: _StepPlan,
        work: list[_Work],
        drafts: dict[int, np.ndarray],  # handle -> [D] int32, the drafts a decode carries
        prefill: bool,  # `work` is unfinished prefills (else decodes)
    ) -> None:
        """Plan running requests in order while the budget lasts: a decode's token (and its
        drafts, cut to the budget), or a prefill's next chunk; one whose chunk crosses into a new
        block when none is free preempts others, or is itself preempted (_make_room)."""
        capacity = self.blocks.block_size
        for seq, left in work:
            if plan.budget == 0:
                break
            if seq.status != Status.RUNNING:
                continue  # preempted while making room for an earlier one
            long = prefill and self._is_long(seq)
            if long and plan.hold_long:
                continue  # the streams' share of time: this step is theirs
            draft = drafts.get(seq.handle)
            if draft is not None and len(draft) >= plan.budget:
                draft = draft[: plan.budget - 1] if plan.budget > 1 else None
            count = min(left, plan.budget) + (0 if draft is None else len(draft))
            if long:
                count = min(count, self.config.long_prefill_token_threshold)
                plan.carries_long = True
            need = seq.num_computed + count
            # Most steps stay inside the last block: only a crossing asks for room.
            if need > len(seq.blocks) * capacity and not self._make_room(
                seq, plan.taken, functools.partial(self.blocks.grow, seq.blocks, need)
            ):
                continue
            plan.seqs.append(self._plan(seq, count, count >= left, draft))
            if prefill and count >= left:
                plan.partial -= 1
            if left > 1 or seq.num_computed == seq.num_prompt:  # a prefill chunk
                self._register_prefix(seq)
            plan.taken.add(seq.handle)
            plan.budget -= count

    def _admit_waiting(self, plan: _StepPlan) -> None:
        """Admit waiting requests by (priority, arrival) while budget, blocks and sequence slots
        last, each with the first chunk of its prompt (after the cached blocks it begins with)."""
        loras = self._running_loras()
        # A beam search runs as many rows as beams: the others count against max_num_seqs too.
        beam_rows = sum(
            g.width - 1
            for g in self.beam_groups.values()
            if g.leader is not None and g.leader.status == Status.RUNNING
        )
        while plan.budget > 0 and self.waiting and len(self.running) < self.config.max_num_seqs:
            # A long prompt waits while the long ones prefilling are as many as allowed, or while
            # the streams are owed time; shorter ones are admitted past it (vLLM's rule).
            long_closed = (
                plan.hold_long or plan.partial_long >= self.config.max_long_partial_prefills
            )
            if (
                self.config.max_num_partial_prefills
                and plan.partial >= self.config.max_num_partial_prefills
            ):
                break
            admit = self._next_admissible(loras, long_closed)
            if admit is None:
                break
            extra = 0 if admit.beam is None else admit.beam.width - 1
            if self.running and len(self.running) + beam_rows + extra >= self.config.max_num_seqs:
                break  # (a search wider than max_num_seqs runs alone)
            cached = self._take_cached_prefix(admit)
            count = min(admit.num_tokens - admit.num_computed, plan.budget)
            if self._is_long(admit):
                count = min(count, self.config.long_prefill_token_threshold)
                plan.carries_long = True
                plan.partial_long += 1
            if admit.num_computed + count < admit.num_tokens:
                plan.partial += 1
            if not self.blocks.grow(admit.blocks, admit.num_computed + count):
                if cached:  # it stays waiting: give the cached blocks back
                    self.blocks.free(admit.blocks)
                    admit.num_computed = admit.num_registered = 0
                break
            self._count_prefix_lookup(admit, cached)
            self.waiting.remove(admit)
            admit.status = Status.RUNNING
            self.running.append(admit)
            if admit.lora_id:
                loras.add(admit.lora_id)
            beam_rows += extra
            plan.seqs.append(
                self._plan(admit, count, admit.num_computed + count == admit.num_tokens)
            )
            self._register_prefix(admit)
            plan.budget -= count

    def _next_admissible(self, loras: set[int], long_closed: bool) -> Sequence | None:
        """The first waiting request that may be admitted now (`loras`: the running requests'
        adapters; `long_closed`: no long prompt may start). A preempted request waits for its
        steps in flight before it is recomputed; one whose adapter would make the running
        requests' more than --max-loras waits for the requests of one of theirs to finish
        (vLLM's rule), and the next may go first."""
        return next(
            (
                s
                for s in self.waiting
                if s.steps_in_flight == 0
                and (not s.lora_id or s.lora_id in loras or len(loras) < self.config.max_loras)
                and not (long_closed and self._is_long(s))
            ),
            None,
        )

    def _dispatch(self, plan: _StepPlan, decoding: bool) -> Step:
        """The planned step, numbered and put in flight, with the requests execute meets in it
        for the first time and the handles it may forget."""
        new = [p.seq for p in plan.seqs if not p.seq.sent_to_execute]
        for seq in new:
            seq.sent_to_execute = True
        step = Step(
            self._next_step,
            plan.seqs,
            new,
            self._to_free,
            plan.copies,
            beside_decodes=decoding,
            carries_long_prefill=plan.carries_long,
            send_tokens=self._execute_proposes,
        )
        self._to_free = []
        self._next_step += 1
        self.in_flight.append(step)
        return step

    def _is_long(self, seq: Sequence) -> bool:
        """More of its prompt left to compute than long_prefill_token_threshold (0: never)."""
        threshold = self.config.long_prefill_token_threshold
        return bool(threshold) and seq.num_prompt - seq.num_computed > threshold

    def _num_waiting_for_an_adapter_slot(self) -> int:
        """Waiting requests that --max-loras holds back: their adapter is not among the running
        requests' and those already use every slot (vLLM's 'deferred' waiting reason)."""
        if not self.config.max_loras or not self.waiting:
            return 0
        loras = self._running_loras()
        if len(loras) < self.config.max_loras:
            return 0
        return sum(1 for s in self.waiting if s.lora_id and s.lora_id not in loras)

    def lora_ids(self) -> tuple[set[int], set[int]]:
        """The adapters of the running requests and those of the waiting ones (vLLM's
        lora_requests_info)."""
        running = {seq.lora_id for seq in self.running if seq.lora_id}
        return running, {seq.lora_id for seq in self.waiting if seq.lora_id}

    def _running_loras(self) -> set[int]:
        """The adapters of the running requests (at most --max-loras)."""
        if not self.config.max_loras:
            return set()
        return {seq.lora_id for seq in self.running if seq.lora_id}

    def _plan_beams(
        self, leader: Sequence, budget: int, taken: set[int], copies: list[tuple[int, int]]
    ) -> list[ScheduledSeq]:
        """One row per running beam of a search, all or none: each beam's next token needs a
        slot of its own, in a block no other beam holds (copied on write)."""
        group = leader.beam
        assert group is not None
        if len(group.beams) > budget:
            return []
        for beam in group.beams:
            room = functools.partial(
                self.blocks.grow_writable, beam.blocks, beam.num_computed + 1, group.copies
            )
            if not self._make_room(leader, taken, room):
                return []  # the copies made so far wait in the group for its next plan
        taken.add(leader.handle)
        copies.extend(group.copies)
        group.copies = []
        leader.steps_in_flight += 1
        return [self._plan(beam, 1, True) for beam in group.beams]

    def _leave_beam_group(self, seq: Sequence, reason: int) -> None:
        """A choice of a beam search finished: the leader's end (normal, or an abort) ends the
        search and gives back the beams' blocks; choices still parked end with it."""
        group, request = seq.beam, seq.beam_request
        assert group is not None and request is not None
        index = request.params.index
        if group.members.get(index) is seq:
            del group.members[index]
        if index != 0:
            return
        group.drop(self.blocks)
        self.beam_groups.pop(request.params.group, None)
        for member in list(group.members.values()):
            self.finish(member, reason)

    def _plan(
        self, seq: Sequence, count: int, sample: bool, draft: np.ndarray | None = None
    ) -> ScheduledSeq:
        """`sample`: the chunk reaches the sequence's last token, so the step samples its next
        (and verifies the drafts fed after it)."""
        start = seq.num_computed
        seq.num_computed += count
        if sample:
            seq.pending_outputs += 1 + (0 if draft is None else len(draft))
        seq.steps_in_flight += 1
        return ScheduledSeq(seq, start, count, sample, draft)

    # -- speculative decoding --------------------------------------------------------------------

    def _proposal(self, seq: Sequence) -> np.ndarray:  # -> [<= k] int32
        """The proposal for the tokens known so far, capped so that every draft could be emitted
        (max_tokens, max_model_len, counting the steps in flight as if they accepted every draft);
        computed once per state of the request. Only its length is planned: execute proposes
        again on the tokens it has."""
        key = (len(seq.output_ids), seq.pending_outputs)
        if seq.proposal_key != key:
            seq.proposal_key, seq.proposal = key, self._propose(seq)
        return seq.proposal

    def _propose(self, seq: Sequence) -> np.ndarray:  # -> [<= k] int32
        spec = self.config.speculative
        if spec is None or not seq.can_draft:
            return np.zeros(0, np.int32)
        num_outputs = len(seq.output_ids) + seq.pending_outputs
        room = min(
            spec.num_speculative_tokens,
            seq.max_tokens - num_outputs - 1,
            self.config.max_model_len - seq.num_tokens - 1,
        )
        if room <= 0:
            return np.zeros(0, np.int32)
        if spec.drafts_with_a_model:  # the draft model drafts wherever it is asked to
            return _placeholders(room)
        # Whether the tokens known here have a match: then execute, a step or two further on,
        # likely has one too, as long as the room (a stale proposal's own length would often
        # cut it short: its match may end before the tokens in flight).
        tokens = np.concatenate([seq.prompt_ids, np.asarray(seq.output_ids, np.int32)])
        matched = len(propose(spec, tokens, room, self.suffix_cache)) > 0
        return _placeholders(room if matched else 0)

    def _drafts(
        self,
        decodes: list[tuple[Sequence, int]],
        prefills: list[tuple[Sequence, int]],
        budget: int,
    ) -> dict[int, np.ndarray]:
        """The draft positions each decode of this step carries, by handle (-1 each): for those
        whose known tokens have a proposal, the room, cut to what the policy says pays."""
        if self.config.speculative is None or not decodes:
            return {}
        known = [seq for seq, _ in decodes]
        allowance = min(budget, self.config.max_prefill_tokens_while_decoding)
        prefill_tokens = min(sum(left for _, left in prefills), allowance)
        base_tokens = len(decodes) + prefill_tokens
        if not self._drafts_could_pay(base_tokens, len(decodes), [s.acceptance for s in known]):
            return {}  # not even full proposals would: do not look for any
        proposals = [(seq, self._proposal(seq)) for seq in known]
        proposals = [(seq, p) for seq, p in proposals if len(p)]
        if not proposals:
            return {}
        if not self.config.speculative.adaptive_draft_length:
            return {seq.handle: _placeholders(len(p)) for seq, p in proposals}
        counts = draft_policy.plan_drafts(
            self.cost,
            base_tokens=base_tokens,
            base_outputs=len(decodes),
            candidates=[(seq.acceptance, len(p)) for seq, p in proposals],
        )
        for (seq, _), n in zip(proposals, counts, strict=True):
            if not n:
                seq.acceptance = draft_policy.undrafted(seq.acceptance)
        return {
            seq.handle: _placeholders(n) for (seq, _), n in zip(proposals, counts, strict=True) if n
        }

    def _drafts_could_pay(
        self, base_tokens: int, base_outputs: int, acceptances: list[float]
    ) -> bool:
        """Whether drafts could pay this step even if every request proposed the most: else
        proposals are not looked for (suffix decoding's search over recent outputs costs)."""
        spec = self.config.speculative
        if spec is None or not acceptances:
            return False
        if not spec.adaptive_draft_length:
            return True
        k = spec.num_speculative_tokens
        best = draft_policy.plan_drafts(
            self.cost, base_tokens, base_outputs, [(a, k) for a in acceptances]
        )
        return any(best)

    # -- prefix caching --------------------------------------------------------------------------

    def _take_cached_prefix(self, seq: Sequence) -> int:
        """Give a request that starts from nothing the cached blocks its prompt begins with; the
        number of tokens they hold (its num_computed now). One token is always left to compute:
        the step that computes it samples the request's next token."""
        if not seq.cacheable or seq.num_computed or seq.blocks:
            return 0
        usable = (seq.num_tokens - 1) // self.blocks.block_size
        blocks = self.blocks.match(self._prompt_hashes(seq)[:usable])
        seq.blocks.extend(blocks)
        seq.num_registered = len(blocks)
        seq.num_computed = len(blocks) * self.blocks.block_size
        return seq.num_computed

    def _prompt_hashes(self, seq: Sequence) -> list[bytes]:
        if seq.block_hashes is None:
            seq.block_hashes = prompt_block_hashes(
                seq.prompt_ids, self.blocks.block_size, seq.cache_salt, seq.lora_id
            )
        return seq.block_hashes

    def _count_prefix_lookup(self, seq: Sequence, cached: int) -> None:
        if seq.cacheable:
            seq.num_cached_tokens = cached
            self.prefix_cache_queries += seq.num_prompt
            self.prefix_cache_hits += cached

    def cache_created(self, seq: Sequence) -> int:
        """The prompt tokens `seq` put into the prefix cache: those of the prompt blocks it
        registered, less those it found there (vLLM's num_cache_creation_tokens)."""
        registered = min(seq.num_registered * self.blocks.block_size, seq.num_prompt)
        return max(registered - seq.num_cached_tokens, 0)

    def _register_prefix(self, seq: Sequence) -> None:
        """Register the prompt blocks this step's chunk completes (its step writes them before
        any later step can read them: execute runs steps in order)."""
        full = min(seq.num_computed, seq.num_prompt) // self.blocks.block_size
        if not seq.cacheable or full <= seq.num_registered:
            return
        hashes = self._prompt_hashes(seq)
        for j in range(seq.num_registered, full):
            self.blocks.register(seq.blocks[j], hashes[j])
        seq.num_registered = full

    def _make_room(self, seq: Sequence, taken: set[int], grow: Callable[[], bool]) -> bool:
        """The blocks `grow` asks for (seq's, or its beams'), preempting requests not already in
        this step: the lowest priority (the largest value) first and, among equals, the latest
        admitted (vLLM's order under its priority and fcfs policies); seq itself is the last
        resort (it then waits to be recomputed)."""
        while not grow():
            candidates = [
                (s.priority, i) for i, s in enumerate(self.running) if s.handle not in taken
            ]
            if not candidates:
                return False
            victim = self.running[max(candidates)[1]]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Free the request's blocks; it waits to be recomputed from prompt and outputs."""
        self.running.remove(seq)
        self.blocks.free(seq.blocks)
        if seq.beam is not None:  # a beam search starts over from its prompt (it is deterministic)
            seq.beam.drop(self.blocks)
        seq.num_computed = seq.num_registered = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq)

    # -- results ---------------------------------------------------------------------------------

    def complete(
        self,
        step_id: int,
        handles: np.ndarray,  # [B] int64, the step's rows in plan order
        token_ids: np.ndarray,  # [N] int64: each row's tokens in order, -1 for a row not sampled
        num_tokens: np.ndarray | None = None,  # [B] int32 entries per row; None: one each
        t_start_ns: int = 0,  # when execute began and ended the step (0: not known)
        t_end_ns: int = 0,
        top_ids: np.ndarray | None = None,  # [N, K] int64: beam searches read their candidates
        top_logprobs: np.ndarray | None = None,  # [N, K] float32
        num_drafted: np.ndarray | None = None,  # [B] int32 drafts execute filled in; None: none
    ) -> tuple[list[tuple[Sequence, int]], list[int]]:
        """Apply one step's sampled tokens: the (sequence, token) pairs to pass on, in order, and
        the entry of token_ids each came from. A row that verified drafts emits up to 1 + drafts
        tokens; none after a stop token or the length limit. A beam search emits nothing until it
        ends, and then each choice's whole hypothesis."""
        step = self.in_flight.popleft()
        if step.step_id != step_id:
            raise RuntimeError(f"result for step {step_id} while step {step.step_id} was oldest")
        if len(handles) != len(step.seqs):
            raise RuntimeError(
                f"step {step_id}: {len(handles)} result rows, {len(step.seqs)} planned"
            )
        counts = [1] * len(handles) if num_tokens is None else num_tokens.tolist()
        drafted = [0] * len(handles) if num_drafted is None else num_drafted.tolist()
        self._observe_step(step, drafted, t_start_ns, t_end_ns)
        tokens = token_ids.tolist()
        out: list[tuple[Sequence, int]] = []
        rows: list[int] = []
        searches: dict[int, tuple[Sequence, list[int]]] = {}  # leader, its rows' entries
        at = 0
        for scheduled, handle, count, filled in zip(
            step.seqs, handles.tolist(), counts, drafted, strict=True
        ):
            first, at = at, at + count
            seq = scheduled.seq
            if seq.handle != handle:
                raise RuntimeError(f"step {step_id}: result row for {handle}, planned {seq.handle}")
            seq.steps_in_flight -= 1
            if scheduled.sample:
                seq.pending_outputs -= 1 + scheduled.num_draft
            if seq.beam_of is not None:  # a beam's row: its search steps once all are in
                searches.setdefault(seq.beam_of.handle, (seq.beam_of, []))[1].append(first)
                continue
            if seq.beam is not None and scheduled.sample and seq.status != Status.FINISHED:
                if seq.status == Status.RUNNING:  # the prompt's candidates: the search's first
                    searches[seq.handle] = (seq, [first])
                    seq.steps_in_flight += 1  # counted down with the beams' rows below
                continue  # (preempted meanwhile: it starts over)
            if seq.status == Status.FINISHED:
                if seq.steps_in_flight == 0:
                    self.by_handle.pop(seq.handle, None)
                continue
            if not scheduled.sample:
                continue
            if scheduled.draft is not None:
                self._verified(seq, scheduled.num_draft, filled, count - 1)
            for entry in range(first, first + count):
                token = tokens[entry]
                seq.output_ids.append(token)
                out.append((seq, token))
                rows.append(entry)
                if token in seq.stop_ids:
                    self.finish(seq, m.FINISH_STOP)
                elif (
                    len(seq.output_ids) >= seq.max_tokens
                    or seq.num_prompt + len(seq.output_ids) >= self.config.max_model_len
                ):
                    self.finish(seq, m.FINISH_LENGTH)
                if seq.status == Status.FINISHED:
                    break
        for leader, entries in searches.values():
            leader.steps_in_flight -= 1
            if leader.status == Status.RUNNING:
                self._step_search(leader, entries, top_ids, top_logprobs, out, rows)
            elif leader.status == Status.FINISHED and leader.steps_in_flight == 0:
                self.by_handle.pop(leader.handle, None)
        return out, rows

    def _step_search(
        self,
        leader: Sequence,
        entries: list[int],  # the entries of its rows in the step's results
        top_ids: np.ndarray | None,
        top_logprobs: np.ndarray | None,
        out: list[tuple[Sequence, int]],
        rows: list[int],
    ) -> None:
        """Step a beam search on its candidates; once it is over, each choice gets its hypothesis
        (the index-th best) as its outputs, and the request finishes."""
        group = leader.beam
        if group is None or top_ids is None or top_logprobs is None:
            raise RuntimeError(f"beam search {leader.handle}: a result without candidates")
        max_new_tokens = min(leader.max_tokens, self.config.max_model_len - leader.num_prompt)
        done = group.advance(
            self.blocks,
            leader,
            max_new_tokens,
            top_ids[entries],
            top_logprobs[entries],
            self.decode,
        )
        if not done:
            return
        results = group.results()
        members = sorted(group.members.items(), reverse=True)  # the leader last: it ends the group
        for index, member in members:
            hypothesis = results[index] if index < len(results) else None
            member.output_ids = [] if hypothesis is None else list(hypothesis.tokens)
            member.scheduled_ns = member.scheduled_ns or leader.scheduled_ns  # (its queue ended)
            # No logprobs (refused), so any row of the step will do; a choice left without a
            # hypothesis (stop strings ended every beam early) still gets its finish.
            for token in member.output_ids[group.resumed.get(index, 0) :] or [-1]:
                out.append((member, token))
                rows.append(entries[-1])
            stop_token = bool(member.output_ids) and member.output_ids[-1] in leader.stop_ids
            # A stop string's hypothesis ends as "length" here: detokenize finds the string
            # and makes it "stop" (a stop token's finish would hide the last token's text).
            self.finish(member, m.FINISH_STOP if stop_token else m.FINISH_LENGTH)

    def _verified(
        self, seq: Sequence, num_reserved: int, num_drafted: int, num_accepted: int
    ) -> None:
        """Count a verification (of the drafts execute filled into the positions reserved) and
        give back the KV slots of the positions not kept."""
        if num_drafted:  # (none where execute had no proposal: nothing was verified)
            self._count_verification(seq, num_drafted, num_accepted)
        if seq.status != Status.RUNNING:
            return  # preempted meanwhile: it holds no blocks and recomputes from its tokens
        seq.num_computed -= num_reserved - num_accepted
        keep = self.blocks.blocks_for(seq.num_computed + 1)  # room for the next input token
        if len(seq.blocks) > keep:
            tail = seq.blocks[keep:]
            del seq.blocks[keep:]
            self.blocks.free(tail)

    def _count_verification(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        seq.spec_steps += 1
        seq.spec_drafted += num_drafted
        seq.spec_accepted += num_accepted
        if len(seq.spec_histogram) <= num_accepted:
            seq.spec_histogram.extend([0] * (num_accepted + 1 - len(seq.spec_histogram)))
        seq.spec_histogram[num_accepted] += 1
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1
        self.num_spec_drafts += 1
        self.num_spec_draft_tokens += num_drafted
        self.num_spec_accepted += num_accepted
        seq.acceptance = draft_policy.update_acceptance(seq.acceptance, num_drafted, num_accepted)

    def _observe_step(
        self,
        step: Step,
        drafted: list[int],  # per row, the drafts execute filled into its reserved positions
        t_start_ns: int,
        t_end_ns: int,
    ) -> None:
        """Feed the draft policy's cost model the step's time against the tokens it computed."""
        if not t_end_ns or t_end_ns <= t_start_ns:
            return
        if step.beside_decodes:
            seconds = (t_end_ns - t_start_ns) / 1e9
            keep = math.exp(-seconds / LONG_SHARE_WINDOW_S)
            self._decoding_s = keep * self._decoding_s + seconds
            self._long_prefill_s = keep * self._long_prefill_s + seconds * step.carries_long_prefill
        # Drafts are decode rows: fit on steps of decode rows only (a prefill chunk's tokens run
        # on kernels several times cheaper per token, and would make drafts look cheap).
        if all(s.num_tokens == 1 + s.num_draft for s in step.seqs):
            tokens = len(step.seqs) + sum(drafted)
            self.cost.observe(tokens, (t_end_ns - t_start_ns) / 1e9)

    def stats(self) -> dict[str, float]:
        """By the names of stages/rings/gauges.py, which schedule publishes in that order."""
        return {
            # a beam search's parked choices run with its leader (vLLM counts its n as running)
            "num_requests_running": len(self.running)
            + sum(len(g.members) - (0 in g.members) for g in self.beam_groups.values()),
            "num_requests_waiting": len(self.waiting),
            "num_requests_waiting_deferred": self._num_waiting_for_an_adapter_slot(),
            "kv_cache_usage_perc": self.blocks.usage,
            "num_free_blocks": self.blocks.num_free,
            "num_preemptions_total": self.num_preemptions,
            "num_blocks": self.blocks.num_blocks,
            "prefix_cache_queries_total": self.prefix_cache_queries,
            "prefix_cache_hits_total": self.prefix_cache_hits,
            "spec_decode_num_drafts_total": self.num_spec_drafts,
            "spec_decode_num_draft_tokens_total": self.num_spec_draft_tokens,
            "spec_decode_num_accepted_tokens_total": self.num_spec_accepted,
        }


def _placeholders(count: int) -> np.ndarray:  # -> [count] int32
    """Draft positions for execute to fill."""
    return np.full(count, -1, np.int32)
