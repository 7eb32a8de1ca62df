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
from stages import messages as m
from stages.config import EngineConfig, num_kv_blocks

if TYPE_CHECKING:
    from stages.structured import GrammarMatchers


class RequestParams:
    """The sampling row and id lists of one request, as execute keeps them."""

    __slots__ = (
        "allowed_ids",
        "bad_ids",
        "bad_words",
        "bias_ids",
        "bias_values",
        "sampling",
        "stop_ids",
    )

    def __init__(
        self,
        sampling: np.void,
        stop_ids: np.ndarray,
        bias_ids: np.ndarray,
        bias_values: np.ndarray,
        allowed_ids: np.ndarray,
        bad_words: np.ndarray,
    ) -> None:
        self.sampling = sampling
        self.stop_ids = stop_ids
        self.bias_ids = bias_ids
        self.bias_values = bias_values
        self.allowed_ids = allowed_ids
        # bad words of one token are banned outright; longer ones by the sampler, at their last
        # token, when the output ends with the rest
        words = _split_words(bad_words)
        self.bad_ids = np.array([w[0] for w in words if len(w) == 1], np.int32)
        self.bad_words = tuple(w for w in words if len(w) > 1) or None


def _padded(rows: list[np.ndarray], dtype: type, fill: float) -> np.ndarray:
    width = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), width), fill, dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


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
        self.params: dict[int, RequestParams] = {}
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
                batch, step_id, handles = self.read_plan(message)
            started = now_ns()
            cpu = time.process_time_ns()
            output = self.runner.step(batch)
            finished = now_ns()
            trace.record(
                m.SPAN_FORWARD,
                started,
                finished,
                batch=len(handles),
                tokens=len(batch.input_ids),
                wait_ns=started - waited,
                depth=depth,
                cpu_ns=time.process_time_ns() - cpu,
            )
            sampled = output.token_ids
            grammars = self.grammars if self.grammars is not None and len(self.grammars) else None
            for handle, token in zip(handles.tolist(), sampled.tolist(), strict=True):
                if token >= 0:
                    self.last_token[handle] = token
                    if grammars is not None:
                        grammars.consume(handle, token)
            top_k = output.top_ids.shape[1]
            prompt_rows = _prompt_rows(handles, output)
            outbox.send(
                m.RESULT,
                {
                    "meta": np.array(
                        [
                            step_id,
                            len(handles),
                            top_k,
                            started,
                            finished,
                            output.prompt_top_ids.shape[1],
                        ],
                        np.int64,
                    ),
                    "handles": handles,
                    "token_ids": sampled.astype(np.int64),
                    "logprobs": output.logprobs.astype(np.float32),
                    "ranks": output.ranks.astype(np.int64),
                    "top_ids": output.top_ids.astype(np.int64).ravel(),
                    "top_logprobs": output.top_logprobs.astype(np.float32).ravel(),
                    "prompt_rows": prompt_rows,
                    "prompt_top_ids": output.prompt_top_ids.astype(np.int64).ravel(),
                    "prompt_top_logprobs": output.prompt_top_logprobs.astype(np.float32).ravel(),
                },
            )
            self.ctx.heartbeat()

    def read_plan(self, message):  # type: ignore[no-untyped-def]
        from gpu.runner import StepBatch
        from gpu.sampler import SamplingArrays

        meta = message["meta"].tolist()
        step_id, count, width = meta[0], meta[1], meta[2]
        for handle in message["free_handles"].tolist():
            self.params.pop(handle, None)
            self.last_token.pop(handle, None)
            self.with_bad_words.discard(handle)
            if self.grammars is not None:
                self.grammars.drop(handle)
        if len(message["free_handles"]):
            self.runner.free(message["free_handles"].copy())
        offsets = message["new_id_offsets"].tolist()
        ids, bias_values = message["new_ids"], message["new_bias_values"]
        bias_cursor = 0
        grammar_offsets = message["new_grammar_offsets"].tolist()
        for i, handle in enumerate(message["new_handles"].tolist()):
            stop, bias, allowed, bad_words = (
                ids[offsets[4 * i + k] : offsets[4 * i + k + 1]].copy() for k in range(4)
            )
            values = bias_values[bias_cursor : bias_cursor + len(bias)].copy()
            bias_cursor += len(bias)
            self.params[handle] = RequestParams(
                message["new_sampling"][i].copy(), stop, bias, values, allowed, bad_words
            )
            if len(bad_words):
                self.with_bad_words.add(handle)
            start, end = grammar_offsets[i], grammar_offsets[i + 1]
            if end > start:
                if self.grammars is None:
                    self.grammars = _grammar_matchers(self.ctx.config.model_path)
                self.grammars.add(handle, message["new_grammars"][start:end].tobytes().decode())
        seqs = message["seqs"].copy()
        handles = seqs["handle"].astype(np.int64)
        input_ids = message["input_ids"].astype(np.int64)
        positions = message["positions"].astype(np.int64)
        unknown = np.nonzero(input_ids < 0)[0]
        if len(unknown):
            owner = np.searchsorted(seqs["query_start"], unknown, side="right") - 1
            input_ids[unknown] = [self.last_token[int(h)] for h in handles[owner]]
        params = [self.params[int(h)] for h in handles.tolist()]
        rows = np.array([p.sampling for p in params], m.SAMPLING_ROW)
        sampling = SamplingArrays(
            temperature=rows["temperature"],
            top_p=rows["top_p"],
            top_k=rows["top_k"],
            min_p=rows["min_p"],
            presence_penalty=rows["presence_penalty"],
            frequency_penalty=rows["frequency_penalty"],
            repetition_penalty=rows["repetition_penalty"],
            seed=rows["seed"],
            min_tokens=rows["min_tokens"],
            num_logprobs=rows["num_logprobs"],
            logit_bias_ids=_padded([p.bias_ids for p in params], np.int32, -1),
            logit_bias_values=_padded([p.bias_values for p in params], np.float32, 0.0),
            allowed_token_ids=_padded([p.allowed_ids for p in params], np.int32, -1),
            bad_token_ids=_padded([p.bad_ids for p in params], np.int32, -1)
            if self.with_bad_words
            else np.zeros((count, 0), np.int32),
            bad_words=_bad_words(params) if self.with_bad_words else np.empty(count, object),
            stop_token_ids=_padded([p.stop_ids for p in params], np.int32, -1),
            token_bitmask=self.grammars.masks(handles.tolist(), seqs["sample"].tolist())
            if self.grammars is not None and len(self.grammars)
            else np.zeros((count, 0), np.int32),
        )
        query_start_loc = np.append(
            seqs["query_start"], seqs["query_start"][-1] + seqs["query_len"][-1]
        )
        batch = StepBatch(
            request_ids=handles,
            input_ids=input_ids,
            positions=positions,
            query_start_loc=query_start_loc.astype(np.int32),
            context_lens=seqs["context_len"].astype(np.int32),
            block_tables=message["block_tables"].reshape(count, width).copy(),
            slot_mapping=message["slot_mapping"].copy(),
            prompt_lens=seqs["prompt_len"].astype(np.int32),
            sample=seqs["sample"].astype(bool),
            sampling=sampling,
            prompt_logprobs=rows["prompt_logprobs"],
        )
        return batch, step_id, handles


