"""The schedule stage: admits rendered prompts, plans steps for execute (one ahead), turns results
into token rows for detokenize, and frees what aborts and stop strings finish."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from pipeline.actor import AsyncActor
from pipeline.clock import now_ns
from pipeline.ring import Message
from stages import messages as m
from stages.config import EngineConfig, num_kv_blocks
from stages.render import resolve_max_model_len
from stages.scheduler import Scheduler, SchedulerConfig, Sequence, Status, Step

MAX_STEPS_IN_FLIGHT = 2  # one executing, one queued behind it: execute never waits for a plan
GAUGES = (
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "num_free_blocks",
    "num_preemptions_total",
    "num_blocks",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
)


class ScheduleActor(AsyncActor):
    def warm_up(self) -> None:
        config: EngineConfig = self.ctx.config
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_prefill_tokens_while_decoding=config.max_prefill_tokens_while_decoding,
                max_model_len=resolve_max_model_len(config),
                num_blocks=num_kv_blocks(config),
                block_size=config.block_size,
                enable_prefix_caching=config.enable_prefix_caching,
            )
        )
        self.wake = asyncio.Event()

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self.read_prompts())
            tasks.create_task(self.read_stop_hits())
            tasks.create_task(self.read_results())
            tasks.create_task(self.plan_steps())

    # -- inputs ----------------------------------------------------------------------------------

    async def read_prompts(self) -> None:
        inbox = self.ctx.inbox["prompts"]
        while True:
            with await inbox.recv_async() as message:
                if message.name == "abort":
                    aborted = [self.scheduler.abort(h) for h in message["handles"].tolist()]
                else:
                    self.scheduler.add(_sequence(message))
                    aborted = []
            gone = [s for s in aborted if s is not None and s.sent_to_detok]
            if gone:
                await self.send_tokens(-1, [(s, -1) for s in gone], None)
            self.wake.set()

    async def read_stop_hits(self) -> None:
        inbox = self.ctx.inbox["stop_hits"]
        while True:
            with await inbox.recv_async() as message:
                handles = message["handles"].tolist()
            for handle in handles:
                seq = self.scheduler.by_handle.get(handle)
                if seq is not None and seq.status != Status.FINISHED:
                    self.scheduler.finish(seq, m.FINISH_STOP)
            self.wake.set()

    async def read_results(self) -> None:
        inbox = self.ctx.inbox["results"]
        while True:
            message = await inbox.recv_async()
            started = now_ns()
            with message:
                meta = message["meta"].tolist()
                step_id, top_k, t_end = meta[0], meta[2], meta[4]
                handles = message["handles"].copy()
                token_ids = message["token_ids"].copy()
                logprobs = message["logprobs"].copy()
                ranks = message["ranks"].copy()
                top_ids = message["top_ids"].reshape(len(handles), top_k).copy()
                top_logprobs = message["top_logprobs"].reshape(len(handles), top_k).copy()
                prompt = None
                if len(message["prompt_rows"]):
                    prompt = PromptLogprobs.of(message, meta[5])
            self.wake.set()  # a step slot is free: plan the next before talking to detokenize
            emitted, rows = self.scheduler.complete(step_id, handles, token_ids)
            for seq, _ in emitted:
                if seq.first_token_ns == 0:
                    seq.first_token_ns = t_end
                seq.last_token_ns = t_end
            extras = (logprobs[rows], ranks[rows], top_ids[rows], top_logprobs[rows])
            if prompt is not None:
                prompt = self.with_first_prompt_token(prompt)
            if emitted or prompt is not None:
                await self.send_tokens(step_id, emitted, extras, prompt)
            self.ctx.trace.record(
                m.SPAN_RESULT, started, now_ns(), batch=len(handles), tokens=len(emitted)
            )

    # -- outputs ---------------------------------------------------------------------------------

    async def plan_steps(self) -> None:
        outbox = self.ctx.outbox["plan"]
        scheduler = self.scheduler
        while True:
            await self.wake.wait()
            self.wake.clear()
            while len(scheduler.in_flight) < MAX_STEPS_IN_FLIGHT:
                started = now_ns()
                step = scheduler.schedule()
                if step is None:
                    break
                arrays = _plan_arrays(step, scheduler.config.block_size)
                await outbox.send_async(m.STEP, arrays)
                self.ctx.trace.record(
                    m.SPAN_PLAN,
                    started,
                    now_ns(),
                    batch=len(step.seqs),
                    tokens=len(arrays["input_ids"]),
                    depth=outbox.depth(),
                )
            self.publish()

    def publish(self) -> None:
        stats = self.scheduler.stats()
        self.ctx.set_gauges([float(stats[name]) for name in GAUGES])

    def with_first_prompt_token(self, prompt: PromptLogprobs) -> PromptLogprobs | None:
        """The rows of live requests, with a row for each prompt's first token (which has no
        logprob) ahead of its first chunk, so that detokenize knows every prompt token id."""
        by_handle = self.scheduler.by_handle
        rows = prompt.rows
        live = np.array([h in by_handle for h in rows["handle"].tolist()], bool)
        if not live.all():
            prompt = PromptLogprobs(rows[live], prompt.top_ids[live], prompt.top_logprobs[live])
            rows = prompt.rows
        if not len(rows):
            return None
        firsts = np.nonzero(rows["position"] == 1)[0]
        if not len(firsts):
            return prompt
        heads = np.zeros(len(firsts), m.PROMPT_LOGPROB_ROW)
        heads["handle"] = rows["handle"][firsts]
        heads["token_id"] = [by_handle[h].prompt_ids[0] for h in heads["handle"].tolist()]
        heads["logprob"] = np.nan
        width = prompt.top_ids.shape[1]
        return PromptLogprobs(
            np.insert(rows, firsts, heads),
            np.insert(prompt.top_ids, firsts, np.full((1, width), -1, np.int64), axis=0),
            np.insert(prompt.top_logprobs, firsts, np.zeros((1, width), np.float32), axis=0),
        )

    async def send_tokens(
        self,
        step_id: int,
        emitted: list[tuple[Sequence, int]],
        extras: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None,
        prompt: PromptLogprobs | None = None,
    ) -> None:
        count = len(emitted)
        seqs = [seq for seq, _ in emitted]
        candidates = seqs
        if prompt is not None:
            # detokenize keeps prompt logprobs from the first chunk on, so it must know the request
            by_handle = self.scheduler.by_handle
            candidates = seqs + [
                by_handle[h] for h in dict.fromkeys(prompt.rows["handle"].tolist())
            ]
        new = list({id(seq): seq for seq in candidates if not seq.sent_to_detok}.values())
        for seq in new:
            seq.sent_to_detok = True
        rows = np.zeros(count, m.TOKEN_ROW)
        rows["handle"] = [seq.handle for seq in seqs]
        rows["token_id"] = [token for _, token in emitted]
        finishes = [seq.finish for seq in seqs]
        rows["finish"] = finishes
        rows["stop_token"] = [
            f == m.FINISH_STOP and t >= 0 for f, (_, t) in zip(finishes, emitted, strict=True)
        ]
        rows["num_prompt_tokens"] = [seq.num_prompt for seq in seqs]
        rows["num_output_tokens"] = [len(seq.output_ids) for seq in seqs]
        rows["num_preemptions"] = [seq.num_preemptions for seq in seqs]
        rows["num_cached_tokens"] = [seq.num_cached_tokens for seq in seqs]
        stamps = np.zeros(count, m.STAMP_ROW)
        stamps["arrival_ns"] = [seq.arrival_ns for seq in seqs]
        stamps["render_start_ns"] = [seq.render_start_ns for seq in seqs]
        stamps["rendered_ns"] = [seq.rendered_ns for seq in seqs]
        stamps["scheduled_ns"] = [seq.scheduled_ns for seq in seqs]
        stamps["first_token_ns"] = stamps["prefill_done_ns"] = [seq.first_token_ns for seq in seqs]
        stamps["last_token_ns"] = [seq.last_token_ns for seq in seqs]
        top_k = 0 if extras is None else extras[2].shape[1]
        if extras is not None:
            rows["logprob"], rows["rank"] = extras[0], extras[1]
        if prompt is None:
            prompt = NO_PROMPT_LOGPROBS
        detok = [seq.detok for seq in new]
        await self.ctx.outbox["tokens"].send_async(
            m.TOKENS,
            {
                "meta": np.array([step_id, top_k, prompt.top_ids.shape[1]], np.int64),
                "rows": rows,
                "stamps": stamps,
                "top_ids": (
                    extras[2] if extras is not None else np.zeros((0, 0), np.int64)
                ).ravel(),
                "top_logprobs": (
                    extras[3] if extras is not None else np.zeros((0, 0), np.float32)
                ).ravel(),
                "new_handles": np.array([s.handle for s in new], np.int64),
                "new_offsets": np.cumsum([0, *map(len, detok)], dtype=np.int32),
                "new_detok": np.frombuffer(b"".join(detok), np.uint8),
                "prompt_rows": prompt.rows,
                "prompt_top_ids": prompt.top_ids.ravel(),
                "prompt_top_logprobs": prompt.top_logprobs.ravel(),
            },
        )


@dataclass(slots=True, frozen=True)
class PromptLogprobs:
    """One step's prompt-logprob rows and their top-k, as they go on to detokenize."""

    rows: np.ndarray  # [P] PROMPT_LOGPROB_ROW
    top_ids: np.ndarray  # [P, Kp] int64
    top_logprobs: np.ndarray  # [P, Kp] float32

    @classmethod
    def of(cls, message: Message, top_k: int) -> PromptLogprobs:
        rows = message["prompt_rows"].copy()
        return cls(
            rows,
            message["prompt_top_ids"].reshape(len(rows), top_k).copy(),
            message["prompt_top_logprobs"].reshape(len(rows), top_k).copy(),
        )


