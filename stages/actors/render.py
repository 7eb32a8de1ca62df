"""The render stage: chat template, tokenization, prompt-length checks and grammar compilation.

A request that cannot be rendered becomes an `error` record back to the server (a clear 400) and
never reaches the scheduler. A request whose rendering may take long (a grammar to compile, a
prompt of more than INLINE_PROMPT_CHARS, a template of its own, which renders in a child process
with a time and a memory limit: stages.text.template_sandbox) renders in a worker thread, and is
sent on when it is done, while the requests behind it go on as before; the rest render on the loop, in order. Aborts
pass through in order, so an abort never overtakes its request (one still rendering is dropped),
and so do prefix-cache resets. A render-only request (the /render endpoints) renders the same way
and its result goes back to the server on `errors` instead of on to schedule.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Sequence

import anyio
import anyio.to_thread
import numpy as np

from pipeline.actor import AsyncActor
from pipeline.clock import now_ns
from stages import spans
from stages.api import ChatPrompt, EngineError, GenerateRequest
from stages.config import EngineConfig, resolve_max_model_len
from stages.rings import common, prompts, requests
from stages.rings.common import Resume, encoder
from stages.rings.prompts import RenderedPrompt, RenderedRequest
from stages.rings.tokens import DetokParams
from stages.text.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS, prompt_opens_reasoning
from stages.text.prompts import (
    LengthBound,
    bad_word_ids,
    check_lengths,
    prompt_size,
    prompt_token_ids,
    truncate,
)
from stages.text.snapshot import tokenizer_of
from stages.text.structured import GRAMMAR_STACK_BYTES, compile_grammar
from stages.text.template_sandbox import TemplateSandbox
from stages.text.thinking import ThinkingBudget, last_index
from stages.text.tokenizer import TokenizerBundle

INLINE_PROMPT_CHARS = 32 * 1024  # about 8k tokens: milliseconds to template and tokenize
RENDER_THREADS = 2


class RenderActor(AsyncActor):
    def warm_up(self) -> None:
        config: EngineConfig = self.ctx.config
        self.bundle = tokenizer_of(config)
        self.max_model_len = resolve_max_model_len(config)
        self.length_bound = LengthBound.of(self.bundle, self.max_model_len)
        # requests' own templates: children started at the first, killed past their limits
        self.sandbox = TemplateSandbox(
            config.chat_template_timeout_s, config.chat_template_memory_bytes
        )
        self.eos_ids = tuple(self.bundle.eos_token_ids)
        # The worker threads, started later, can compile any grammar compile_grammar lets by.
        threading.stack_size(GRAMMAR_STACK_BYTES)
        self.in_workers: set[int] = set()  # handles rendering in a worker thread
        self.dropped: set[int] = set()  # of those, the ones aborted meanwhile
        self.sending = asyncio.Lock()  # one message at a time on each ring, in a fixed order

    async def run(self) -> None:
        inbox = self.ctx.inbox["requests"]
        workers = anyio.CapacityLimiter(RENDER_THREADS)
        async with asyncio.TaskGroup() as off_loop:
            while True:
                message = await inbox.recv_async()
                with message:
                    kind = message.name
                    if kind == common.ABORT.name:
                        handles = common.unpack_abort(message)
                    elif kind == common.RESET_PREFIX_CACHE.name:
                        reset_id = common.unpack_reset_prefix_cache(message)
                    elif kind == requests.RENDER.name:
                        (handle, request), resume = requests.unpack_render(message), None
                    else:
                        handle, request, resume = requests.unpack_submit(message)
                if kind == common.ABORT.name:
                    await self.forward_abort(handles)
                    continue
                if kind == common.RESET_PREFIX_CACHE.name:
                    await self.forward_reset(reset_id)
                    continue
                # A render-only request is answered to the server; a real one goes to schedule.
                deliver = self.answer if kind == requests.RENDER.name else self.deliver
                if _slow_to_render(request):
                    self.in_workers.add(handle)
                    off_loop.create_task(
                        self.render_in_worker(workers, handle, request, resume, deliver)
                    )
                else:
                    await deliver(handle, self.attempt(handle, request, resume))

    def attempt(
        self, handle: int, request: GenerateRequest, resume: Resume | None
    ) -> RenderedPrompt | EngineError:
        try:
            return self.render(handle, request, now_ns(), resume)
        except Exception as exc:
            return self.refusal(handle, exc)

    async def render_in_worker(
        self,
        workers: anyio.CapacityLimiter,
        handle: int,
        request: GenerateRequest,
        resume: Resume | None,
        deliver: Callable[[int, RenderedPrompt | EngineError], Awaitable[None]],
    ) -> None:
        try:
            prompt = await anyio.to_thread.run_sync(
                self.attempt, handle, request, resume, limiter=workers
            )
            await deliver(handle, prompt)
        finally:
            self.in_workers.discard(handle)
            self.dropped.discard(handle)

    async def deliver(self, handle: int, prompt: RenderedPrompt | EngineError) -> None:
        async with self.sending:
            if handle in self.dropped:  # aborted while it rendered: schedule never hears of it
                return
            if isinstance(prompt, EngineError):
                await self.ctx.outbox["errors"].send_async(
                    requests.ERROR, requests.pack_error(handle, prompt)
                )
                return
            await self.ctx.outbox["prompts"].send_async(prompts.PROMPT, prompts.pack_prompt(prompt))
            self.ctx.trace.record(
                spans.SPAN_RENDER,
                prompt.render_start_ns,
                now_ns(),
                batch=1,
                tokens=len(prompt.prompt_ids),
            )

    async def answer(self, handle: int, prompt: RenderedPrompt | EngineError) -> None:
        """A render-only request's result, back to the server."""
        if isinstance(prompt, EngineError):
            arrays = requests.pack_error(handle, prompt)
        else:
            max_tokens = prompts.rendered_decoder.decode(prompt.rendered).max_tokens
            # Decoding grows with the prompt: off the loop (render-only requests are rare).
            text = await anyio.to_thread.run_sync(self.bundle.decode, prompt.prompt_ids.tolist())
            arrays = requests.pack_rendered(handle, prompt.prompt_ids, max_tokens, text)
        async with self.sending:
            record = requests.ERROR if isinstance(prompt, EngineError) else requests.RENDERED
            await self.ctx.outbox["errors"].send_async(record, arrays)

    async def forward_abort(self, handles: list[int]) -> None:
        async with self.sending:
            self.dropped.update(h for h in handles if h in self.in_workers)
            await self.ctx.outbox["prompts"].send_async(common.ABORT, common.pack_abort(handles))

    async def forward_reset(self, reset_id: int) -> None:
        async with self.sending:
            await self.ctx.outbox["prompts"].send_async(
                common.RESET_PREFIX_CACHE, common.pack_reset_prefix_cache(reset_id)
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
        # Truncation keeps k tokens of a prompt of any length; otherwise what cannot fit is
        # refused before it is tokenized.
        bound = self.length_bound if s.truncate_prompt_tokens is None else None
        ids = prompt_token_ids(
            self.bundle,
            request.prompt,
            bound,
            self.ctx.config.chat_template_content_format,
            self.sandbox,
        )
        if s.truncate_prompt_tokens is not None:
            # vLLM's truncation: k of the prompt's tokens (-1: as many as the model takes)
            keep = s.truncate_prompt_tokens
            if keep < 0:  # what leaves room for max_tokens (or for one token)
                keep = max(1, self.max_model_len - (s.max_tokens or 1))
            ids = truncate(ids, keep, s.truncation_side)
        config = self.ctx.config
        given = (*(s.logit_bias or {}), *(s.allowed_token_ids or ()), *(s.logprob_token_ids or ()))
        for token in (*given, *s.stop_token_ids):
            if not 0 <= token < self.bundle.vocab_size:
                raise EngineError(f"token id {token} is out of vocabulary", param="logit_bias")
        rendered = RenderedRequest(
            sampling=s,
            max_tokens=self.max_tokens(s.max_tokens, len(ids)),
            stop_token_ids=s.stop_token_ids + (() if s.ignore_eos else self.eos_ids),
            bad_words=bad_word_ids(self.bundle, s.bad_words),
            grammar="" if s.structured is None else compile_grammar(s.structured),
            resume=resume,
            cache_salt=request.cache_salt,
            thinking=self.thinking_budget(request, ids),
            lora=request.lora,
            grammar_after=grammar_after(request, ids, self.bundle, config),
        )
        detok = DetokParams(
            stop=s.stop,
            include_stop_str_in_output=s.include_stop_str_in_output,
            # Tool-call markup is often special tokens (Qwen's <tool_call>): keep it for the parser,
            # as vLLM's tool parsers do.
            skip_special_tokens=s.skip_special_tokens and request.tool_call_parser is None,
            # Only the client's own choice to keep special tokens sets them apart with spaces.
            spaces_between_special_tokens=s.spaces_between_special_tokens
            and not s.skip_special_tokens,
            num_logprobs=-1 if s.logprobs is None else s.logprobs,
            num_prompt_logprobs=-1 if s.prompt_logprobs is None else s.prompt_logprobs,
            reasoning_parser=request.reasoning_parser,
            tool_call_parser=request.tool_call_parser,
            reasoning_starts_inside=request.reasoning_parser is not None
            and prompt_opens_reasoning(self.bundle.decode(ids[-8:]), request.reasoning_parser),
            replay_ids=() if resume is None else resume.output_ids,
            prompt_token_ids=tuple(ids)
            if request.return_prompt_token_ids and resume is None
            else (),
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

    def max_tokens(self, asked: int | None, num_prompt_tokens: int) -> int:
        """The request's max_tokens against the room its prompt leaves; with none asked, the
        generation config's default within it (as vLLM caps it); and the server's cap."""
        max_tokens = check_lengths(num_prompt_tokens, asked, self.max_model_len)
        config: EngineConfig = self.ctx.config
        if asked is None and config.default_max_tokens is not None:
            max_tokens = min(max_tokens, config.default_max_tokens)
        if config.max_tokens_cap is not None:
            max_tokens = min(max_tokens, config.max_tokens_cap)
        return max_tokens

    def thinking_budget(self, request: GenerateRequest, ids: list[int]) -> ThinkingBudget | None:
        return thinking_budget(request, ids, self.bundle, self.ctx.config)


def thinking_budget(
    request: GenerateRequest, ids: Sequence[int], bundle: TokenizerBundle, config: EngineConfig
) -> ThinkingBudget | None:
    """The request's thinking_token_budget with its think tags as tokens (vLLM's rule: the
    open and forced texts of --reasoning-config, else the reasoning parser's tags; the model
    ends its thinking itself with the parser's close tag, else with the forced text)."""
    budget = request.sampling.thinking_token_budget
    if budget is None:
        return None
    parser = request.reasoning_parser
    tags = REASONING_PARSERS[parser] if parser is not None else None
    start = config.reasoning_start_str or (tags.start if tags else "")
    forced = config.reasoning_end_str or (tags.end if tags else "")
    if not start or not forced:
        raise EngineError(
            "thinking_token_budget needs the tags that mark the thinking: a reasoning parser "
            "(--reasoning-parser) or --reasoning-config's reasoning_start_str and "
            "reasoning_end_str",
            param="thinking_token_budget",
        )
    if request.sampling.structured is not None and config.structured_outputs_in_reasoning:
        # the grammar holds from the first token, so it would refuse the close tag
        raise EngineError(
            "thinking_token_budget cannot be combined with structured outputs under "
            "--structured-outputs-config enable_in_reasoning true",
            param="thinking_token_budget",
        )
    return ThinkingBudget.of(
        budget,
        bundle.encode(start, add_bos=False),
        bundle.encode(tags.end if tags else forced, add_bos=False),
        ids,
        tags is not None and tags.starts_inside,
        bundle.encode(forced, add_bos=False),
    )


def grammar_after(
    request: GenerateRequest, ids: Sequence[int], bundle: TokenizerBundle, config: EngineConfig
) -> tuple[int, ...]:
    """The reasoning parser's close tag as tokens when a constrained request reasons first
    (vLLM's rule, enable_in_reasoning false: the grammar holds once the reasoning has ended,
    which a prompt whose last think tag is the close tag has already); () otherwise."""
    parser = request.reasoning_parser
    if request.sampling.structured is None or parser is None:
        return ()
    if config.structured_outputs_in_reasoning:
        return ()
    tags = REASONING_PARSERS[parser]
    start = bundle.encode(tags.start, add_bos=False)
    end = bundle.encode(tags.end, add_bos=False)
    if last_index(ids, end) > last_index(ids, start):
        return ()
    return tuple(end)


def _slow_to_render(request: GenerateRequest) -> bool:
    """Whether rendering may take longer than a normal request's: a grammar to compile (up to
    seconds), a long prompt to template and tokenize, or a template of the request's own (up to
    --chat-template-timeout, in the sandbox)."""
    prompt = request.prompt
    return (
        request.sampling.structured is not None
        or prompt_size(prompt) > INLINE_PROMPT_CHARS
        or (isinstance(prompt, ChatPrompt) and prompt.chat_template is not None)
    )
