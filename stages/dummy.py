"""A null model for the execute stage: deterministic tokens, no compute.

With it the pipeline and the HTTP front end run at their own ceiling, which is what
`pipeline-serve dummy` and `pipeline-bench` measure to separate the engine's overhead from the model.
"""

from __future__ import annotations

import numpy as np

from gpu.tokenizer import load_tokenizer
from pipeline.actor import SyncActor
from pipeline.clock import now_ns
from stages import messages as m
from stages.config import EngineConfig


class DummyExecuteActor(SyncActor):
    def warm_up(self) -> None:
        config: EngineConfig = self.ctx.config
        bundle = load_tokenizer(config.model_path)
        # Plain (non-special) tokens only, so a dummy stream ends by length, never by EOS.
        self.choices = np.array(
            [t for t in range(bundle.vocab_size) if t not in bundle.special_token_ids], np.int64
        )

    def run(self) -> None:
        inbox, outbox = self.ctx.inbox["plan"], self.ctx.outbox["results"]
        while True:
            waited = now_ns()
            with inbox.recv() as message:
                step_id = int(message["meta"][0])
                seqs = message["seqs"]
                handles = seqs["handle"].astype(np.int64)
                sample = seqs["sample"].copy()
                positions = (seqs["context_len"]).astype(np.int64)
            started = now_ns()
            depth = inbox.depth()
            # A fixed function of the position, so equal requests get equal outputs as with a model.
            picks = (positions * 104729) % len(self.choices)
            tokens = np.where(sample, self.choices[picks], -1)
            count = len(handles)
            outbox.send(
                m.RESULT,
                {
                    "meta": np.array([step_id, count, 0, started, now_ns(), 0], np.int64),
                    "handles": handles,
                    "token_ids": tokens,
                    "logprobs": np.zeros(count, np.float32),
                    "ranks": np.ones(count, np.int64),
                    "top_ids": np.zeros(0, np.int64),
                    "top_logprobs": np.zeros(0, np.float32),
                    "prompt_rows": np.zeros(0, m.PROMPT_LOGPROB_ROW),
                    "prompt_top_ids": np.zeros(0, np.int64),
                    "prompt_top_logprobs": np.zeros(0, np.float32),
                },
            )
            self.ctx.trace.record(
                m.SPAN_FORWARD,
                started,
                now_ns(),
                batch=count,
                tokens=count,
                wait_ns=started - waited,
                depth=depth,
            )
