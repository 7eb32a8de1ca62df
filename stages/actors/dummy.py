"""A null model for the execute stage: deterministic tokens, no compute.

With it the pipeline and the HTTP front end run at their own ceiling, which is what
`pipeline-serve dummy` and `pipeline-bench` measure to separate the engine's overhead from the model.
"""

from __future__ import annotations

import numpy as np

from pipeline.actor import SyncActor
from pipeline.clock import now_ns
from stages import spans
from stages.config import EngineConfig
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
        equal requests get equal outputs as with a model; drafts are verified against it."""
        seqs = step.seqs
        if not seqs["num_draft"].any():
            picks = (seqs["context_len"].astype(np.int64) * 104729) % len(self.choices)
            return np.ones(len(seqs), np.int32), np.where(seqs["sample"], self.choices[picks], -1)
        counts, out = [], []
        ends = (seqs["query_start"] + seqs["query_len"]).tolist()
        for row, (context, drafts, sample) in enumerate(
            zip(
                seqs["context_len"].tolist(),
                seqs["num_draft"].tolist(),
                seqs["sample"].tolist(),
                strict=True,
            )
        ):
            if not sample:
                counts.append(1)
                out.append(-1)
                continue
            proposed = step.input_ids[ends[row] - drafts : ends[row]].tolist()
            emitted = 0
            for j in range(drafts + 1):
                token = int(self.choices[((context - drafts + j) * 104729) % len(self.choices)])
                out.append(token)
                emitted += 1
                if j == drafts or token != proposed[j]:
                    break
            counts.append(emitted)
        return np.array(counts, np.int32), np.array(out, np.int64)

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
