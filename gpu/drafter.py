"""A draft model for speculative decoding (vLLM's `draft_model`): it proposes each drafting row's
drafts inside the step that verifies them, sampling each from q, its own distribution under the
request's knobs, which the verifier needs (gpu/sampler.py `rejection_sample`).

Its paged KV cache has as many blocks as the target's and is indexed by the same block tables and
slots, so the scheduler's blocks serve both. The draft computes every prompt token in the step the
target does, so a prompt block the prefix cache shares holds the draft's KV as well as the
target's; a decoding request's tokens it computes only when the request drafts (all those it has
not seen, at once), so steps without drafts cost it nothing. Rejected drafts' KV is overwritten
later, as the target's is.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from gpu.attention import AttentionInputs
from gpu.kv_cache import KVCache
from gpu.model import CausalLM
from gpu.sampler import TokenHistory, rows_needing_token_ids, sample

if TYPE_CHECKING:
    from gpu.runner import StepBatch

_NO_IDS = np.zeros(0, dtype=np.int64)


@dataclass(slots=True, frozen=True)
class Proposal:
    """The drafts of one step: the batch's input ids with every draft filled in, and the
    distribution each draft was sampled from."""

    input_ids: np.ndarray  # [T] int64
    probs: dict[int, torch.Tensor]  # batch row -> [D, V] float32, q of its drafts in order


@dataclass(slots=True)
class _Row:
    """One batch row's part of a draft pass."""

    batch_row: int
    positions: np.ndarray  # [n] int64
    tokens: np.ndarray  # [n] int64
    slots: np.ndarray  # [n] int64


