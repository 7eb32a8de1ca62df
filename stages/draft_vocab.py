"""The check that a draft model shares the target's vocabulary, made at start: a draft's token
ids mean the target's tokens, or speculation would verify nonsense."""

from __future__ import annotations

from stages.text.checkpoint import ModelConfig, load_model_config
from stages.text.tokenizer import TokenizerBundle, load_tokenizer


def check_draft_vocabulary(
    draft_path: str, target: TokenizerBundle, target_config: ModelConfig
) -> None:
    """ValueError, saying what differs, unless the draft's tokenizer and logits match the
    target's: the same token for every id (special tokens included), as many logits."""
    draft_config = load_model_config(draft_path)
    if draft_config.vocab_size != target_config.vocab_size:
        raise ValueError(
            f"draft model {draft_path!r} has {draft_config.vocab_size} logits, the target "
            f"{target_config.vocab_size}: a draft must share the target's vocabulary"
        )
    draft = load_tokenizer(draft_path)
    target_vocab = target.tokenizer.get_vocab(with_added_tokens=True)
    draft_vocab = draft.tokenizer.get_vocab(with_added_tokens=True)
    if draft_vocab != target_vocab:
        differ = sorted(
            set(target_vocab.items()).symmetric_difference(draft_vocab.items()),
            key=lambda item: item[1],
        )
        raise ValueError(
            f"draft model {draft_path!r} has another vocabulary than the target "
            f"({len(draft_vocab)} tokens against {len(target_vocab)}; first difference: "
            f"{differ[0]!r})"
        )
