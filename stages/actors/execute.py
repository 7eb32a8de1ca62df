"""The execute stage: runs each planned step on the model (gpu/) and returns the sampled tokens.

It keeps, per request, the sampling parameters it was sent once, and the token it sampled last:
a plan made one step ahead names that token -1, and it is filled in here. With speculative
decoding a plan's draft positions are placeholders too: a row planned before its request's last
drafts were verified is moved back by those rejected, and a model-free method's drafts are
proposed here on the request's tokens (stages/draft_rows.py); a draft model's, in the runner.

A request with a grammar comes first on its own (plan.GRAMMARS): its matcher is built in a worker
thread while steps go on, and schedule plans the request once `results` says the matcher is ready
(results.MATCHERS).

The first execute writes its prepared model to its kept file (pipeline/kept.py) and runs on the
file's pages; one restarted after a failure maps the file instead of loading the checkpoint again.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.actor import SyncActor
from pipeline.clock import now_ns
from pipeline.errors import RingTimeout
from pipeline.kept import KeptFile
from pipeline.ring import Consumer, Message, Producer
from stages import spans
from stages.actors.tensor_group import (
    forward_sharer,
    hold_device,
    join_group,
    lost_rank_is_peer_death,
    published_blocks,
    rank_threads,
    runner_config,
)
from stages.api import LoraRequest
from stages.beam_group import scoring_sampling
from stages.config import EngineConfig, num_kv_blocks, sized_from_device_memory
from stages.cpu_bind import NONE
from stages.draft_rows import Behind, Proposer, trim
from stages.kv_size import publish_num_blocks
from stages.published import KERNELS, publish
from stages.rings import plan, results
from stages.rings.common import PROMPT_LOGPROB_ROW, PromptLogprobs
from stages.rings.plan import PlannedStep
from stages.rings.prompts import RenderedRequest
from stages.text.structured import GRAMMAR_STACK_BYTES
from stages.text.thinking import ThinkingTracker

if TYPE_CHECKING:
    import llguidance

    from gpu.runner import (
        ForcedAlong,
        GrammarMasks,
        ModelRunner,
        RunnerConfig,
        StepBatch,
        StepOutput,
    )
    from gpu.sampler import RequestSampling
    from gpu.tensor_parallel import TensorParallel
    from stages.text.structured import GrammarMatchers

# How often an otherwise idle execute looks whether a matcher it is building is done.
MATCHER_POLL_S = 0.002


@dataclass(slots=True)
class AdmittedRequest:
    """What execute keeps of one request between its first step and its release. (A grammar's
    matcher lives in `grammars`, the collection that computes every row's mask at once.)"""

    sampling: RequestSampling
    thinking: ThinkingTracker | None  # with a thinking_token_budget
    lora: LoraRequest | None  # with an adapter
    last_token: int = -1  # the token it sampled last: a plan made a step ahead names it -1


class ExecuteActor(SyncActor):
    def warm_up(self) -> None:
        import torch  # only this stage imports torch

        config: EngineConfig = self.ctx.config
        tp = None
        if config.tensor_parallel_size > 1:
            torch.set_num_threads(rank_threads(config))
        elif config.threads > 0:
            torch.set_num_threads(config.threads)
        device = hold_device(config, self.ctx.log)
        if config.tensor_parallel_size > 1:
            tp = join_group(config, device)
        sized = sized_from_device_memory(config)
        # Rank 0 sends each step's network inputs to the other ranks before its forward.
        forward = self.ctx.broadcast_out.get("forward")
        self.share = None if forward is None else forward_sharer(forward)
        # A restarted execute maps the prepared weights the first one kept (one process on the
        # CPU: a shard, an adapter's wrapped layers or a device's copy are made again).
        keep = tp is None and device == "cpu" and config.lora is None
        with lost_rank_is_peer_death():
            # A pipeline restarted after a failure keeps the count the first execute published.
            published = published_blocks(config, tp, device)
            settings = runner_config(config, device, sized, published)
            spec = config.speculative
            if sized and spec is not None and spec.model is not None:
                # the sizing counts the draft's weights and KV blocks (rank 0 holds the draft)
                settings = replace(settings, draft_model=spec.model)
            self.runner = self.prepared_runner(
                config.model_path,
                settings,
                self.ctx.kept.get("weights") if keep else None,
                tp,
            )
        # Threads started later (the grammar builder) inherit the thread that starts them, which
        # binding pins to one core: they get back all of this process's cores.
        cores = sorted(os.sched_getaffinity(0))
        if config.cpu_threads_bind != NONE:
            bind_compute_threads(cores, self.ctx.log)
        if config.snapshot_dir:  # what /version, /metrics and the engine's log name
            publish(config, KERNELS, self.runner.kernels_name)
        if sized:
            if published is None:
                publish_num_blocks(config, self.runner.num_kv_blocks)
        elif self.runner.num_kv_blocks != (expected := num_kv_blocks(config)):
            raise RuntimeError(
                f"execute has {self.runner.num_kv_blocks} KV blocks, the scheduler plans {expected}"
            )
        if spec is not None and spec.model is not None and self.runner.drafter is None:
            self.runner.attach_drafter(spec.model)  # beside a cache of a given size
        self.behind = Behind(config.block_size)
        self.proposer = (
            Proposer(spec) if spec is not None and not spec.drafts_with_a_model else None
        )
        # The step being run: each row's first position and the draft positions it reserved
        self.reserved: tuple[np.ndarray, np.ndarray] | None = None
        # Each request from its first step (admit) to its release (forget), by handle; and how
        # many of them have bad words (none: steps skip building their arrays), a thinking
        # budget, an adapter.
        self.requests: dict[int, AdmittedRequest] = {}
        self.num_with_bad_words = self.num_thinking = self.num_with_lora = 0
        # Built now (~0.25 s and ~30 MB for a 49k vocabulary), not at the first structured-output
        # request: llguidance holds the GIL while it builds its tokenizer, which would stop every
        # running stream that long, even from a worker thread.
        self.grammars = _grammar_matchers(config)
        # Every thread started from here on (the builder) can compile any grammar render let by.
        threading.stack_size(GRAMMAR_STACK_BYTES)
        self.builder = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="grammar",
            initializer=os.sched_setaffinity,
            initargs=(0, cores),
        )
        self.building: dict[int, Future[llguidance.LLMatcher]] = {}

    def prepared_runner(
        self,
        model_path: str,
        config: RunnerConfig,
        kept: KeptFile | None,
        tensor_parallel: TensorParallel | None = None,
    ) -> ModelRunner:
        """The runner, on the prepared model an execute before this one kept, if there is one;
        else on the checkpoint's, which is then kept, and on CPU mapped back from the file so
        that every execute shares its pages."""
        from gpu.backends import kernels_for
        from gpu.prepared import load_prepared, save_prepared
        from gpu.runner import ModelRunner

        kernels = kernels_for(config.device, config.native_kernels)
        started = time.monotonic()
        if kept is not None and kept.complete():
            model = load_prepared(kept.path, kernels, config.device)
            self.ctx.log.info(
                "mapped the kept weights",
                megabytes=round(kept.size_bytes / 1e6),
                seconds=round(time.monotonic() - started, 3),
            )
            return ModelRunner.from_model(model, config)
        runner = ModelRunner.from_path(model_path, config, tensor_parallel)
        if kept is not None:
            kept.clear()  # what an execute that died while writing it left
            save_prepared(runner.model, kept.path)
            kept.seal()
            if config.device == "cpu":
                runner.model = load_prepared(kept.path, kernels, config.device)
            self.ctx.log.info(
                "kept the prepared weights",
                megabytes=round(kept.size_bytes / 1e6),
                seconds=round(time.monotonic() - started, 3),
            )
        return runner

    def run(self) -> None:
        inbox, outbox, trace = self.ctx.inbox["plan"], self.ctx.outbox["results"], self.ctx.trace
        while True:
            waited = now_ns()
            message = self.next_message(inbox, outbox)
            received = now_ns()
            if message.name == plan.GRAMMARS.name:
                with message:
                    self.build_matchers(plan.unpack_grammars(message))
                continue
            depth = inbox.depth()
            with message:
                step = plan.unpack_step(message)
            self.forget(step.free_handles)
            self.admit(step.new_requests, step.new_tokens, step.seqs)
            batch = self.batch_of(step)
            started = now_ns()
            cpu = time.process_time_ns()
            with lost_rank_is_peer_death():
                output = self.runner.step(batch, self.share)
            finished = now_ns()
            trace.record(
                spans.SPAN_FORWARD,
                started,
                finished,
                batch=len(batch.handles),
                tokens=len(batch.input_ids),
                wait_ns=received - waited,
                depth=depth,
                aux=self.runner.last_sample_ns // 1000,
                cpu_ns=time.process_time_ns() - cpu,
                lead_ns=started - received,
                link=step.step_id,
            )
            self.advance(batch.handles, output.num_tokens, output.token_ids)
            result = _result(step.step_id, batch, output, started, finished)
            outbox.send(results.RESULT, results.pack_result(result))
            self.ctx.heartbeat()

    def next_message(self, inbox: Consumer, outbox: Producer) -> Message:
        """The next plan message. While matchers are being built, each one done is announced
        between steps, or within MATCHER_POLL_S when no step comes."""
        while True:
            self.announce_matchers(outbox)
            if not self.building:
                return inbox.recv()
            try:
                return inbox.recv(MATCHER_POLL_S)
            except RingTimeout:
                continue

    def build_matchers(self, requests: list[tuple[int, RenderedRequest]]) -> None:
        """Start building each request's matcher in the builder thread, in arrival order."""
        for handle, request in requests:
            consumed = () if request.resume is None else request.resume.output_ids
            self.building[handle] = self.builder.submit(
                self.grammars.build, request.grammar, consumed, request.grammar_after
            )

    def announce_matchers(self, outbox: Producer) -> None:
        done = [handle for handle, future in self.building.items() if future.done()]
        if not done:
            return
        for handle in done:  # a build that raised raises here, and fails the stage
            self.grammars.add(handle, self.building.pop(handle).result())
        outbox.send(results.MATCHERS, results.pack_matchers(done))

    def forget(self, handles: np.ndarray) -> None:
        for handle in handles.tolist():
            self.release(handle)
            self.behind.forget(handle)
            if self.proposer is not None:
                self.proposer.forget(handle)
            building = self.building.pop(handle, None)
            if building is not None:  # aborted before its matcher was done
                building.cancel()
            self.grammars.drop(handle)
        if len(handles):
            self.runner.free(handles)

    def admit(
        self,
        requests: list[tuple[int, RenderedRequest]],
        tokens: dict[int, np.ndarray],  # their known tokens, for a proposer
        rows: np.ndarray,  # [B] STEP_SEQ, the step that brings them
    ) -> None:
        from gpu.sampler import RequestSampling

        prompt_lens = dict(zip(rows["handle"].tolist(), rows["prompt_len"].tolist(), strict=True))
        for handle, request in requests:
            self.behind.forget(handle)
            if self.proposer is not None:
                known = tokens.get(handle, np.zeros(0, np.int32))
                self.proposer.admit(handle, known, prompt_lens[handle])
            params = request.sampling
            if params.beam is not None:
                vocab_size = self.runner.model_config.vocab_size
                params = scoring_sampling(params, request.stop_token_ids, vocab_size)
            sampling = RequestSampling.of(params, request.stop_token_ids, request.bad_words)
            tracker = None
            if request.thinking is not None:
                tracker = ThinkingTracker(request.thinking)
                for token in () if request.resume is None else request.resume.output_ids:
                    tracker.forced()
                    tracker.consume(token)
            self.hold(handle, AdmittedRequest(sampling, tracker, request.lora))
            if request.grammar and handle not in self.grammars:
                raise RuntimeError(f"request {handle} was planned before its grammar matcher")

    def hold(self, handle: int, request: AdmittedRequest) -> None:
        """Keep a request from its first step on (in place of any it replaces)."""
        self.release(handle)
        self.requests[handle] = request
        self.num_with_bad_words += request.sampling.has_bad_words
        self.num_thinking += request.thinking is not None
        self.num_with_lora += request.lora is not None

    def release(self, handle: int) -> None:
        request = self.requests.pop(handle, None)
        if request is not None:
            self.num_with_bad_words -= request.sampling.has_bad_words
            self.num_thinking -= request.thinking is not None
            self.num_with_lora -= request.lora is not None

    def batch_of(self, step: PlannedStep) -> StepBatch:
        from gpu.runner import StepBatch
        from gpu.sampler import gather

        seqs = step.seqs
        handles = seqs["handle"].astype(np.int64)
        input_ids = step.input_ids.astype(np.int64)
        unknown = np.nonzero(input_ids < 0)[0]
        num_draft = seqs["num_draft"]
        if len(unknown):
            owner = np.searchsorted(seqs["query_start"], unknown, side="right") - 1
            # Only a row's input token is the one sampled last; unknown drafts are placeholders,
            # filled below (or by the runner's draft model).
            first_draft = seqs["query_start"] + seqs["query_len"] - num_draft
            inputs = unknown < first_draft[owner]
            unknown, owner = unknown[inputs], owner[inputs]
            input_ids[unknown] = [self.requests[int(h)].last_token for h in handles[owner]]
        query_start_loc = step.query_start_loc.astype(np.int32)
        positions = step.positions.astype(np.int64)
        slot_mapping = step.slot_mapping
        context_lens = seqs["context_len"].astype(np.int32)
        self.behind.rebase(
            handles, query_start_loc, positions, slot_mapping, context_lens, step.block_tables
        )
        self.reserved = (positions[query_start_loc[:-1]], num_draft)
        if self.proposer is not None and num_draft.any():
            kept = self.proposer.fill(handles, query_start_loc, input_ids, num_draft)
            if (kept < num_draft).any():  # the positions nobody has a draft for are not run
                query_start_loc, arrays, context_lens, num_draft = trim(
                    query_start_loc,
                    [input_ids, positions, slot_mapping],
                    context_lens,
                    num_draft,
                    kept,
                )
                input_ids, positions, slot_mapping = arrays
        admitted = [self.requests[h] for h in handles.tolist()]
        requests = [a.sampling for a in admitted]
        grammars = self.grammars if len(self.grammars) else None
        bitmask = (
            grammars.masks(handles.tolist(), seqs["sample"].tolist())
            if grammars is not None
            else np.zeros((len(handles), 0), np.int32)
        )
        grammar_masks = None
        if bitmask.shape[1] and num_draft.any():
            grammar_masks = self.grammar_masks(handles.tolist())
        forced_along = None
        if self.num_thinking and num_draft.any():
            forced_along = self.forced_along(admitted)
        lora_ids, lora_paths = self.adapters_of(admitted)
        return StepBatch(
            handles=handles,
            input_ids=input_ids,
            positions=positions,
            query_start_loc=query_start_loc,
            context_lens=context_lens,
            block_tables=step.block_tables,
            slot_mapping=slot_mapping,
            prompt_lens=seqs["prompt_len"].astype(np.int32),
            sample=seqs["sample"].astype(bool),
            sampling=gather(
                requests,
                bitmask,
                self.num_with_bad_words > 0,
                self.forced_tokens(admitted, seqs["sample"]) if self.num_thinking else None,
            ),
            prompt_logprobs=np.array([r.prompt_logprobs for r in requests], np.int32),
            num_draft=num_draft if num_draft.any() else None,
            grammar_masks=grammar_masks,
            forced_along=forced_along,
            lora_ids=lora_ids,
            lora_paths=lora_paths,
            block_copies=step.block_copies,  # beams about to write blocks they shared
        )

    def adapters_of(self, rows: list[AdmittedRequest]) -> tuple[np.ndarray | None, dict[int, str]]:
        """Each row's adapter id (0: the base model) and each adapter's path; (None, {}) when no
        request has one."""
        if not self.num_with_lora:
            return None, {}
        found = [row.lora for row in rows]
        ids = np.array([0 if lora is None else lora.lora_id for lora in found], np.int64)
        return ids, {lora.lora_id: lora.path for lora in found if lora is not None}

    def grammar_masks(self, handles: list[int]) -> GrammarMasks:
        """What the runner asks of a step's grammars once its drafts are known (a draft model
        samples them in the step): a row's masks at its next position and after each draft, as
        if it had taken them (the matcher is rolled back), or None for a row without one."""
        grammars = self.grammars

        def masks(row: int, drafts: list[int], last_only: bool) -> np.ndarray | None:
            handle = handles[row]
            if handle not in grammars:
                return None
            return grammars.draft_masks(handle, drafts, last_only)

        return masks

    def forced_along(self, rows: list[AdmittedRequest]) -> ForcedAlong:
        """What the runner asks of a step's thinking budgets once its drafts are known: the token
        forced at a row's next position and after each draft, as if it had taken them (the
        tracker does not move), or None for a row without a budget."""

        def along(row: int, drafts: list[int]) -> list[int] | None:
            tracker = rows[row].thinking
            return None if tracker is None else tracker.forced_along(drafts)

        return along

    def forced_tokens(
        self, rows: list[AdmittedRequest], sample: np.ndarray
    ) -> np.ndarray:  # -> [S] int32
        """Per row the token its thinking budget forces at its next position (the end tag's, once
        spent), or -1; a row's positions after drafts are forced_along's."""
        forced = np.full(len(rows), -1, np.int32)
        for row, (admitted, samples) in enumerate(zip(rows, sample.tolist(), strict=True)):
            tracker = admitted.thinking
            if samples and tracker is not None:
                forced[row] = tracker.forced()
        return forced

    def advance(self, handles: np.ndarray, num_tokens: np.ndarray, sampled: np.ndarray) -> None:
        """Remember each row's last sampled token (the next plan may name it -1) and how far
        short of its reserved drafts it fell; feed the grammars, the thinking budgets and the
        proposer every token a row emitted."""
        grammars = self.grammars if len(self.grammars) else None
        tokens = sampled.tolist()
        firsts, reserved = ([], []) if self.reserved is None else self.reserved
        drafting = np.flatnonzero(reserved).tolist()
        for row in drafting:
            self.behind.verified(
                int(handles[row]), int(firsts[row]), int(reserved[row]), int(num_tokens[row]) - 1
            )
        at = 0
        for handle, count in zip(handles.tolist(), num_tokens.tolist(), strict=True):
            request = self.requests[handle]
            tracker = request.thinking
            if self.proposer is not None and tokens[at] >= 0:
                self.proposer.emitted(handle, tokens[at : at + count])
            for token in tokens[at : at + count]:
                if token >= 0:
                    request.last_token = token
                    if grammars is not None:
                        grammars.consume(handle, token)
                    if tracker is not None:
                        tracker.consume(token)
            at += count


