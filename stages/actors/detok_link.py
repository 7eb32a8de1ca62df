"""Schedule's ends of the tokens and stop_hits rings, which outlive a restart of detokenize alone.

Detokenize releases a tokens message before it has sent its deltas, so what it had not finished
when it died is among the last `n_slots + 2` messages (one being processed, a ring full, one
being sent). The link keeps those. When detokenize is restarted, the link moves to the rings'
successors and sends, first, each request's text state as tokens (`DetokParams.replay_ids`,
replayed without output), then the kept messages again. Detokenize thus writes every row after
that point again; the engine drops the rows it has already read.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable

import msgspec
import numpy as np

from pipeline.actor import ActorContext
from pipeline.errors import PeerDied
from stages.rings import tokens
from stages.rings.common import PromptLogprobs
from stages.rings.tokens import DetokParams
from stages.scheduler import Sequence

_detok_decoder = msgspec.msgpack.Decoder(DetokParams)
_encoder = msgspec.msgpack.Encoder()


class DetokLink:
    def __init__(self, ctx: ActorContext, live: Callable[[], Iterable[Sequence]]) -> None:
        self.ctx = ctx
        self.live = live  # the requests schedule holds now
        self.lock = asyncio.Lock()  # one sender at a time, and none while moving to a new ring
        n_slots = ctx.outbox["tokens"].spec.n_slots
        # (message, the requests it names): what detokenize may not have finished
        self.recent: deque[tuple[dict[str, np.ndarray], list[Sequence]]] = deque(maxlen=n_slots + 2)
        # Per request detokenize knows, the outputs counted by the rows sent so far.
        self.num_sent: dict[int, int] = {}

    async def send(
        self, arrays: dict[str, np.ndarray], seqs: list[Sequence], new: list[Sequence]
    ) -> None:
        """Send a tokens message (`seqs` its rows' requests, `new` those it announces)."""
        async with self.lock:
            self.recent.append((arrays, [*seqs, *new]))
            rows = arrays["rows"]
            for seq in new:
                self.num_sent[seq.handle] = len(seq.output_ids)
            self.num_sent.update(
                zip(rows["handle"].tolist(), rows["num_output_tokens"].tolist(), strict=True)
            )
            for handle in rows["handle"][rows["finish"] != 0].tolist():
                self.num_sent.pop(handle, None)
            try:
                await self.ctx.outbox["tokens"].send_async(tokens.TOKENS, arrays)
            except PeerDied:
                await self.replay_to_successor()

    async def stop_hits(self) -> list[int]:
        """The next stop_hits message; across a restart of detokenize."""
        while True:
            inbox = self.ctx.inbox["stop_hits"]
            try:
                with await inbox.recv_async() as message:
                    handles = tokens.unpack_finished(message)
                for handle in handles:  # finished by detokenize: no row will say so
                    self.num_sent.pop(handle, None)
                return handles
            except PeerDied:
                await self.ctx.reattach("stop_hits")
                async with self.lock:
                    stop_hits = self.ctx.inbox["stop_hits"].handle.generation
                    if self.ctx.outbox["tokens"].handle.generation < stop_hits:
                        await self.replay_to_successor()

    async def replay_to_successor(self) -> None:
        """Move to the next tokens ring and replay (call with the lock held)."""
        while True:
            await self.ctx.reattach("tokens")
            outbox = self.ctx.outbox["tokens"]
            try:
                await outbox.send_async(tokens.TOKENS, self.text_states())
                for arrays, _ in self.recent:
                    await outbox.send_async(tokens.TOKENS, arrays)
            except PeerDied:
                continue  # the new one died too: on to the one after it
            self.ctx.log.info("replayed to a new detokenize", messages=len(self.recent))
            return

    def text_states(self) -> dict[str, np.ndarray]:
        """A message with no rows that announces every request detokenize must know before the
        kept messages, each with the outputs before them to replay."""
        announced: set[int] = set()
        outputs_before: dict[int, int] = {}  # outputs before a request's first kept row
        seqs: dict[int, Sequence] = {}
        for arrays, named in self.recent:
            announced.update(arrays["new_handles"].tolist())
            rows = arrays["rows"]
            for handle, count in zip(
                rows["handle"][rows["token_id"] >= 0].tolist(),
                rows["num_output_tokens"][rows["token_id"] >= 0].tolist(),
                strict=True,
            ):
                outputs_before.setdefault(handle, count - 1)
            seqs.update((seq.handle, seq) for seq in named)
        for seq in self.live():
            seqs.setdefault(seq.handle, seq)
        new: list[tuple[int, bytes]] = []
        for handle, seq in seqs.items():
            if handle in announced or not seq.sent_to_detok:
                continue  # a kept message announces it, or detokenize never heard of it
            upto = outputs_before.get(handle, self.num_sent.get(handle))
            if upto is None:
                continue  # finished before the kept messages
            new.append((handle, _replaying(seq.detok, seq.output_ids[:upto])))
        return tokens.pack_tokens(
            -1,
            np.zeros(0, tokens.TOKEN_ROW),
            np.zeros((0, 0), np.int64),
            np.zeros((0, 0), np.float32),
            new,
            np.zeros(0, tokens.METRICS_ROW),
            PromptLogprobs.empty(),
        )


def _replaying(detok: bytes, output_ids: list[int]) -> bytes:
    """A request's DetokParams for a new detokenize that replays `output_ids` without output.
    Once a request has had a row, its first delta (with the prompt's ids and logprobs) is out."""
    params = _detok_decoder.decode(detok)
    if output_ids:
        params = msgspec.structs.replace(
            params, replay_ids=tuple(output_ids), prompt_token_ids=(), num_prompt_logprobs=-1
        )
    return _encoder.encode(params)
