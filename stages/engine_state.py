"""What the engine holds, shared by its ring readers (stages/engine_readers.py), its lifecycle
and recovery (stages/engine_lifecycle.py) and its client API (stages/engine.py): the config, the
tokenizer and model facts, the supervisor, and each request in flight (`Flight`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field

import msgspec

from pipeline.errors import ActorFailed
from pipeline.kept import KeptFile
from pipeline.supervisor import Supervisor, SupervisorConfig
from pipeline.trace import TraceBuffer
from stages.api import (
    EngineError,
    GenerateRequest,
    ModelInfo,
    RenderedPromptInfo,
    RequestOutput,
)
from stages.config import (
    EngineConfig,
    num_kv_blocks,
    resolve_max_model_len,
    sized_from_device_memory,
)
from stages.draft_vocab import check_draft_vocabulary
from stages.engine_layout import pipeline_layout, process_title, replica_fields, resolve_binding
from stages.rings import common
from stages.text.checkpoint import (
    UnsupportedModelError,
    load_model_config,
    quantized_shard_problem,
)
from stages.text.snapshot import tokenizer_of, write_snapshot
from stages.text.template_sandbox import TemplateSandbox

# Aborts sent lately, sent again after a restart of render (which may have died holding them).
RECENT_ABORTS = 4096


@dataclass(slots=True)
class Flight:
    """A request in flight, as much as it takes to submit it again after a stage failure."""

    request: GenerateRequest
    queue: asyncio.Queue[RequestOutput | EngineError]
    output_ids: list[int] = field(default_factory=list)  # the output tokens read so far
    first_token_ns: int = 0  # when the first of them was read
    num_recoveries: int = 0
    failures_without_progress: int = 0  # failures of one stage it was in since its last token
    failed_stage: str = ""  # the stage those failures were of
    probe_sent_s: float = 0.0  # monotonic time it was last resubmitted alone, as a suspect
    unread: int = 0  # what its queue holds that the client has not read, in unread_cost units
    submitted: bool = False  # sent to the current pipeline (or to be sent by a recovery)
    suspect: bool = False  # held back until the suspects before it have made progress

    def resubmission(self) -> tuple[GenerateRequest, common.Resume | None]:
        """What to submit to a fresh pipeline: the request again if its client has nothing yet,
        else the request without what its first output carried (prompt logprobs) and a Resume."""
        if not self.output_ids:
            return self.request, None
        request = self.request
        if request.sampling.prompt_logprobs is not None:
            sampling = msgspec.structs.replace(request.sampling, prompt_logprobs=None)
            request = msgspec.structs.replace(request, sampling=sampling)
        return request, common.Resume(
            tuple(self.output_ids), self.first_token_ns, self.num_recoveries
        )


class EngineState:
    """What `Engine` holds; its parts are the classes built on this one."""

    def __init__(self, config: EngineConfig) -> None:
        config = resolve_binding(config)  # --cpu-threads-bind's cores, before any is bound
        model_config = load_model_config(config.model_path)
        if config.tensor_parallel_size > 1 and config.quantization is not None:
            problem = quantized_shard_problem(model_config, config.tensor_parallel_size)
            if problem:  # refused before any stage starts, as a head split no rank count fits
                raise UnsupportedModelError(f"{problem}: add --quantization none")
        self.bundle = tokenizer_of(config)  # --tokenizer and --chat-template applied
        self.max_model_len = resolve_max_model_len(config)
        # Sized from device memory, the count is known once execute has published it (start).
        self.num_blocks = 0 if sized_from_device_memory(config) else num_kv_blocks(config)
        if self.num_blocks:
            check_kv_fits(self.num_blocks, config.block_size, self.max_model_len)
        if config.speculative is not None and config.speculative.model is not None:
            check_draft_vocabulary(config.speculative.model, self.bundle, model_config)
        # The stages read the tokenizer and model config from this snapshot (removed at stop).
        self._snapshot_dir = tempfile.mkdtemp(prefix="pipeline-serve-")
        self._model_config = model_config
        write_snapshot(self._snapshot_dir, self.bundle, model_config)
        config = dataclasses.replace(config, snapshot_dir=self._snapshot_dir)
        self.config = config
        # /tokenize's requests' own templates render here as render's do: children started at
        # the first, killed past their limits (closed at stop)
        self.template_sandbox = TemplateSandbox(
            config.chat_template_timeout_s, config.chat_template_memory_bytes
        )
        self._info = ModelInfo(
            served_model_name=config.served_model_name or config.model_path,
            model_path=config.model_path,
            max_model_len=self.max_model_len,
            vocab_size=self.bundle.vocab_size,
            created=int(time.time()),
        )
        waiting = config.max_waiting_requests
        self.max_waiting = config.max_num_seqs if waiting is None else waiting
        self.max_in_flight = config.max_num_seqs + self.max_waiting
        self.supervisor = self._new_supervisor()
        self._failures: list[float] = []  # monotonic times of recent stage failures
        self._restarting: asyncio.Task[None] | None = None
        self._handles = itertools.count(1)
        self._flights: dict[int, Flight] = {}
        self.deliveries = TraceBuffer.local()  # the server's own spans: each output's delivery
        self._renders: dict[int, asyncio.Future[RenderedPromptInfo]] = {}  # render-only requests
        self._num_resets = 0  # prefix-cache resets sent (each carries its number, for the logs)
        self._send_lock = asyncio.Lock()
        self._probe_wake = asyncio.Event()  # a suspect made progress or left
        self._aborts: asyncio.Queue[int] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self.num_aborted_unread = 0  # requests aborted because their client stopped reading
        self._ready = False
        self._failure: ActorFailed | None = None
        self.last_output_ns = 0
        """time.monotonic_ns() when deltas last came from detokenize: the sign a watchdog reads
        that the pipeline makes progress (server/systemd.py)."""
        self._failed_at_s = 0.0  # monotonic time of the last stage failure
        self._restart_s: float | None = None  # how long the last recovery took
        self.num_recoveries = 0  # pipelines brought back, each with its requests resumed
        self.num_rejected = 0  # requests refused with 429 because too many were waiting
        self.down = asyncio.Event()  # set when the engine gave up: the server should exit
        self.down_reason = ""
        self._num_tokens_read = 0  # output tokens read from deltas, ever (progress, for recovery)
        # The last stage restarted alone, and _num_tokens_read when it was back: the same stage
        # failing again with no token since restarts the whole pipeline, whose resubmissions
        # find a request that kills the stage (SUSPECT_AFTER_FAILURES).
        self._alone: tuple[str, int] | None = None
        self._recent_aborts: deque[int] = deque(maxlen=RECENT_ABORTS)

    def _new_supervisor(self, kept: dict[str, dict[str, KeptFile]] | None = None) -> Supervisor:
        config = self.config
        rings, actors = pipeline_layout(config)
        return Supervisor(
            rings,
            actors,
            SupervisorConfig(
                startup_timeout_s=config.startup_timeout_s,
                # A step of a long prefill on two cores can take seconds; a stuck stage takes longer.
                heartbeat_timeout_s=120.0,
                log_format=config.log_format,
                log_level=config.log_level,
                spin_s=0.0,  # the server's event loop serves HTTP: it must not spin either
                # ps shows "pipeline-serve: render" ("pipeline-serve dp1: render" for replica 1)
                process_title_prefix=process_title(config),
                log_fields=replica_fields(config),
            ),
            owner_inboxes=("errors", "deltas"),
            owner_outboxes=("requests",),
            kept=kept,  # execute's prepared weights, kept across restarts
        )


def check_kv_fits(num_blocks: int, block_size: int, max_model_len: int) -> None:
    if num_blocks * block_size < max_model_len:
        raise ValueError(
            f"the KV cache holds {num_blocks * block_size} tokens, less than one request of "
            f"max_model_len={max_model_len}: raise --kv-cache-memory or "
            f"--gpu-memory-utilization, or lower --max-model-len"
        )
