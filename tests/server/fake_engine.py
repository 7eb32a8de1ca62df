"""A deterministic EngineClient for the server tests: it echoes the words of the prompt.

Tokens are whitespace-separated words ("hello world" is two tokens, the second with text
" world"); ids come from a vocabulary that grows as words are seen. Generation replays the last
chat message (or the text prompt) word by word (through the request's output parsers) with an optional delay per token, honouring
max_tokens, stop strings and logprobs, and records requests and aborts.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field

from stages.api import (
    ChatPrompt,
    EngineError,
    GenerateRequest,
    ModelInfo,
    RenderedPromptInfo,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    TextPrompt,
    TokenLogprob,
    TokensPrompt,
)
from stages.text.parsers import OutputParser

FAIL_MIDSTREAM = "FAIL_MIDSTREAM"  # a prompt with this word fails after two tokens
BAD_TEMPLATE = "BAD_TEMPLATE"  # a chat message with this word fails to render
FIRST_WORD_ID = 10
MAX_MODEL_LEN = 64
VOCAB_SIZE = 1000


def _text(content: object) -> str:
    """A message's text, its content parts joined as the engine's string format joins them."""
    if isinstance(content, list):
        return "\n".join(part["text"] for part in content)
    return str(content or "")


def _word_finish(
    text_so_far: str,
    text: str,
    sampling: SamplingParams,
    num_words_out: int,  # this word's included
    max_tokens: int,
    num_words: int,  # in the whole reply
) -> tuple[str, str | None, str | None]:  # -> (the word's text to send, finish, stop string)
    """Whether the reply ends at this word: at the first stop string the output then holds (the
    text cut there, the stop string kept when the request includes it), at max_tokens, or at its
    last word."""
    full = text_so_far + text
    hit = next((s for s in sampling.stop if s in full), None)
    if hit is not None:
        cut = full.index(hit) + (len(hit) if sampling.include_stop_str_in_output else 0)
        return full[:cut][len(text_so_far) :], "stop", hit
    if num_words_out == max_tokens:
        return text, "length", None
    if num_words_out == num_words:
        return text, "stop", None
    return text, None, None


@dataclass
class FakeEngine:
    token_delay_s: float = 0.0
    ready: bool = True
    requests: list[GenerateRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    running: set[str] = field(default_factory=set)
    rendered: list[GenerateRequest] = field(default_factory=list)  # render-only requests
    prefix_cache_resets: int = 0
    cached_prompt_tokens: int = 0  # each request's prompt tokens its metrics call cached
    # Set an Event here and /tokenize holds its thread until the event is set, as a long text
    # does; `tokenizing` says one has started.
    tokenize_gate: threading.Event | None = None
    tokenizing: threading.Event = field(default_factory=threading.Event)
    tokenized: list[ChatPrompt | TextPrompt] = field(default_factory=list)  # /tokenize's prompts
    _ids: dict[str, int] = field(default_factory=dict)
    _words: dict[int, str] = field(default_factory=dict)

    @property
    def not_ready_error(self) -> EngineError:
        return EngineError(
            "the engine is not ready yet", 503, "ServiceUnavailableError", None, None, 5
        )

    @property
    def model_info(self) -> ModelInfo:
        return ModelInfo("fake-model", "/models/fake", MAX_MODEL_LEN, VOCAB_SIZE, 1_700_000_000)

    def word_id(self, word: str) -> int:
        if word not in self._ids:
            token_id = FIRST_WORD_ID + len(self._ids)
            self._ids[word] = token_id
            self._words[token_id] = word
        return self._ids[word]

    def tokenize(self, prompt: ChatPrompt | TextPrompt) -> list[int]:
        self.tokenized.append(prompt)
        self.tokenizing.set()
        if self.tokenize_gate is not None:
            self.tokenize_gate.wait(10)
        return self._token_ids(prompt)

    def _token_ids(self, prompt: ChatPrompt | TextPrompt) -> list[int]:
        return [self.word_id(word) for word in self._prompt_words(prompt)]

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return " ".join(self._words.get(token_id, f"<{token_id}>") for token_id in token_ids)

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        return [self._words.get(token_id, f"<{token_id}>") for token_id in token_ids]

    def tokenizer_info(self) -> dict[str, object]:
        return {"tokenizer_class": "FakeWordTokenizer", "model_max_length": MAX_MODEL_LEN}

    def stats(self) -> Mapping[str, float]:
        return {
            "vllm:num_requests_running": float(len(self.running)),
            "num_requests_waiting": 0.0,
            "kv_cache_usage_perc": 0.25,
        }

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def _prompt_words(self, prompt: ChatPrompt | TextPrompt) -> list[str]:
        if isinstance(prompt, TextPrompt):
            return prompt.text.split()
        words: list[str] = []
        for message in prompt.messages:
            if BAD_TEMPLATE in str(message.get("content")):
                raise EngineError("chat template error: bad message", param="messages")
            words += [f"{message['role']}:", *_text(message.get("content")).split()]
        if prompt.add_generation_prompt:
            words.append("assistant:")
        return words

    def _reply_words(self, request: GenerateRequest) -> list[str]:
        prompt = request.prompt
        if isinstance(prompt, ChatPrompt):
            return _text(prompt.messages[-1].get("content")).split()
        if isinstance(prompt, TextPrompt):
            return prompt.text.split()
        return self.detokenize(prompt.token_ids).split()

    def _logprob(self, token_id: int, text: str, index: int, top_n: int) -> TokenLogprob:
        logprob = -0.25 * (index + 1)
        alternatives = tuple(
            (VOCAB_SIZE - 1 - k, f"alt{k}", f"alt{k}".encode(), logprob - 1.0 - k)
            for k in range(max(top_n - 1, 0))
        )
        top = ((token_id, text, text.encode(), logprob), *alternatives)
        return TokenLogprob(token_id, text, text.encode(), logprob, 1, top[:top_n])

    def _prompt_logprobs(
        self, prompt_ids: list[int], top_n: int | None
    ) -> tuple[TokenLogprob | None, ...] | None:
        """Each prompt token's logprobs after the first (which has none), when asked for."""
        if top_n is None:
            return None
        return (
            None,
            *(
                self._logprob(t, " " + self._words.get(t, f"<{t}>"), i, top_n)
                for i, t in enumerate(prompt_ids[1:])
            ),
        )

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        return self._generate(request)

    def _render(self, request: GenerateRequest) -> tuple[list[int], int]:
        """(prompt ids, max_tokens resolved), as generation sees them; EngineError as it raises."""
        prompt = request.prompt
        if isinstance(prompt, TokensPrompt):
            prompt_ids = list(prompt.token_ids)
        else:
            prompt_ids = self._token_ids(prompt)
        if len(prompt_ids) >= MAX_MODEL_LEN:
            raise EngineError(
                f"This model's maximum context length is {MAX_MODEL_LEN} tokens; "
                f"the prompt has {len(prompt_ids)}",
                param="messages" if isinstance(prompt, ChatPrompt) else "prompt",
                code="context_length_exceeded",
            )
        return prompt_ids, request.sampling.max_tokens or (MAX_MODEL_LEN - len(prompt_ids))

    async def render(self, request: GenerateRequest) -> RenderedPromptInfo:
        self.rendered.append(request)
        prompt_ids, max_tokens = self._render(request)
        return RenderedPromptInfo(prompt_ids, self.detokenize(prompt_ids), max_tokens)

    async def reset_prefix_cache(self) -> None:
        if not self.ready:
            raise self.not_ready_error
        self.prefix_cache_resets += 1

    async def _generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        self.requests.append(request)
        prompt_ids, max_tokens = self._render(request)
        sampling = request.sampling
        words = self._reply_words(request)
        prompt_logprobs = self._prompt_logprobs(prompt_ids, sampling.prompt_logprobs)
        parser = None
        if request.reasoning_parser or request.tool_call_parser:
            # the detokenize stage's parsers, on the echoed words
            parser = OutputParser(request.reasoning_parser, request.tool_call_parser)
        start_ns = time.monotonic_ns()
        first_token_ns = 0
        text_so_far = ""
        self.running.add(request.request_id)
        done = False
        try:
            for index, word in enumerate(words[:max_tokens]):
                if word == FAIL_MIDSTREAM and index >= 2:
                    raise EngineError("engine failure", status=500, type="InternalServerError")
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                else:
                    await asyncio.sleep(0)
                first_token_ns = first_token_ns or time.monotonic_ns()
                text = word if index == 0 else " " + word
                token_id = self.word_id(word)
                text, finish, stop_reason = _word_finish(
                    text_so_far, text, sampling, index + 1, max_tokens, len(words)
                )
                text_so_far += text
                reasoning, calls = "", ()
                if parser is not None:
                    parsed = parser.feed(text, finish is not None)
                    text, reasoning, calls = parsed.content, parsed.reasoning, parsed.tool_calls
                logprobs = None
                if sampling.logprobs is not None:
                    logprobs = (self._logprob(token_id, text, index, sampling.logprobs),)
                metrics = None
                if finish is not None:
                    metrics = self._metrics(request, start_ns, first_token_ns, index + 1)
                    done = True
                    self.finished.append(request.request_id)
                yield RequestOutput(
                    request_id=request.request_id,
                    text=text,
                    token_ids=(token_id,),
                    prompt_token_ids=tuple(prompt_ids) if index == 0 else None,
                    num_prompt_tokens=len(prompt_ids),
                    num_output_tokens=index + 1,
                    finish_reason=finish,
                    stop_reason=stop_reason,
                    logprobs=logprobs,
                    prompt_logprobs=prompt_logprobs if index == 0 else None,
                    metrics=metrics,
                    reasoning=reasoning,
                    tool_calls=tuple(calls),
                    num_reasoning_tokens=0 if parser is None else parser.num_reasoning_tokens,
                )
                if finish is not None:
                    return
            done = True
            self.finished.append(request.request_id)
            yield RequestOutput(
                request_id=request.request_id,
                text="",
                token_ids=(),
                prompt_token_ids=tuple(prompt_ids),
                num_prompt_tokens=len(prompt_ids),
                num_output_tokens=0,
                finish_reason="stop",
                metrics=self._metrics(request, start_ns, start_ns, 0),
            )
        finally:
            self.running.discard(request.request_id)
            if not done:
                self.aborted.append(request.request_id)

    def _metrics(
        self, request: GenerateRequest, start_ns: int, first_token_ns: int, num_tokens: int
    ) -> RequestMetrics:
        # a queue of 1 ms, then a prefill and decode that take the rest, in that order
        scheduled_ns = start_ns + 1_000_000
        first_token_ns = max(first_token_ns, scheduled_ns)
        now_ns = max(time.monotonic_ns(), first_token_ns + num_tokens * 1_000)
        arrival_ns = request.arrival_ns or start_ns
        return RequestMetrics(
            arrival_ns=arrival_ns,
            render_start_ns=arrival_ns,
            rendered_ns=start_ns,
            scheduled_ns=scheduled_ns,
            first_token_ns=first_token_ns,
            last_token_ns=now_ns,
            finished_ns=now_ns,
            detokenize_ns=500_000,
            num_generated_tokens=num_tokens,
            spec_num_steps=2 if num_tokens > 2 else 0,
            spec_num_draft_tokens=4 if num_tokens > 2 else 0,
            spec_num_accepted_tokens=3 if num_tokens > 2 else 0,
            spec_acceptance_histogram=(0, 1, 1) if num_tokens > 2 else (),
            num_cached_prompt_tokens=self.cached_prompt_tokens,
        )
