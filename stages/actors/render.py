"""The render stage: chat template, tokenization and prompt-length checks; one request at a time.

A request that cannot be rendered becomes an `error` record back to the server (a clear 400) and
never reaches the scheduler. Aborts pass through in order, so an abort never overtakes its request.
"""

from __future__ import annotations

import numpy as np

from pipeline.actor import AsyncActor
from pipeline.clock import now_ns
from stages import spans
from stages.api import EngineError, GenerateRequest
from stages.config import EngineConfig, resolve_max_model_len
from stages.rings import common, prompts, requests
from stages.rings.common import Resume, encoder
from stages.rings.prompts import RenderedPrompt, RenderedRequest
from stages.rings.tokens import DetokParams
from stages.text.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS, prompt_opens_reasoning
from stages.text.prompts import bad_word_ids, check_lengths, prompt_token_ids
from stages.text.snapshot import tokenizer_of
from stages.text.structured import compile_grammar


class RenderActor(AsyncActor):
    def warm_up(self) -> None:
        config: EngineConfig = self.ctx.config
        self.bundle = tokenizer_of(config)
        self.max_model_len = resolve_max_model_len(config)
        self.eos_ids = tuple(self.bundle.eos_token_ids)

    async def run(self) -> None:
        inbox = self.ctx.inbox["requests"]
        outbox, errors = self.ctx.outbox["prompts"], self.ctx.outbox["errors"]
        while True:
            message = await inbox.recv_async()
            with message:
                if message.name == common.ABORT.name:
                    aborted, request = common.unpack_abort(message), None
                else:
                    aborted, (handle, request, resume) = None, requests.unpack_submit(message)
            if request is not None:
                started = now_ns()
                try:
                    prompt: RenderedPrompt | EngineError = self.render(
                        handle, request, started, resume
                    )
                except Exception as exc:
                    prompt = self.refusal(handle, exc)
            if aborted is not None:
                await outbox.send_async(common.ABORT, common.pack_abort(aborted))
            elif isinstance(prompt, EngineError):
                await errors.send_async(requests.ERROR, requests.pack_error(handle, prompt))
            else:
                await outbox.send_async(prompts.PROMPT, prompts.pack_prompt(prompt))
                self.ctx.trace.record(
                    spans.SPAN_RENDER, started, now_ns(), batch=1, tokens=len(prompt.prompt_ids)
                )

    def refusal(self, handle: int, exc: Exception) -> EngineError:
        if isinstance(exc, EngineError):
            return exc
        # Whatever a request does to the tokenizer or template, the stage keeps serving.
        self.ctx.log.exception("render failed", handle=handle)
        return EngineError(f"could not render the prompt: {exc}", param="messages")

    def render(
        self,
        handle: int,
        request: GenerateRequest,
        started_ns: int,
        resume: Resume | None = None,
    ) -> RenderedPrompt:
        s = request.sampling
        if request.reasoning_parser not in (None, *REASONING_PARSERS):
            raise EngineError(f"unknown reasoning parser {request.reasoning_parser!r}")
        if request.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise EngineError(f"unknown tool-call parser {request.tool_call_parser!r}")
        ids = prompt_token_ids(self.bundle, request.prompt)
        if s.truncate_prompt_tokens is not None:
            # vLLM's truncation: the prompt's last k tokens (-1: as many as the model takes)
            keep = s.truncate_prompt_tokens
            if keep < 0:  # what leaves room for max_tokens (or for one token)
                keep = max(1, self.max_model_len - (s.max_tokens or 1))
            ids = ids[-keep:]
        max_tokens = check_lengths(len(ids), s.max_tokens, self.max_model_len)
        for token in (*(s.logit_bias or {}), *(s.allowed_token_ids or ()), *s.stop_token_ids):
            if not 0 <= token < self.bundle.vocab_size:
                raise EngineError(f"token id {token} is out of vocabulary", param="logit_bias")
        rendered = RenderedRequest(
            sampling=s,
            max_tokens=max_tokens,
            stop_token_ids=s.stop_token_ids + (() if s.ignore_eos else self.eos_ids),
            bad_words=bad_word_ids(self.bundle, s.bad_words),
            grammar="" if s.structured is None else compile_grammar(s.structured),
            resume=resume,
        )
        detok = DetokParams(
            stop=s.stop,
            include_stop_str_in_output=s.include_stop_str_in_output,
            # Tool-call markup is often special tokens (Qwen's <tool_call>): keep it for the parser,
            # as vLLM's tool parsers do.
            skip_special_tokens=s.skip_special_tokens and request.tool_call_parser is None,
            num_logprobs=-1 if s.logprobs is None else s.logprobs,
            num_prompt_logprobs=-1 if s.prompt_logprobs is None else s.prompt_logprobs,
            reasoning_parser=request.reasoning_parser,
            tool_call_parser=request.tool_call_parser,
            reasoning_starts_inside=request.reasoning_parser is not None
            and prompt_opens_reasoning(self.bundle.decode(ids[-8:]), request.reasoning_parser),
            replay_ids=() if resume is None else resume.output_ids,
        )
        return RenderedPrompt(
            handle=handle,
            priority=request.priority,
            arrival_ns=request.arrival_ns,
            render_start_ns=started_ns,
            rendered_ns=now_ns(),
            prompt_ids=np.asarray(ids, np.int32),
            rendered=encoder.encode(rendered),
            detok=encoder.encode(detok),
        )