def bind_compute_threads(cores: list[int], log: Any) -> None:
    """--cpu-threads-bind: the engine gave this process its compute cores; each thread of the
    OpenMP pool (the C kernels' and torch's) now takes one, in order, thread 0 (this one, which
    also runs the step's serial work) the lowest. Without the C kernels the pool cannot be
    reached thread by thread: the process mask alone holds, and the log says so."""
    from gpu import native

    if native.load() is None:
        log.warning("compute threads not bound one a core: no CPU kernels", cores=cores)
        return
    bound = native.bind_threads(cores)
    log.info("compute threads bound", cores=cores, threads=bound)


def _grammar_matchers(config: EngineConfig) -> GrammarMatchers:
    """The matchers of structured-output requests, over the model's vocabulary."""
    from stages.text.snapshot import model_config_of, tokenizer_of
    from stages.text.structured import GrammarMatchers

    bundle = tokenizer_of(config)
    vocab_size = max(model_config_of(config).vocab_size, bundle.vocab_size)
    return GrammarMatchers(bundle.tokenizer.to_str(), vocab_size, bundle.eos_token_ids)


def _result(
    step_id: int, batch: StepBatch, output: StepOutput, started_ns: int, finished_ns: int
) -> results.StepResult:
    """The runner's output as the results ring carries it; prompt logprob rows tagged with their
    request's handle."""
    handles = batch.handles
    drafted = np.zeros(len(handles), np.int32)
    if batch.num_draft is not None:
        drafted = np.where(batch.sample, batch.num_draft, 0).astype(np.int32)
    rows = np.zeros(len(output.prompt_positions), PROMPT_LOGPROB_ROW)
    if len(rows):
        rows["handle"] = np.repeat(handles, np.diff(output.prompt_logprob_start_loc))
        rows["position"] = output.prompt_positions
        rows["token_id"] = output.prompt_token_ids
        rows["logprob"] = output.prompt_token_logprobs
        rows["rank"] = output.prompt_ranks
    return results.StepResult(
        step_id=step_id,
        t_start_ns=started_ns,
        t_end_ns=finished_ns,
        handles=handles,
        num_tokens=output.num_tokens,
        num_drafted=drafted,
        token_ids=output.token_ids,
        logprobs=output.logprobs,
        ranks=output.ranks,
        top_ids=output.top_ids,
        top_logprobs=output.top_logprobs,
        prompt=PromptLogprobs(rows, output.prompt_top_ids, output.prompt_top_logprobs),
    )
