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
from stages.rings.common import PromptLogprobs
from stages.text.snapshot import tokenizer_of


class DummyExecuteActor(SyncActor):
    def warm_up(self) -> None:
        config: EngineConfig = self.ctx.config
        bundle = tokenizer_of(config)
        # Plain (non-special) tokens only, so a dummy stream ends by length, never by EOS.
        self.choices = np.array(
            [t for t in range(bundle.vocab_size) if t not in bundle.special_token_ids], np.int64
        )

    def run(self) -> None:
        inbox, outbox = self.ctx.inbox["plan"], self.ctx.outbox["results"]
        while True:
            waited = now_ns()
            with inbox.recv() as message:
                if message.name == plan.GRAMMARS.name:
                    # No model, no masks: every grammar is ready at once.
                    outbox.send(
                        results.MATCHERS, results.pack_matchers(message["handles"].tolist())
                    )
                    continue
                step = plan.unpack_step(message)
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
                prompt=PromptLogprobs.empty(),
            )
            outbox.send(results.RESULT, results.pack_result(result))
            self.ctx.trace.record(
                spans.SPAN_FORWARD,
                started,
                now_ns(),
                batch=count,
                tokens=count,
                wait_ns=started - waited,
                depth=depth,
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
