"""Engine logprobs in OpenAI's two shapes: chat (`content[...]`) and completions (parallel lists)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stages.api import TokenLogprob

# JSON has no -inf; vLLM clamps to the same floor.
_LOGPROB_FLOOR = -9999.0


def _clamp(logprob: float) -> float:
    return max(logprob, _LOGPROB_FLOOR)


def token_name(token_id: int, text: str, as_ids: bool) -> str:
    """A token as logprobs name it: its text, or vLLM's `token_id:N` with
    return_tokens_as_token_ids (for tokens whose text is not valid UTF-8 alone)."""
    return f"token_id:{token_id}" if as_ids else text


def chat_logprobs(
    entries: Sequence[TokenLogprob], top_n: int, as_ids: bool = False, with_sampled: bool = False
) -> dict[str, Any]:
    """`{"content": [{token, logprob, bytes, top_logprobs}]}` for the tokens of one delta.
    `with_sampled` (vLLM's shape with logprob_token_ids): the sampled token first among the
    alternatives, each token once."""
    return {
        "content": [
            {
                "token": token_name(entry.token_id, entry.token, as_ids),
                "logprob": _clamp(entry.logprob),
                "bytes": list(entry.token_bytes),
                "top_logprobs": [
                    {
                        "token": token_name(token_id, text, as_ids),
                        "logprob": _clamp(logprob),
                        "bytes": list(raw),
                    }
                    for token_id, text, raw, logprob in _alternatives(entry, top_n, with_sampled)
                ],
            }
            for entry in entries
        ]
    }


def _alternatives(
    entry: TokenLogprob, top_n: int, with_sampled: bool
) -> Sequence[tuple[int, str, bytes, float]]:
    top = entry.top[:top_n]
    if not with_sampled:
        return top
    sampled = (entry.token_id, entry.token, entry.token_bytes, entry.logprob)
    return [sampled, *(t for t in top if t[0] != entry.token_id)]


def prompt_logprobs_body(
    entries: Sequence[TokenLogprob | None], top_n: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (the first has none), a map from token id to
    {logprob, rank, decoded_token} holding the prompt's own token and the top `top_n`."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        scores = {
            str(entry.token_id): {
                "logprob": _clamp(entry.logprob),
                "rank": entry.rank,
                "decoded_token": entry.token,
            }
        }
        for rank, (token_id, text, _, logprob) in enumerate(entry.top[:top_n], start=1):
            scores.setdefault(
                str(token_id), {"logprob": _clamp(logprob), "rank": rank, "decoded_token": text}
            )
        out.append(scores)
    return out


class CompletionLogprobs:
    """Builds `{tokens, token_logprobs, top_logprobs, text_offset}` with offsets that run on
    across the chunks of one stream (offsets count characters of the returned text)."""

    def __init__(self, top_n: int, text_offset: int = 0, as_ids: bool = False) -> None:
        self.top_n = top_n
        self.text_offset = text_offset
        self.as_ids = as_ids

    def prompt_entries(
        self, first_token: tuple[int, str] | None, entries: Sequence[TokenLogprob | None]
    ) -> dict[str, Any]:
        """The prompt's logprobs for `echo`; the first prompt token ((id, text)) has none, and
        is named as the others are (`token_id:N` with return_tokens_as_token_ids)."""
        out = _empty()
        for entry in entries:
            if entry is None:
                name = "" if first_token is None else token_name(*first_token, self.as_ids)
                self._append(out, name, None, None)
            else:
                self._append(out, self._name(entry), _clamp(entry.logprob), self._top(entry))
        return out

    def entries(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        out = _empty()
        for entry in entries:
            self._append(out, self._name(entry), _clamp(entry.logprob), self._top(entry))
        return out

    def _name(self, entry: TokenLogprob) -> str:
        return token_name(entry.token_id, entry.token, self.as_ids)

    def _top(self, entry: TokenLogprob) -> dict[str, float]:
        # vLLM's shape: the sampled token is always among the alternatives
        top = {self._name(entry): _clamp(entry.logprob)}
        for token_id, text, _, logprob in entry.top[: self.top_n]:
            top.setdefault(token_name(token_id, text, self.as_ids), _clamp(logprob))
        return top

    def _append(
        self,
        out: dict[str, Any],
        token: str,
        logprob: float | None,
        top: dict[str, float] | None,
    ) -> None:
        out["tokens"].append(token)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(self.text_offset)
        self.text_offset += len(token)


def merge(into: dict[str, Any] | None, more: dict[str, Any]) -> dict[str, Any]:
    """Concatenates two completions-shaped logprobs (non-streaming responses)."""
    if into is None:
        return more
    for key, values in more.items():
        into[key].extend(values)
    return into


def _empty() -> dict[str, Any]:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
