"""A beam search request in the scheduler: its choices, its running beams as sequences that share
KV blocks, and the fork of each step's survivors (stages.beam_search decides which survive)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from stages.api import BeamSearchParams, SamplingParams
from stages.beam_search import BeamSearch, Hypothesis, candidates_per_beam
from stages.kv_blocks import BlockManager

if TYPE_CHECKING:
    from stages.scheduler import Sequence

# Texts of token lists (the outputs of beams, each with a candidate), for stop strings; the flag
# is skip_special_tokens.
Decode = Callable[[list[list[int]], bool], list[str]]
# Bytes of text a beam's decoded tail holds beyond its longest stop string: a tail decoded alone
# may begin differently from the same tokens within the whole text (the last 3 bytes of a UTF-8
# character, each shown as a 3-byte U+FFFD, or a word's dropped leading space), so that beginning
# must lie before any stop string a candidate can complete.
_TAIL_MARGIN_BYTES = 12


def scoring_sampling(
    sampling: SamplingParams, stop_token_ids: tuple[int, ...], vocab_size: int
) -> SamplingParams:
    """How execute runs a beam search's rows: greedy (the token is not used), with the raw
    log-probabilities of the candidates each beam needs (never more than the vocabulary)."""
    assert sampling.beam is not None
    k = candidates_per_beam(sampling.beam.width, len(set(stop_token_ids)))
    return msgspec.structs.replace(sampling, temperature=0.0, logprobs=min(k, vocab_size))


@dataclass(slots=True, frozen=True)
class BeamRequest:
    """What a choice of a beam search request brings to the scheduler."""

    params: BeamSearchParams
    stop: tuple[str, ...] = ()  # stop strings: a beam whose text shows one ends there
    skip_special_tokens: bool = True  # whether that text shows special tokens


@dataclass(slots=True)
class BeamGroup:
    """The choices of one request (index 0 leads: it prefills the prompt and holds the search)
    and, once the prompt is done, the running beams. Each beam is a Sequence of the leader's
    handle whose block table shares its parent's blocks (BlockManager.share); the block a beam
    writes next is copied first if another beam holds it too (BlockManager.grow_writable)."""

    request: BeamRequest
    members: dict[int, Sequence] = field(default_factory=dict)  # by index, as they arrive
    search: BeamSearch | None = None
    beams: list[Sequence] = field(default_factory=list)  # in the search's order
    copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination) blocks
    resumed: dict[int, int] = field(default_factory=dict)  # by index: outputs its client has

    @property
    def width(self) -> int:
        return self.request.params.width

    @property
    def leader(self) -> Sequence | None:
        return self.members.get(0)

    def advance(
        self,
        blocks: BlockManager,
        leader: Sequence,
        max_new_tokens: int,
        top_ids: np.ndarray,  # [B, K'] int64, each running beam's best tokens (-1 padded)
        top_logprobs: np.ndarray,  # [B, K'] float32
        decode: Decode | None,
    ) -> bool:
        """Apply a step's candidates (the prompt's, first): the survivors become the beams,
        forked from their parents; whether the search is over."""
        params = self.request.params
        if self.search is None:
            self.search = BeamSearch(
                width=params.width,
                max_new_tokens=max_new_tokens,
                length_penalty=params.length_penalty,
                early_stopping=params.early_stopping,
                num_candidates=candidates_per_beam(params.width, len(leader.stop_ids)),
            )
        parents = self.beams or [leader]
        k = self.search.num_candidates
        ids, logprobs = top_ids[:, :k], top_logprobs[:, :k]
        stops = np.isin(ids, list(leader.stop_ids))
        if self.request.stop and decode is not None:
            stops |= self._stop_strings(parents, ids, decode)
        chosen = self.search.step(ids, logprobs, stops)
        children = [
            dataclasses.replace(
                parents[p],
                output_ids=[*parents[p].output_ids, token],
                blocks=blocks.share(parents[p].blocks),
                pending_outputs=0,
                steps_in_flight=0,
                rendered=b"",
                detok=b"",
                beam=None,
                beam_of=leader,
            )
            for p, token in chosen
        ]
        for parent in parents:
            blocks.free(parent.blocks)
        self.beams = children
        return self.search.done

    def _stop_strings(
        self, parents: list[Sequence], ids: np.ndarray, decode: Decode
    ) -> np.ndarray:  # -> [B, K] bool
        """Which candidates complete a stop string: the text of the beam's outputs with the
        candidate shows one (a running beam's own text shows none, or it would have ended).
        A completed stop string ends in the candidate's text, so only a tail of each beam's
        outputs is decoded, long enough that its text holds the longest stop string (the work
        of a step does not grow with the outputs)."""
        skip = self.request.skip_special_tokens
        tails = [self._tail(parent.output_ids, decode) for parent in parents]
        where = np.argwhere(ids >= 0)
        texts = decode([[*tails[b], int(ids[b, j])] for b, j in where.tolist()], skip)
        hits = np.zeros(ids.shape, bool)
        for (b, j), text in zip(where.tolist(), texts, strict=True):
            hits[b, j] = any(stop in text for stop in self.request.stop)
        return hits

    def _tail(self, outputs: list[int], decode: Decode) -> list[int]:
        """The last outputs whose text is longer (in bytes) than the longest stop string by a
        margin, so that where the tail's decoding starts (inside a character, a word's leading
        space) lies before any stop string the next token can complete; all of them if shorter.
        Tokens that show no text (skipped special tokens) lengthen it."""
        longest = max(len(stop.encode()) for stop in self.request.stop) + _TAIL_MARGIN_BYTES
        count = min(len(outputs), longest)
        while count < len(outputs):
            text = decode([outputs[len(outputs) - count :]], self.request.skip_special_tokens)[0]
            if len(text.encode()) >= longest:
                break
            count = min(len(outputs), 2 * count)
        return outputs[len(outputs) - count :]

    def results(self) -> list[Hypothesis]:
        return [] if self.search is None else self.search.results()

    def drop(self, blocks: BlockManager) -> None:
        """Give back every beam's blocks and start over from the prompt (a preemption, or the
        end of the request)."""
        for beam in self.beams:
            blocks.free(beam.blocks)
        self.beams = []
        self.copies = []
        self.search = None
