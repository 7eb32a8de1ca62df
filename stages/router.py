"""Which data-parallel replica serves a request: the one whose prefix cache likely holds the
longest prefix of its prompt when that saves work, else the least loaded (SGLang's cache-aware
router). The server has no tokenizer on the hot path, so the router keys on the prompt's bytes."""

from __future__ import annotations

import enum
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import numpy as np

from stages.api import ChatPrompt, Prompt, TextPrompt

# English text and chat JSON run about four UTF-8 bytes per token (SmolLM2, Llama 3), and a
# token id is four bytes: a chunk of block_size * 4 bytes stands for about one KV block.
BYTES_PER_TOKEN = 4
# SGLang's defaults: below this share of the prompt matched, the prompt is mostly new work and
# load decides; loads are imbalanced when max - min exceeds the absolute threshold and max
# exceeds min times the relative one (then load decides whatever the prompt).
CACHE_THRESHOLD = 0.3
BALANCE_REL_THRESHOLD = 1.5


class Policy(enum.StrEnum):
    CACHE_AWARE = "cache_aware"
    ROUND_ROBIN = "round_robin"


@dataclass(slots=True, frozen=True)
class ReplicaLoad:
    """What the router weighs of one replica when it decides."""

    ready: bool  # up, not restarting
    in_flight: int  # requests the server has sent it and not yet seen finish
    waiting: int  # requests it cannot run now (queued past max_num_seqs, or short of KV blocks)
    free_blocks: int  # KV blocks held by no request (schedule's gauge)
    full: bool  # at its in-flight limit: another request would get a 429


@dataclass(slots=True, frozen=True)
class Route:
    """A decision and why: the request's debug log carries it."""

    replica: int
    reason: str  # prefix | load | imbalanced | round_robin | only_ready | all_full
    matched_bytes: int  # of the key, the prefix the chosen replica likely has cached
    key_bytes: int


@dataclass(slots=True, frozen=True)
class RoutingKey:
    """A prompt as the router sees it: hashes of its bytes' consecutive chunks, each chained to
    the ones before it, so that equal hashes mean equal prefixes."""

    chunk_hashes: tuple[int, ...]
    num_bytes: int


def routing_key(prompt: Prompt, cache_salt: str | None, chunk_bytes: int) -> RoutingKey:
    """The prompt's bytes as the template would render them, in order (chat messages as JSON,
    text as UTF-8, token ids as int32), chained from a seed of what changes every token of the
    rendering (tools, the template and its arguments, BOS) and of the cache salt, which keeps
    requests of different salts from sharing blocks."""
    body, context = _prompt_bytes(prompt)
    chained = hash((cache_salt, *context))
    hashes = []
    for start in range(0, len(body) - chunk_bytes + 1, chunk_bytes):
        chained = hash((chained, body[start : start + chunk_bytes]))
        hashes.append(chained)
    return RoutingKey(tuple(hashes), len(body))


def _prompt_bytes(prompt: Prompt) -> tuple[bytes, tuple[object, ...]]:
    """(the prompt's bytes, what changes every token of its rendering): routing_key's parts."""
    if isinstance(prompt, ChatPrompt):
        body = msgspec.json.encode(prompt.messages)
        context: tuple[object, ...] = (
            "chat",
            msgspec.json.encode((prompt.tools, prompt.chat_template, prompt.chat_template_kwargs)),
        )
    elif isinstance(prompt, TextPrompt):
        body = prompt.text.encode()
        context = ("text", prompt.add_special_tokens)
    else:
        body = np.asarray(prompt.token_ids, dtype=np.int32).tobytes()
        context = ("tokens",)
    return body, context


class PrefixIndex:
    """One replica's prefix cache as the router imagines it: the chunks of the prompts sent to it,
    least recently used first, as many as its KV cache has blocks. A prompt touches its chunks
    last to first, so that a prefix outlives its tails, as the blocks do in the cache."""

    def __init__(self, capacity_chunks: int) -> None:
        self.capacity_chunks = capacity_chunks
        self._chunks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._chunks)

    def match(self, key: RoutingKey) -> int:
        """How many of the key's leading chunks the index holds."""
        chunks = self._chunks
        for matched, chunk in enumerate(key.chunk_hashes):
            if chunk not in chunks:
                return matched
        return len(key.chunk_hashes)

    def insert(self, key: RoutingKey) -> None:
        chunks = self._chunks
        for chunk in reversed(key.chunk_hashes):
            chunks[chunk] = None
            chunks.move_to_end(chunk)
        while len(chunks) > self.capacity_chunks:
            chunks.popitem(last=False)

    def clear(self) -> None:
        self._chunks.clear()