NO_PROMPT_LOGPROBS = PromptLogprobs(
    np.zeros(0, m.PROMPT_LOGPROB_ROW), np.zeros((0, 0), np.int64), np.zeros((0, 0), np.float32)
)


def _sequence(message: Message) -> Sequence:
    request = message["request"][0]
    stop_ids = message["stop_ids"].copy()
    sampling = message["sampling"].copy()
    return Sequence(
        handle=int(request["handle"]),
        priority=int(request["priority"]),
        arrival_ns=int(request["arrival_ns"]),
        prompt_ids=message["prompt_ids"].copy(),
        max_tokens=int(request["max_tokens"]),
        stop_ids=frozenset(stop_ids.tolist()),
        sampling=sampling,
        stop_list=stop_ids,
        bias_ids=message["bias_ids"].copy(),
        bias_values=message["bias_values"].copy(),
        allowed_ids=message["allowed_ids"].copy(),
        bad_words=message["bad_words"].copy(),
        detok=message["detok"].tobytes(),
        grammar=message["grammar"].tobytes(),
        cacheable=bool(
            sampling["prompt_logprobs"][0] < 0 and sampling["repetition_penalty"][0] == 1.0
        ),
        render_start_ns=int(request["render_start_ns"]),
        rendered_ns=int(request["rendered_ns"]),
    )


