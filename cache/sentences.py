"""Sentence boundaries from the tokenizer's punctuation tokens (SentenceKV's segmentation rule)."""

from __future__ import annotations

import torch

SENTENCE_END_CHARACTERS = (".", "!", "?", "。", "！", "？")


def sentence_end_token_ids(tokenizer) -> torch.Tensor:
    """Ids of the vocabulary entries whose text ends a sentence (ends with . ! ? after stripping spaces
    and quotes), found once by scanning the vocabulary. Returns a sorted int64 tensor."""
    vocabulary = tokenizer.get_vocab()
    ends = []
    for token, token_id in vocabulary.items():
        text = tokenizer.convert_tokens_to_string([token]).strip().rstrip("\"')”’")
        if text.endswith(SENTENCE_END_CHARACTERS) and not text.endswith(".."):
            ends.append(token_id)
    return torch.tensor(sorted(ends), dtype=torch.int64)


def is_sentence_end(token_ids: torch.Tensor, end_ids: torch.Tensor) -> torch.Tensor:
    """Bool mask of ``token_ids`` that end a sentence."""
    return torch.isin(token_ids, end_ids)