class Router:
    """Cache-aware routing over `num_replicas`, or round robin.

    Cache-aware, as SGLang's router: when loads are imbalanced (in-flight counts apart by more
    than `balance_abs_threshold` and by more than BALANCE_REL_THRESHOLD times), the least loaded
    replica; else the one whose index matches the most of the key when that is more than
    CACHE_THRESHOLD of it (ties to the least loaded); else the least loaded. Least loaded: the
    fewest waiting requests, then the fewest in flight, then the most free KV blocks. Every
    decision adds the key to the chosen replica's index. Round robin, or replicas without a
    prefix cache, read no index: then the indexes stay empty and keys carry no chunks.
    """

    def __init__(
        self,
        num_replicas: int,
        policy: Policy,
        chunk_bytes: int,
        capacity_chunks: int,
        balance_abs_threshold: int,
        prefix_caching: bool = True,
    ) -> None:
        self.policy = policy
        self.chunk_bytes = chunk_bytes
        self.balance_abs_threshold = balance_abs_threshold
        # Without a prefix cache on the replicas there is nothing for a prefix to save, and
        # round robin does not ask what is cached: an index would only grow with traffic.
        self.reads_prefixes = prefix_caching and policy is Policy.CACHE_AWARE
        self.indexes = [PrefixIndex(capacity_chunks) for _ in range(num_replicas)]
        self._turns = itertools.cycle(range(num_replicas))

    def key(self, prompt: Prompt, cache_salt: str | None) -> RoutingKey:
        if not self.reads_prefixes:  # no chunk is looked up: the size alone, for the log
            return RoutingKey((), len(_prompt_bytes(prompt)[0]))
        return routing_key(prompt, cache_salt, self.chunk_bytes)

    def route(self, key: RoutingKey, loads: Sequence[ReplicaLoad]) -> Route | None:
        """The replica to send the request to; None when no replica is ready."""
        ready = [r for r, load in enumerate(loads) if load.ready]
        if not ready:
            return None
        route = self._choose(key, loads, ready)
        if self.reads_prefixes:
            self.indexes[route.replica].insert(key)
        return route

    def _choose(self, key: RoutingKey, loads: Sequence[ReplicaLoad], ready: list[int]) -> Route:
        matched = {
            r: self.indexes[r].match(key) * self.chunk_bytes if self.reads_prefixes else 0
            for r in ready
        }

        def route(replica: int, reason: str) -> Route:
            return Route(replica, reason, min(matched[replica], key.num_bytes), key.num_bytes)

        if len(ready) == 1:
            return route(ready[0], "only_ready")
        room = [r for r in ready if not loads[r].full]
        if not room:  # the least loaded answers the 429
            return route(self._least_loaded(ready, loads), "all_full")
        if self.policy is Policy.ROUND_ROBIN:
            replica = next(self._turns)
            while replica not in room:
                replica = next(self._turns)
            return route(replica, "round_robin")
        in_flight = [loads[r].in_flight for r in room]
        most, least = max(in_flight), min(in_flight)
        if most - least > self.balance_abs_threshold and most > least * BALANCE_REL_THRESHOLD:
            return route(self._least_loaded(room, loads), "imbalanced")
        best = max(matched[r] for r in room)
        if best and best > CACHE_THRESHOLD * key.num_bytes:
            holders = [r for r in room if matched[r] == best]
            return route(self._least_loaded(holders, loads), "prefix")
        return route(self._least_loaded(room, loads), "load")

    @staticmethod
    def _least_loaded(replicas: list[int], loads: Sequence[ReplicaLoad]) -> int:
        return min(
            replicas,
            key=lambda r: (loads[r].waiting, loads[r].in_flight, -loads[r].free_blocks, r),
        )

    def forget(self, replica: int) -> None:
        """The replica's cache is empty now (a fresh pipeline, or a reset)."""
        self.indexes[replica].clear()
