"""The execute stage: runs each planned step on the model (gpu/) and returns the sampled tokens.

It keeps, per request, the sampling parameters it was sent once, and the token it sampled last:
a plan made one step ahead names that token -1, and it is filled in here.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from pipeline.actor import SyncActor
from pipeline.clock import now_ns
from stages import spans
from stages.config import EngineConfig, num_kv_blocks
from stages.rings import plan, results
from stages.rings.common import PROMPT_LOGPROB_ROW, PromptLogprobs
from stages.rings.plan import PlannedStep
from stages.rings.prompts import RenderedRequest

if TYPE_CHECKING:
    from gpu.runner import StepBatch, StepOutput
    from gpu.sampler import RequestSampling
    from stages.text.structured import GrammarMatchers


class ExecuteActor(SyncActor):
    def warm_up(self) -> None:
        import torch  # only this stage imports torch

        from gpu.runner import ModelRunner, RunnerConfig

        config: EngineConfig = self.ctx.config
        if config.threads > 0:
            torch.set_num_threads(config.threads)
        self.runner = ModelRunner.from_path(
            config.model_path,
            RunnerConfig(
                dtype=config.dtype,
                kv_cache_bytes=config.kv_cache_bytes,
                block_size=config.block_size,
                threads=config.threads,
                seed=config.seed,
                quantization=config.quantization,
                kv_cache_dtype=config.kv_cache_dtype,
            ),
        )
        expected = num_kv_blocks(config)
        if self.runner.num_kv_blocks != expected:
            raise RuntimeError(
                f"execute has {self.runner.num_kv_blocks} KV blocks, the scheduler plans {expected}"
            )
        self.sampling: dict[int, RequestSampling] = {}
        self.last_token: dict[int, int] = {}
        self.with_bad_words: set[int] = set()  # steps without them skip building their arrays
        # Built at the first structured-output request (~0.5 s once): a server that never gets
        # one carries no llguidance tokenizer.
        self.grammars: GrammarMatchers | None = None

    def run(self) -> None:
        inbox, outbox, trace = self.ctx.inbox["plan"], self.ctx.outbox["results"], self.ctx.trace
        while True:
            waited = now_ns()
            message = inbox.recv()
            depth = inbox.depth()
            with message:
                step = plan.unpack_step(message)
            self.forget(step.free_handles)
            self.admit(step.new_requests)
            batch = self.batch_of(step)
            started = now_ns()
            cpu = time.process_time_ns()
            output = self.runner.step(batch)
            finished = now_ns()
            trace.record(
                spans.SPAN_FORWARD,
                started,
                finished,
                batch=len(batch.request_ids),
                tokens=len(batch.input_ids),
                wait_ns=started - waited,
                depth=depth,
                cpu_ns=time.process_time_ns() - cpu,
            )
            self.advance(batch.request_ids, output.token_ids)
            result = _result(step.step_id, batch.request_ids, output, started, finished)
            outbox.send(results.RESULT, results.pack_result(result))
            self.ctx.heartbeat()

    def forget(self, handles: np.ndarray) -> None:
        for handle in handles.tolist():
            self.sampling.pop(handle, None)
            self.last_token.pop(handle, None)
            self.with_bad_words.discard(handle)
            if self.grammars is not None:
                self.grammars.drop(handle)
        if len(handles):
            self.runner.free(handles)

    def admit(self, requests: list[tuple[int, RenderedRequest]]) -> None:
        from gpu.sampler import RequestSampling

        for handle, request in requests:
            sampling = RequestSampling.of(
                request.sampling, request.stop_token_ids, request.bad_words
            )
            self.sampling[handle] = sampling
            if sampling.has_bad_words:
                self.with_bad_words.add(handle)
            if request.grammar:
                if self.grammars is None:
                    self.grammars = _grammar_matchers(self.ctx.config)
                self.grammars.add(handle, request.grammar)
                if request.resume is not None:  # the outputs already sent, as decoding fed them
                    for token in request.resume.output_ids:
                        self.grammars.consume(handle, token)

    def batch_of(self, step: PlannedStep) -> StepBatch:
        from gpu.runner import StepBatch
        from gpu.sampler import gather

        seqs = step.seqs
        handles = seqs["handle"].astype(np.int64)
        input_ids = step.input_ids.astype(np.int64)
        unknown = np.nonzero(input_ids < 0)[0]
        if len(unknown):
            owner = np.searchsorted(seqs["query_start"], unknown, side="right") - 1
            input_ids[unknown] = [self.last_token[int(h)] for h in handles[owner]]
        requests = [self.sampling[h] for h in handles.tolist()]
        grammars = self.grammars if self.grammars is not None and len(self.grammars) else None
        bitmask = (
            grammars.masks(handles.tolist(), seqs["sample"].tolist())
            if grammars is not None
            else np.zeros((len(handles), 0), np.int32)
        )
        return StepBatch(
            request_ids=handles,
            input_ids=input_ids,
            positions=step.positions.astype(np.int64),
            query_start_loc=step.query_start_loc.astype(np.int32),
            context_lens=seqs["context_len"].astype(np.int32),
            block_tables=step.block_tables,
            slot_mapping=step.slot_mapping,
            prompt_lens=seqs["prompt_len"].astype(np.int32),
            sample=seqs["sample"].astype(bool),
            sampling=gather(requests, bitmask, bool(self.with_bad_words)),
            prompt_logprobs=np.array([r.prompt_logprobs for r in requests], np.int32),
        )

    def advance(self, handles: np.ndarray, sampled: np.ndarray) -> None:
        """Remember each row's sampled token (the next plan may name it -1); feed the grammars."""
        grammars = self.grammars if self.grammars is not None and len(self.grammars) else None
        for handle, token in zip(handles.tolist(), sampled.tolist(), strict=True):
            if token >= 0:
                self.last_token[handle] = token
                if grammars is not None:
                    grammars.consume(handle, token)


def _grammar_matchers(config: EngineConfig) -> GrammarMatchers:
    """The matchers of structured-output requests, over the model's vocabulary."""
    from stages.text.snapshot import model_config_of, tokenizer_of
    from stages.text.structured import GrammarMatchers

    bundle = tokenizer_of(config)
    vocab_size = max(model_config_of(config).vocab_size, bundle.vocab_size)
    return GrammarMatchers(bundle.tokenizer.to_str(), vocab_size, bundle.eos_token_ids)


def _result(
    step_id: int, handles: np.ndarray, output: StepOutput, started_ns: int, finished_ns: int
) -> results.StepResult:
    """The runner's output as the results ring carries it; prompt logprob rows tagged with their
    request's handle."""
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
        token_ids=output.token_ids,
        logprobs=output.logprobs,
        ranks=output.ranks,
        top_ids=output.top_ids,
        top_logprobs=output.top_logprobs,
        prompt=PromptLogprobs(rows, output.prompt_top_ids, output.prompt_top_logprobs),
    )