def _plan_arrays(step: Step, block_size: int) -> dict[str, np.ndarray]:
    planned = step.seqs
    count = len(planned)
    lengths = [s.num_tokens for s in planned]
    starts = np.array([s.start for s in planned], np.int64)
    query_lens = np.array(lengths, np.int64)
    query_start = np.zeros(count, np.int64)
    np.cumsum(query_lens[:-1], out=query_start[1:])
    total = int(query_lens.sum())
    seqs = np.zeros(count, m.STEP_SEQ)
    seqs["handle"] = [s.seq.handle for s in planned]
    seqs["query_start"] = query_start
    seqs["query_len"] = query_lens
    seqs["context_len"] = starts + query_lens
    seqs["prompt_len"] = [s.seq.num_prompt for s in planned]
    seqs["sample"] = [s.sample for s in planned]
    tables = [s.seq.blocks for s in planned]
    width = max(map(len, tables))
    # Padding points at block 0: never read past context_len, and always a valid index.
    block_tables = np.array([t + [0] * (width - len(t)) for t in tables], np.int32)
    # positions and slots of every token: row b's tokens are start_b, start_b + 1, ...
    row_of_token = np.repeat(np.arange(count), query_lens)
    positions = np.arange(total, dtype=np.int64) - query_start[row_of_token] + starts[row_of_token]
    slot_mapping = block_tables[row_of_token, positions // block_size].astype(np.int64) * block_size
    slot_mapping += positions % block_size
    if total == count:  # all decodes (or one-token chunks): one token each
        input_ids = np.array([s.seq.token_at(s.start) for s in planned], np.int32)
    else:
        # Chunks are copied as slices; the one-token rows beside them (decodes, mostly) are
        # gathered into one scatter instead of an array each.
        input_ids = np.empty(total, np.int32)
        single_rows: list[int] = []
        single_tokens: list[int] = []
        at = 0
        for row, s in enumerate(planned):
            if s.num_tokens == 1:
                single_rows.append(row)
                single_tokens.append(s.seq.token_at(s.start))
            else:
                input_ids[at : at + s.num_tokens] = s.seq.token_ids(s.start, s.start + s.num_tokens)
            at += s.num_tokens
        input_ids[query_start[single_rows]] = single_tokens
    now = now_ns()
    for s in planned:
        if s.seq.scheduled_ns == 0:
            s.seq.scheduled_ns = now
    new = step.new_for_execute
    id_lists: list[np.ndarray] = []
    for seq in new:
        id_lists += [seq.stop_list, seq.bias_ids, seq.allowed_ids, seq.bad_words]
    offsets = np.cumsum([0, *map(len, id_lists)], dtype=np.int32)
    return {
        "meta": np.array([step.step_id, count, width, now], np.int64),
        "seqs": seqs,
        "input_ids": input_ids.astype(np.int32, copy=False),
        "positions": positions.astype(np.int32),
        "slot_mapping": slot_mapping,
        "block_tables": block_tables.ravel(),
        "new_handles": np.array([s.handle for s in new], np.int64),
        "new_sampling": np.concatenate([s.sampling for s in new])
        if new
        else np.zeros(0, m.SAMPLING_ROW),
        "new_id_offsets": offsets,
        "new_ids": np.concatenate(id_lists) if id_lists else np.zeros(0, np.int32),
        "new_bias_values": np.concatenate([s.bias_values for s in new])
        if new
        else np.zeros(0, np.float32),
        "new_grammar_offsets": np.cumsum([0, *(len(s.grammar) for s in new)], dtype=np.int32),
        "new_grammars": np.frombuffer(b"".join(s.grammar for s in new), np.uint8),
        "free_handles": np.array(step.free_handles, np.int64),
    }
