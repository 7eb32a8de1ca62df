"""The schedule stage: admits rendered prompts, plans steps for execute (one ahead), turns results
into token rows for detokenize, and frees what aborts and stop strings finish. A prefix-cache
reset, in order on `prompts`, drops the prefix of every block no request holds.

A prompt with a grammar waits outside the scheduler until execute has built its matcher (in a
worker thread, up to seconds): it goes to execute at once (plan.GRAMMARS), and into the scheduler
when execute says it is ready (results.MATCHERS). The steps of everyone else go on meanwhile.

Schedule outlives a restart of render or detokenize alone: it reads what the dead stage published,
then moves to the ring's successor. After render, the engine submits again every request it has
no output of; schedule drops those it has already heard of. After detokenize, `DetokLink` replays
the requests' text states and the last tokens messages.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterator

import numpy as np

from pipeline.actor import AsyncActor
from pipeline.clock import now_ns
from pipeline.errors import PeerDied
from stages import spans
from stages.actors.detok_link import DetokLink
from stages.beam_group import BeamRequest
from stages.config import EngineConfig, resolve_max_model_len
from stages.kv_size import planned_num_blocks
from stages.published import publish_lora_requests
from stages.rings import common, plan, prompts, results, tokens
from stages.rings.common import FINISH_STOP, PromptLogprobs
from stages.rings.gauges import StepTokens, pack_gauges
from stages.rings.prompts import RenderedPrompt
from stages.scheduler import Scheduler, SchedulerConfig, Sequence, Status
from stages.text.snapshot import tokenizer_of
from stages.text.tokenizer import TokenizerBundle

MAX_STEPS_IN_FLIGHT = 2  # one executing, one queued behind it: execute never waits for a plan
# Handles of the last requests admitted: a request the engine submits again after a restart of
# render is one of those in flight, which are far fewer.
ADMITTED_MEMORY = 16384


class ScheduleActor(AsyncActor):
    def warm_up(self) -> None:
        config: EngineConfig = self.ctx.config
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_prefill_tokens_while_decoding=config.max_prefill_tokens_while_decoding,
                long_prefill_token_threshold=config.long_prefill_token_threshold,
                max_long_partial_prefills=config.max_long_partial_prefills,
                max_num_partial_prefills=config.max_num_partial_prefills,
                long_prefill_share=config.long_prefill_share,
                max_model_len=resolve_max_model_len(config),
                # sized from device memory: once execute has loaded the model and published them
                num_blocks=planned_num_blocks(config, config.startup_timeout_s),
                block_size=config.block_size,
                enable_prefix_caching=config.enable_prefix_caching,
                speculative=config.speculative,
                max_loras=0 if config.lora is None else config.lora.max_loras,
                async_scheduling=config.async_scheduling,
            ),
            decode=self.decode,
        )
        self.tokenizer: TokenizerBundle | None = None  # loaded for the first stop string of a beam
        self.wake = asyncio.Event()
        self.awaiting_matchers: dict[int, Sequence] = {}  # by handle, until execute has built them
        # adapters' names by id, and the running and waiting ones last published (--enable-lora)
        self.lora_names: dict[int, str] = {}
        self.lora_published: tuple[list[str], list[str]] | None = None
        self.matchers_to_build: list[Sequence] = []  # of those, the ones not yet sent to execute
        self.admitted: deque[int] = deque(maxlen=ADMITTED_MEMORY)
        self.admitted_set: set[int] = set()
        self.detok_link = DetokLink(self.ctx, self.live_sequences)
        # Engine steps by their tokens (vLLM's iteration_tokens_total, for /metrics), from each
        # step's prompt tokens, kept by step id until its result brings the tokens it made.
        self.step_tokens = StepTokens()
        self.prompt_tokens_in_flight: dict[int, int] = {}

    def live_sequences(self) -> Iterator[Sequence]:
        return (s for s in self.scheduler.by_handle.values() if s.status != Status.FINISHED)

    def admit(self, handle: int) -> bool:
        """False for a request schedule has already heard of (submitted again after a restart
        of render, which may have passed it on before it died): one it holds now, however long
        ago it came, or one of the last ADMITTED_MEMORY it admitted."""
        if (
            handle in self.admitted_set
            or handle in self.scheduler.by_handle
            or handle in self.awaiting_matchers
        ):
            return False
        if len(self.admitted) == self.admitted.maxlen:
            self.admitted_set.discard(self.admitted[0])
        self.admitted.append(handle)
        self.admitted_set.add(handle)
        return True

    async def run(self) -> None:
        if self.scheduler.config.max_loras:  # what an earlier schedule published is gone
            self.publish_loras()
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self.read_prompts())
            tasks.create_task(self.read_stop_hits())
            tasks.create_task(self.read_results())
            tasks.create_task(self.plan_steps())

    # -- inputs ----------------------------------------------------------------------------------

    async def read_prompts(self) -> None:
        while True:
            try:
                message = await self.ctx.inbox["prompts"].recv_async()
            except PeerDied:  # render died: on to the ring of the one restarted in its place
                await self.ctx.reattach("prompts")
                continue
            with message:
                if message.name == common.RESET_PREFIX_CACHE.name:
                    reset_id = common.unpack_reset_prefix_cache(message)
                    dropped = self.scheduler.blocks.reset_prefix_cache()
                    self.ctx.log.info("prefix cache reset", reset_id=reset_id, blocks=dropped)
                    continue
                if message.name == common.ABORT.name:
                    handles, prompt = common.unpack_abort(message), None
                else:
                    handles, prompt = [], prompts.unpack_prompt(message)
            if prompt is not None and self.admit(prompt.handle):
                seq = _sequence(prompt)
                rendered = prompt.request()
                if rendered.lora is not None:
                    self.lora_names[rendered.lora.lora_id] = rendered.lora.name
                if rendered.grammar:
                    self.awaiting_matchers[seq.handle] = seq
                    self.matchers_to_build.append(seq)
                else:
                    self.scheduler.add(seq)
            for handle in handles:
                if self.awaiting_matchers.pop(handle, None) is not None:
                    self.matchers_to_build = [
                        s for s in self.matchers_to_build if s.handle != handle
                    ]
                    self.scheduler.forget(handle)  # execute drops what it built or is building
            aborted = [self.scheduler.abort(h) for h in handles]
            gone = [s for s in aborted if s is not None and s.sent_to_detok]
            if gone:
                await self.send_tokens(-1, [(s, -1) for s in gone])
            self.wake.set()

    async def read_stop_hits(self) -> None:
        while True:
            handles = await self.detok_link.stop_hits()
            for handle in handles:
                seq = self.scheduler.by_handle.get(handle)
                if seq is not None and seq.status != Status.FINISHED:
                    self.scheduler.finish(seq, FINISH_STOP)
            self.wake.set()

    async def read_results(self) -> None:
        inbox = self.ctx.inbox["results"]
        while True:
            message = await inbox.recv_async()
            started = now_ns()
            if message.name == results.MATCHERS.name:
                with message:
                    ready = results.unpack_matchers(message)
                for handle in ready:
                    seq = self.awaiting_matchers.pop(handle, None)
                    if seq is not None:  # else aborted meanwhile
                        self.scheduler.add(seq)
                self.wake.set()
                continue
            with message:
                result = results.unpack_result(message)
            # Before `complete`: a request that finishes in this step (max_tokens 1, which is how
            # a prompt is scored) leaves the scheduler there, and its prompt logprobs with it.
            prompt = self.with_first_prompt_token(result.prompt)
            emitted, rows = self.scheduler.complete(
                result.step_id,
                result.handles,
                result.token_ids,
                result.num_tokens,
                result.t_start_ns,
                result.t_end_ns,
                result.top_ids,
                result.top_logprobs,
                result.num_drafted,
            )
            # vLLM's iteration tokens: the prompt tokens the step computed and the tokens it made
            made = int(np.count_nonzero(result.token_ids >= 0))
            self.step_tokens.observe(self.prompt_tokens_in_flight.pop(result.step_id, 0) + made)
            self.wake.set()  # a step slot is free: plan the next before talking to detokenize
            if self.scheduler.max_in_flight == 1:
                await asyncio.sleep(0)  # execute waits for that plan: let it go first
            for seq, _ in emitted:
                if seq.first_token_ns == 0:
                    seq.first_token_ns = result.t_end_ns
                seq.last_token_ns = result.t_end_ns
            if emitted or prompt is not None:
                await self.send_tokens(result.step_id, emitted, result, rows, prompt)
            self.ctx.trace.record(
                spans.SPAN_RESULT,
                started,
                now_ns(),
                batch=len(result.handles),
                tokens=len(emitted),
                link=result.step_id,
            )

    def decode(self, token_lists: list[list[int]], skip_special_tokens: bool) -> list[str]:
        """Texts of token lists: the stop strings of beam searches are looked for here, before
        a beam runs on (detokenize only ever sees the hypotheses)."""
        if self.tokenizer is None:
            self.tokenizer = tokenizer_of(self.ctx.config)
        return self.tokenizer.tokenizer.decode_batch(
            token_lists, skip_special_tokens=skip_special_tokens
        )

    # -- outputs ---------------------------------------------------------------------------------

    async def plan_steps(self) -> None:
        outbox = self.ctx.outbox["plan"]
        scheduler = self.scheduler
        while True:
            await self.wake.wait()
            self.wake.clear()
            if self.matchers_to_build:
                to_build, self.matchers_to_build = self.matchers_to_build, []
                await outbox.send_async(
                    plan.GRAMMARS, plan.pack_grammars([(s.handle, s.rendered) for s in to_build])
                )
            while len(scheduler.in_flight) < min(MAX_STEPS_IN_FLIGHT, scheduler.max_in_flight):
                started = now_ns()
                step = scheduler.schedule()
                if step is None:
                    break
                for s in step.seqs:
                    if s.seq.scheduled_ns == 0:
                        s.seq.scheduled_ns = started
                arrays = plan.pack_step(step, scheduler.config.block_size, started)
                self.prompt_tokens_in_flight[step.step_id] = plan.prompt_tokens(arrays["seqs"])
                planned = now_ns()  # the span ends where the hop to execute begins
                await outbox.send_async(plan.STEP, arrays)
                self.ctx.trace.record(
                    spans.SPAN_PLAN,
                    started,
                    planned,
                    batch=len(step.seqs),
                    tokens=len(arrays["input_ids"]),
                    depth=outbox.depth(),
                    link=step.step_id,
                )
            self.publish()

    def publish(self) -> None:
        stats = self.scheduler.stats()
        # as vLLM counts them: waiting, and deferred by a transient constraint
        stats["num_requests_waiting"] += len(self.awaiting_matchers)
        stats["num_requests_waiting_deferred"] += len(self.awaiting_matchers)
        self.ctx.set_gauges(pack_gauges(stats, self.step_tokens, self.scheduler.accepted_per_pos))
        if self.scheduler.config.max_loras:
            self.publish_loras()

    def publish_loras(self) -> None:
        """The names of the running and waiting requests' adapters, for vLLM's
        lora_requests_info (stages/published.py), whenever they change."""
        running, waiting = self.scheduler.lora_ids()
        waiting |= {seq.lora_id for seq in self.awaiting_matchers.values() if seq.lora_id}
        names = (
            sorted(self.lora_names.get(i, str(i)) for i in running),
            sorted(self.lora_names.get(i, str(i)) for i in waiting),
        )
        if names != self.lora_published:
            self.lora_published = names
            publish_lora_requests(self.ctx.config, self.scheduler.config.max_loras, *names)

    def with_first_prompt_token(
        self, prompt: PromptLogprobs
    ) -> tuple[PromptLogprobs, list[Sequence]] | None:
        """The rows of live requests, with a row for each prompt's first token (which has no
        logprob) ahead of its first chunk, so that detokenize knows every prompt token id; and
        those requests."""
        rows = prompt.rows
        if not len(rows):
            return None
        by_handle = self.scheduler.by_handle
        live = np.array(
            [
                h in by_handle and by_handle[h].status != Status.FINISHED
                for h in rows["handle"].tolist()
            ],
            bool,
        )
        if not live.all():
            prompt = PromptLogprobs(rows[live], prompt.top_ids[live], prompt.top_logprobs[live])
            rows = prompt.rows
        if not len(rows):
            return None
        seqs = [by_handle[h] for h in dict.fromkeys(rows["handle"].tolist())]
        firsts = np.nonzero(rows["position"] == 1)[0]
        if not len(firsts):
            return prompt, seqs
        heads = np.zeros(len(firsts), common.PROMPT_LOGPROB_ROW)
        heads["handle"] = rows["handle"][firsts]
        heads["token_id"] = [by_handle[h].prompt_ids[0] for h in heads["handle"].tolist()]
        heads["logprob"] = np.nan
        width = prompt.top_ids.shape[1]
        with_heads = PromptLogprobs(
            np.insert(rows, firsts, heads),
            np.insert(prompt.top_ids, firsts, np.full((1, width), -1, np.int64), axis=0),
            np.insert(prompt.top_logprobs, firsts, np.zeros((1, width), np.float32), axis=0),
        )
        return with_heads, seqs

    async def send_tokens(
        self,
        step_id: int,
        emitted: list[tuple[Sequence, int]],
        result: results.StepResult | None = None,
        result_rows: list[int] | None = None,  # [len(emitted)]: each token's row in result
        prompt_of: tuple[PromptLogprobs, list[Sequence]] | None = None,
    ) -> None:
        seqs = [seq for seq, _ in emitted]
        candidates = seqs
        prompt = None
        if prompt_of is not None:
            # detokenize keeps prompt logprobs from the first chunk on, so it must know the request
            prompt, prompt_seqs = prompt_of
            candidates = seqs + prompt_seqs
        new = list({id(seq): seq for seq in candidates if not seq.sent_to_detok}.values())
        for seq in new:
            seq.sent_to_detok = True
        rows = np.zeros(len(emitted), tokens.TOKEN_ROW)
        rows["handle"] = [seq.handle for seq in seqs]
        rows["token_id"] = [token for _, token in emitted]
        # A row that verified drafts emits several tokens: each entry counts the outputs up to
        # it, and only a request's last entry carries its finish.
        num_outputs, finishes = [0] * len(seqs), [0] * len(seqs)
        later: dict[int, int] = {}
        for i in range(len(seqs) - 1, -1, -1):
            seq = seqs[i]
            after = later.get(id(seq), 0)
            num_outputs[i] = len(seq.output_ids) - after
            finishes[i] = seq.finish if after == 0 else common.FINISH_NONE
            later[id(seq)] = after + 1
        rows["finish"] = finishes
        rows["stop_token"] = [
            f == FINISH_STOP and t >= 0 for f, (_, t) in zip(finishes, emitted, strict=True)
        ]
        rows["num_prompt_tokens"] = [seq.num_prompt for seq in seqs]
        rows["num_output_tokens"] = num_outputs
        if result is not None and result_rows is not None:
            rows["logprob"], rows["rank"] = result.logprobs[result_rows], result.ranks[result_rows]
            top_ids, top_logprobs = result.top_ids[result_rows], result.top_logprobs[result_rows]
        else:
            top_ids, top_logprobs = np.zeros((0, 0), np.int64), np.zeros((0, 0), np.float32)
        metrics = np.zeros(len(emitted), tokens.METRICS_ROW)
        metrics["arrival_ns"] = [seq.arrival_ns for seq in seqs]
        metrics["render_start_ns"] = [seq.render_start_ns for seq in seqs]
        metrics["rendered_ns"] = [seq.rendered_ns for seq in seqs]
        metrics["scheduled_ns"] = [seq.scheduled_ns for seq in seqs]
        metrics["first_token_ns"] = [seq.first_token_ns for seq in seqs]
        metrics["last_token_ns"] = [seq.last_token_ns for seq in seqs]
        metrics["num_generated_tokens"] = rows["num_output_tokens"]
        metrics["num_preemptions"] = [seq.num_preemptions for seq in seqs]
        metrics["num_cached_prompt_tokens"] = [seq.num_cached_tokens for seq in seqs]
        metrics["num_cache_creation_tokens"] = [self.scheduler.cache_created(s) for s in seqs]
        metrics["num_recoveries"] = [seq.num_recoveries for seq in seqs]
        metrics["spec_num_steps"] = [seq.spec_steps for seq in seqs]
        metrics["spec_num_draft_tokens"] = [seq.spec_drafted for seq in seqs]
        metrics["spec_num_accepted_tokens"] = [seq.spec_accepted for seq in seqs]
        spec = self.scheduler.config.speculative
        width = spec.num_speculative_tokens + 1 if spec is not None else 0
        metrics["spec_histogram_len"] = width
        histogram = metrics["spec_acceptance_histogram"]
        for i, seq in enumerate(seqs):
            histogram[i, : len(seq.spec_histogram)] = seq.spec_histogram
        arrays = tokens.pack_tokens(
            step_id,
            rows,
            top_ids,
            top_logprobs,
            [(seq.handle, seq.detok) for seq in new],
            metrics,
            PromptLogprobs.empty() if prompt is None else prompt,
        )
        await self.detok_link.send(arrays, seqs, new)


def _sequence(prompt: RenderedPrompt) -> Sequence:
    """A rendered prompt as the scheduler tracks it; one resumed after a stage failure starts with
    the outputs its client already has, to be recomputed as after a preemption."""
    request = prompt.request()
    resume = request.resume
    return Sequence(
        handle=prompt.handle,
        priority=prompt.priority,
        arrival_ns=prompt.arrival_ns,
        prompt_ids=prompt.prompt_ids,
        max_tokens=request.max_tokens,
        stop_ids=frozenset(request.stop_token_ids),
        rendered=prompt.rendered,
        detok=prompt.detok,
        cacheable=request.cacheable,
        # A grammar's drafts are verified under it in execute (and a draft model samples them
        # under it), a thinking budget's close tag is forced wherever it falls among them. A
        # beam search's rows are its beams, one token each: no drafts.
        can_draft=request.sampling.beam is None,
        cache_salt=request.cache_salt,
        lora_id=0 if request.lora is None else request.lora.lora_id,
        render_start_ns=prompt.render_start_ns,
        rendered_ns=prompt.rendered_ns,
        output_ids=[] if resume is None else list(resume.output_ids),
        first_token_ns=0 if resume is None else resume.first_token_ns,
        num_recoveries=0 if resume is None else resume.num_recoveries,
        beam_request=None
        if request.sampling.beam is None
        else BeamRequest(
            request.sampling.beam, request.sampling.stop, request.sampling.skip_special_tokens
        ),
    )
