"""The engine as the server process sees it: it supervises the four stages and speaks to them over
rings. It implements `stages.api.EngineClient`.

The server process owns three ring ends: it writes requests and aborts to render, and reads render's
errors and detokenize's deltas. `Engine` is built in layers, one file each: what it holds
(stages/engine_state.py), its ring readers (stages/engine_readers.py), its lifecycle and recovery
from stage failures (stages/engine_lifecycle.py), and here the client API the server calls.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import numpy as np

from pipeline.clock import now_ns, process_cpu_s
from pipeline.errors import ActorFailed, RuntimeFault
from stages import spans
from stages.api import (
    ChatPrompt,
    EngineError,
    GenerateRequest,
    ModelInfo,
    RenderedPromptInfo,
    RequestOutput,
    TextPrompt,
)
from stages.config import EngineConfig
from stages.engine_lifecycle import EngineLifecycle
from stages.engine_readers import next_output
from stages.engine_state import Flight
from stages.lora import LoraError, read_adapter
from stages.published import lora_requests_info
from stages.rings import common, requests
from stages.rings.gauges import unpack_gauges
from stages.text.checkpoint import resolve_kv_cache_dtype
from stages.text.prompts import prompt_token_ids

# Retry-After of a 429: a place frees about as often as a request finishes.
OVERLOAD_RETRY_AFTER_S = 1.0


class Engine(EngineLifecycle):
    """Supervises the pipeline and serves requests through it."""

    @property
    def model_info(self) -> ModelInfo:
        return self._info

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def failure(self) -> ActorFailed | None:
        """The stage failure the pipeline is down for (restarting, or given up); None while up."""
        return self._failure

    @property
    def num_in_flight(self) -> int:
        """Requests sent and not yet finished or aborted."""
        return len(self._flights)

    @property
    def num_waiting(self) -> int:
        """Requests in flight beyond what the scheduler can run at once."""
        return max(0, len(self._flights) - self.config.max_num_seqs)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        if not self._ready:
            raise self.not_ready_error
        if len(self._flights) >= self.max_in_flight:
            self.num_rejected += 1
            raise EngineError(
                f"the server is overloaded: {self.num_waiting} requests are already waiting "
                f"(--max-waiting-requests {self.max_waiting}); retry later",
                429,
                "RateLimitError",
                retry_after_s=OVERLOAD_RETRY_AFTER_S,
            )
        handle = next(self._handles)
        queue: asyncio.Queue[RequestOutput | EngineError] = asyncio.Queue()
        flight = Flight(request, queue)
        self._flights[handle] = flight
        finished = False
        try:
            arrays = requests.pack_submit(handle, request)
            async with self._send_lock:
                if not flight.submitted:  # a recovery may have sent it already
                    flight.submitted = True
                    # A pipeline that fails now leaves the request to the recovery's resubmission.
                    with contextlib.suppress(RuntimeFault):
                        await self.supervisor.producers["requests"].send_async(
                            requests.SUBMIT, arrays
                        )
            interval = max(self.config.stream_interval, request.stream_interval or 1)
            gather = 0  # the first token goes at once; then outputs of `interval` tokens
            while True:
                item = await next_output(flight, gather)
                if isinstance(item, EngineError):
                    finished = True
                    raise item
                if item.token_ids:
                    gather = interval
                finished = item.finish_reason is not None
                try:
                    yield item
                finally:  # asked for the next, or closed: the chunk it became has been written
                    self._delivered(item)
                if finished:
                    return
        finally:
            if self._flights.pop(handle, None) is flight and flight.failures_without_progress:
                self._probe_wake.set()
            if not finished:
                self._aborts.put_nowait(handle)

    async def abort(self, request_id: str) -> None:
        for handle, flight in list(self._flights.items()):
            if flight.request.request_id == request_id:
                del self._flights[handle]
                self._aborts.put_nowait(handle)
                self._probe_wake.set()
                flight.queue.put_nowait(EngineError("aborted", status=499, type="Aborted"))

    async def render(self, request: GenerateRequest) -> RenderedPromptInfo:
        """Render runs the request through the path a generation takes (template, truncation,
        length checks, grammar) and answers on `errors` instead of sending it to schedule."""
        if not self._ready:
            raise self.not_ready_error
        handle = next(self._handles)
        future: asyncio.Future[RenderedPromptInfo] = asyncio.get_running_loop().create_future()
        self._renders[handle] = future
        try:
            async with self._send_lock:
                await self.supervisor.producers["requests"].send_async(
                    requests.RENDER, requests.pack_render(handle, request)
                )
            return await future
        except RuntimeFault:
            raise self.not_ready_error from None
        finally:
            self._renders.pop(handle, None)

    async def reset_prefix_cache(self) -> None:
        """Sent in order with the requests: schedule drops the cached prefixes before it sees any
        request sent after this returns. A pipeline that fails meanwhile starts with an empty
        cache, which is as good."""
        if not self._ready:
            raise self.not_ready_error
        self._num_resets += 1
        with contextlib.suppress(RuntimeFault):
            async with self._send_lock:
                await self.supervisor.producers["requests"].send_async(
                    common.RESET_PREFIX_CACHE, common.pack_reset_prefix_cache(self._num_resets)
                )

    def check_lora(self, path: str) -> None:
        if self.config.lora is None:
            raise EngineError("LoRA is not enabled: start the server with --enable-lora")
        try:
            read_adapter(path, self._model_config, self.config.lora.max_lora_rank)
        except LoraError as error:
            raise EngineError(
                str(error),
                status=404 if error.not_found else 400,
                type="NotFoundError" if error.not_found else "BadRequestError",
            ) from error

    def tokenize(self, prompt: ChatPrompt | TextPrompt) -> list[int]:
        return prompt_token_ids(
            self.bundle,
            prompt,
            content_format=self.config.chat_template_content_format,
            sandbox=self.template_sandbox,  # a request's own template only, as in render
        )

    def detokenize(self, token_ids: Sequence[int]) -> str:
        self._check_vocabulary(token_ids)
        return self.bundle.decode(list(token_ids))

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        self._check_vocabulary(token_ids)
        return self.bundle.token_strings(list(token_ids))

    def tokenizer_info(self) -> dict[str, Any]:
        return self.bundle.info(self.model_info.max_model_len)

    def _check_vocabulary(self, token_ids: Sequence[int]) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.bundle.vocab_size]
        if bad:
            raise EngineError(f"token id {bad[0]} is out of vocabulary", param="tokens")

    def stats(self) -> Mapping[str, float]:
        spec = self.config.speculative
        num_drafts = 0 if spec is None else spec.num_speculative_tokens
        stats = unpack_gauges(self.supervisor.gauges("schedule"), num_drafts)
        if not stats["num_blocks"] and self.num_blocks:
            # schedule publishes after its first step; until then every block is free
            stats["num_blocks"] = stats["num_free_blocks"] = self.num_blocks
        stats["num_streams"] = len(self._flights)
        stats["num_requests_rejected_total"] = self.num_rejected  # 429: too many waiting
        # the same under vLLM's name and reason (its --max-num-queued-reqs refusal)
        stats["admission_rejections_total{reason=max_num_queued_reqs}"] = self.num_rejected
        # aborted because their client left more than --max-unread-tokens unread
        stats["num_requests_aborted_unread_total"] = self.num_aborted_unread
        stats["num_stage_recoveries_total"] = self.num_recoveries
        if self._info.kernels is not None:  # an info gauge: which kernels run the model
            stats[f"kernels_info{{kernels={self._info.kernels}}}"] = 1.0
        stats[self._cache_config_info] = 1.0
        if self.config.lora is not None and (info := lora_requests_info(self.config)) is not None:
            stats[info[0]] = info[1]
        return stats

    @property
    def _cache_config_info(self) -> str:
        """vLLM's info gauge of the KV cache's configuration, as a labelled key."""
        config = self.config
        cache_dtype = resolve_kv_cache_dtype(
            config.kv_cache_dtype, config.dtype, config.quantization
        )
        labels = {
            "block_size": config.block_size,
            "cache_dtype": cache_dtype,
            "enable_prefix_caching": config.enable_prefix_caching,
            "num_gpu_blocks": self.num_blocks,  # vLLM's name; the cache's blocks on any device
        }
        return "cache_config_info{" + ",".join(f"{k}={v}" for k, v in labels.items()) + "}"

    def _delivered(self, output: RequestOutput) -> None:
        if output.received_ns:
            self.deliveries.record(
                spans.SPAN_DELIVER,
                output.received_ns,
                now_ns(),
                tokens=len(output.token_ids),
                link=output.step_id,
            )

    def read_traces(self) -> dict[str, np.ndarray]:
        """Each stage's spans (pipeline/trace.py SPAN records) since the last call, and the
        server's own (its deliveries) as "server"."""
        traces = {name: buffer.read_new() for name, buffer in self.supervisor.traces.items()}
        traces["server"] = self.deliveries.read_new()
        return traces

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (all threads) each process of the pipeline has used so far."""
        import os

        pids = {"server": os.getpid(), **self.supervisor.pids()}
        out = {}
        for name, pid in pids.items():
            with contextlib.suppress(ProcessLookupError):
                out[name] = process_cpu_s(pid)
        return out


async def build_engine(config: EngineConfig) -> Engine:
    """An Engine whose stages are started (awaits model loading)."""
    engine = Engine(config)
    await engine.start()
    return engine