class Drafter:
    def __init__(self, model: CausalLM, kv_cache: KVCache, generator: torch.Generator) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.generator = generator  # the target runner's: drives rows without a seed
        # Per request, how many leading positions of the draft's cache hold its tokens: short of
        # the target's by the outputs of steps it drafted nothing in, and after a step that
        # accepted every draft by that last draft (sampled, never fed). The next step that
        # drafts feeds them before its input token.
        self._lengths: dict[int, int] = {}

    def free(self, handles: list[int]) -> None:
        for handle in handles:
            self._lengths.pop(handle, None)

    def propose(
        self,
        batch: StepBatch,  # a drafting row's last num_draft input ids are placeholders (-1)
        known_tokens: list[list[int]],  # per batch row, its tokens by position before this step
        num_draft: np.ndarray,  # [B] int64, drafts each row takes (0 where it does not sample)
    ) -> Proposal:
        """Feed the draft model the prompt tokens the target computes this step, and to each
        drafting row every token of it the draft has not seen; then run it num_draft times over
        the drafting rows, sampling one draft each time."""
        starts = batch.query_start_loc.astype(np.int64)
        input_ids = batch.input_ids.astype(np.int64, copy=True)
        block_size = self.kv_cache.block_size
        rows: list[_Row] = []
        histories: dict[int, list[int]] = {}  # drafting rows: their tokens, drafts appended
        for b, handle in enumerate(batch.handles.tolist()):
            first = int(batch.positions[starts[b]])
            known_end = first + int(starts[b + 1] - starts[b]) - int(num_draft[b])
            feed_from = min(self._lengths.get(handle, first), first)
            if not num_draft[b] and first >= batch.prompt_lens[b]:  # caught up when it drafts
                self._lengths[handle] = feed_from
                continue
            earlier = known_tokens[b][feed_from:first]
            tokens = np.concatenate(
                [
                    np.asarray(earlier, np.int64),
                    input_ids[starts[b] : starts[b] + known_end - first],
                ]
            )
            positions = np.arange(feed_from, known_end, dtype=np.int64)
            table = batch.block_tables[b].astype(np.int64)
            slots = table[positions // block_size] * block_size + positions % block_size
            if feed_from >= batch.prompt_lens[b]:
                # Outputs, as one-token rows: the target computed each as a decode (plain or
                # verifying), and the same kernels give the same logits, so an equal draft's
                # greedy drafts are the target's tokens, never off by a rounding.
                rows += [
                    _Row(b, positions[i : i + 1], tokens[i : i + 1], slots[i : i + 1])
                    for i in range(len(positions))
                ]
            else:
                rows.append(_Row(b, positions, tokens, slots))
            self._lengths[handle] = known_end
            if num_draft[b]:
                histories[b] = [*known_tokens[b][:first], *tokens[first - feed_from :].tolist()]
                # Draft j's KV is written by pass j; the last draft's never is.
                self._lengths[handle] = known_end + int(num_draft[b]) - 1

        order = list(histories)  # the drafting rows, in batch order
        probs: dict[int, list[torch.Tensor]] = {b: [] for b in order}
        if not rows:
            return Proposal(input_ids, {})
        # Logits at each drafting row's last fed position: its last _Row
        last = {r.batch_row: i for i, r in enumerate(rows)}
        wants = [r.batch_row in histories and last[r.batch_row] == i for i, r in enumerate(rows)]
        logits = self._forward(rows, batch.block_tables, wants)
        for step in range(int(num_draft.max(initial=0))):
            if step:  # feed each draft just sampled, at its planned position and slot
                order = [b for b in order if step < num_draft[b]]
                at = [int(starts[b + 1] - num_draft[b]) + step - 1 for b in order]
                feeds = [
                    _Row(
                        b,
                        batch.positions[i : i + 1].astype(np.int64),
                        np.array([histories[b][-1]], np.int64),
                        batch.slot_mapping[i : i + 1].astype(np.int64),
                    )
                    for b, i in zip(order, at, strict=True)
                ]
                logits = self._forward(feeds, batch.block_tables, [True] * len(order))
            drafts, q = self._sample(batch, logits, order, histories, step)
            for i, b in enumerate(order):
                histories[b].append(drafts[i])
                probs[b].append(q[i])
                input_ids[int(starts[b + 1] - num_draft[b]) + step] = drafts[i]
        return Proposal(input_ids, {b: torch.stack(p) for b, p in probs.items()})

    def _forward(
        self, rows: list[_Row], block_tables: np.ndarray, wants_logits: list[bool]
    ) -> torch.Tensor:  # -> [R', V] float32, the last position of each row that wants logits
        lengths = np.array([len(r.positions) for r in rows], np.int64)
        query_start_loc = np.zeros(len(rows) + 1, np.int32)
        np.cumsum(lengths, out=query_start_loc[1:])
        context_lens = np.array([int(r.positions[-1]) + 1 for r in rows], np.int32)
        tables = block_tables[[r.batch_row for r in rows]]
        logits_rows = (query_start_loc[1:] - 1)[np.asarray(wants_logits, bool)]
        device = self.kv_cache.layers[0][0].device
        inputs = AttentionInputs(
            query_start_loc=torch.from_numpy(query_start_loc).to(device),
            context_lens=torch.from_numpy(context_lens).to(device),
            block_tables=torch.from_numpy(np.ascontiguousarray(tables)).to(device),
            slot_mapping=torch.from_numpy(np.concatenate([r.slots for r in rows])).to(device),
        )
        logits = self.model(
            torch.from_numpy(np.concatenate([r.tokens for r in rows])).to(device),
            torch.from_numpy(np.concatenate([r.positions for r in rows])).to(device),
            self.kv_cache.layers,
            inputs,
            torch.from_numpy(logits_rows.astype(np.int64)).to(device),
        )
        return logits.float()  # on the device: q is sampled with the target's generator there

    def _sample(
        self,
        batch: StepBatch,
        logits: torch.Tensor,  # [R, V] float32
        batch_rows: list[int],  # [R]
        histories: dict[int, list[int]],
        drafted: int,  # drafts each row has taken so far (the last of its history)
    ) -> tuple[list[int], torch.Tensor]:  # -> (R drafts, [R, V] their q)
        """Sample each row's next draft from q: the draft's logits under every knob of the
        request (as the target's are for p), a grammar's mask as it stands after the drafts
        before. A seeded row draws with the noise of its (seed, output index), the noise the
        target samples that position with: the verifier couples the two
        (gpu.sampler.rejection_sample)."""
        params = batch.sampling.select(np.asarray(batch_rows, np.int64))
        params = replace(params, num_logprobs=np.full(len(batch_rows), -1, np.int32))
        if drafted and batch.grammar_masks is not None and params.token_bitmask.shape[1]:
            masks = params.token_bitmask.copy()
            for i, b in enumerate(batch_rows):
                row = batch.grammar_masks(b, histories[b][-drafted:], True)
                if row is not None:
                    masks[i] = row[0]
            params = replace(params, token_bitmask=masks)
        needs_ids = rows_needing_token_ids(params)
        history = []
        for i, b in enumerate(batch_rows):
            tokens = histories[b]
            prompt_len = min(int(batch.prompt_lens[b]), len(tokens))
            if needs_ids[i]:
                history.append(TokenHistory.of(tokens[:prompt_len], tokens[prompt_len:]))
            else:
                history.append(TokenHistory(len(tokens) - prompt_len, _NO_IDS, _NO_IDS))
        out = sample(logits, params, history, self.generator, keep_probs=True)
        return out.token_ids.tolist(), torch.zeros(0) if out.probs is None else out.probs
