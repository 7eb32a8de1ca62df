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
                step = plan.unpack_step(message)
            started = now_ns()
            depth = inbox.depth()
            seqs = step.seqs
            handles = seqs["handle"].astype(np.int64)
            count = len(handles)
            # A fixed function of the position, so equal requests get equal outputs as with a model.
            picks = (seqs["context_len"].astype(np.int64) * 104729) % len(self.choices)
            result = results.StepResult(
                step_id=step.step_id,
                t_start_ns=started,
                t_end_ns=now_ns(),
                handles=handles,
                token_ids=np.where(seqs["sample"], self.choices[picks], -1),
                logprobs=np.zeros(count, np.float32),
                ranks=np.ones(count, np.int64),
                top_ids=np.zeros((count, 0), np.int64),
                top_logprobs=np.zeros((count, 0), np.float32),
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
