"""A null model for the execute stage: deterministic tokens, no compute.

With it the pipeline and the HTTP front end run at their own ceiling, which is what
`pipeline-serve dummy` and `pipeline-bench` measure to separate the engine's overhead from the model.
It proposes no drafts: a speculating schedule's draft positions are dropped (stages/draft_rows.py),
and its rows planned a step ahead of them are moved back, as execute moves them.
"""

from __future__ import annotations

import numpy as np

from pipeline.actor import SyncActor
from pipeline.clock import now_ns
from stages import spans
from stages.config import EngineConfig
from stages.draft_rows import Behind
from stages.rings import plan, results
from stages.rings.common import PROMPT_LOGPROB_ROW, PromptLogprobs
from stages.text.snapshot import tokenizer_of


class DummyExecuteActor(SyncActor):
    def warm_up(self) -> None:
        config: EngineConfig = self.ctx.config
        bundle = tokenizer_of(config)
        # Plain (non-special) tokens only, so a dummy stream ends by length, never by EOS.
        self.choices = np.array(
            [t for t in range(bundle.vocab_size) if t not in bundle.special_token_ids], np.int64
        )
        self.prompt_top_k: dict[int, int] = {}  # by handle: the requests with prompt_logprobs
        self.behind = Behind(config.block_size)

    def run(self) -> None:
        inbox, outbox = self.ctx.inbox["plan"], self.ctx.outbox["results"]
        while True:
            waited = now_ns()
            with inbox.recv() as message:
                received = now_ns()
                if message.name == plan.GRAMMARS.name:
                    # No model, no masks: every grammar is ready at once.
                    outbox.send(
                        results.MATCHERS, results.pack_matchers(message["handles"].tolist())
                    )
                    continue
                step = plan.unpack_step(message)
            for handle in step.free_handles.tolist():
                self.prompt_top_k.pop(handle, None)
                self.behind.forget(handle)
            for handle, rendered in step.new_requests:
                if rendered.sampling.prompt_logprobs is not None:
                    self.prompt_top_k[handle] = rendered.sampling.prompt_logprobs
            started = now_ns()
            depth = inbox.depth()
            seqs = step.seqs
            handles = seqs["handle"].astype(np.int64)
            count = len(handles)
            num_tokens, token_ids = self.tokens(step)
            entries = len(token_ids)
            result = results.StepResult(
                step_id=step.step_id,
                t_start_ns=started,
                t_end_ns=now_ns(),
                handles=handles,
                num_tokens=num_tokens,
                num_drafted=np.zeros(count, np.int32),
                token_ids=token_ids,
                logprobs=np.zeros(entries, np.float32),
                ranks=np.ones(entries, np.int64),
                top_ids=np.zeros((entries, 0), np.int64),
                top_logprobs=np.zeros((entries, 0), np.float32),
                prompt=self.prompt_logprobs(step) if self.prompt_top_k else PromptLogprobs.empty(),
            )
            finished = now_ns()  # the span ends where the hop to schedule begins, as execute's
            outbox.send(results.RESULT, results.pack_result(result))
            self.ctx.trace.record(
                spans.SPAN_FORWARD,
                started,
                finished,
                batch=count,
                tokens=count,
                wait_ns=received - waited,
                depth=depth,
                lead_ns=started - received,
                link=step.step_id,
            )

    def tokens(self, step: plan.PlannedStep) -> tuple[np.ndarray, np.ndarray]:
        """([B] entries per row, [N] tokens): the token at a position is a fixed function of it, so
        equal requests get equal outputs as with a model. Draft positions are dropped unfilled."""
        seqs = step.seqs
        context = seqs["context_len"].astype(np.int32)
        reserved = seqs["num_draft"]
        if reserved.any() or self.behind:
            handles = seqs["handle"].astype(np.int64)
            starts = step.query_start_loc
            positions = step.positions.astype(np.int64)
            self.behind.rebase(
                handles, starts, positions, step.slot_mapping, context, step.block_tables
            )
            for row in np.flatnonzero(reserved).tolist():
                self.behind.verified(
                    int(handles[row]), int(positions[starts[row]]), int(reserved[row]), 0
                )
            context = context - reserved
        picks = (context.astype(np.int64) * 104729) % len(self.choices)
        return np.ones(len(seqs), np.int32), np.where(seqs["sample"], self.choices[picks], -1)

    def prompt_logprobs(self, step: plan.PlannedStep) -> PromptLogprobs:
        """The null model is sure of every token it reads: each prompt token of this step's
        chunks (past the prompt's first) scores logprob 0 at rank 1, and is its own top-1 (the
        only token of finite logprob), as its sampled tokens do."""
        seqs = step.seqs
        rows = []
        for b, handle in enumerate(seqs["handle"].tolist()):
            if handle not in self.prompt_top_k:
                continue
            start, length = int(seqs["query_start"][b]), int(seqs["query_len"][b])
            positions = step.positions[start : start + length]  # [L] int32
            scored = (positions >= 1) & (positions < seqs["prompt_len"][b])
            chunk = np.zeros(int(scored.sum()), PROMPT_LOGPROB_ROW)
            chunk["handle"] = handle
            chunk["position"] = positions[scored]
            chunk["token_id"] = step.input_ids[start : start + length][scored]
            chunk["rank"] = 1
            rows.append(chunk)
        rows_all = np.concatenate(rows) if rows else np.zeros(0, PROMPT_LOGPROB_ROW)  # [P]
        width = 1 if any(self.prompt_top_k.get(h, 0) > 0 for h in rows_all["handle"]) else 0
        top_ids = np.repeat(rows_all["token_id"][:, None], width, axis=1)  # [P, width]
        return PromptLogprobs(rows_all, top_ids, np.zeros(top_ids.shape, np.float32))