def _split_words(flat: np.ndarray) -> list[tuple[int, ...]]:
    """-1-delimited token sequences -> tuples."""
    words, current = [], []
    for token in flat.tolist():
        if token < 0:
            words.append(tuple(current))
            current = []
        else:
            current.append(token)
    return [w for w in words if w]


def _bad_words(params: list[RequestParams]) -> np.ndarray:
    """[S] object: each row's multi-token bad words (None for none)."""
    out = np.empty(len(params), object)
    for row, p in enumerate(params):
        if p.bad_words is not None:
            out[row] = p.bad_words
    return out


def _grammar_matchers(model_path: str) -> GrammarMatchers:
    """The matchers of structured-output requests, over the model's vocabulary."""
    from gpu.config import load_model_config
    from gpu.tokenizer import load_tokenizer
    from stages.structured import GrammarMatchers

    bundle = load_tokenizer(model_path)
    vocab_size = max(load_model_config(model_path).vocab_size, bundle.vocab_size)
    return GrammarMatchers(bundle.tokenizer.to_str(), vocab_size, bundle.eos_token_ids)


def _prompt_rows(handles: np.ndarray, output) -> np.ndarray:  # type: ignore[no-untyped-def]
    """The step's prompt logprobs as rows, each tagged with its request's handle."""
    rows = np.zeros(len(output.prompt_positions), m.PROMPT_LOGPROB_ROW)
    if len(rows):
        rows["handle"] = np.repeat(handles, np.diff(output.prompt_logprob_start_loc))
        rows["position"] = output.prompt_positions
        rows["token_id"] = output.prompt_token_ids
        rows["logprob"] = output.prompt_token_logprobs
        rows["rank"] = output.prompt_ranks
    return rows
