"""A toy task and tokenizer for the tiny random model: ``toy_recall`` (registered on import) and ``ByteTokenizer``."""

import random
from types import SimpleNamespace

import torch

from eval.tasks.base import Sample, register_task


class ByteTokenizer:
    """Characters to ids 2..255 and back; enough for the tiny random model."""

    eos_token_id = None

    def __call__(self, text, return_tensors=None):
        ids = [2 + ord(c) % 254 for c in text]
        return SimpleNamespace(input_ids=torch.tensor([ids]) if return_tensors == "pt" else ids)

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr((i - 2) % 254) for i in ids)


@register_task("toy_recall")
def toy_recall(tokenizer, length, seed, index):
    """A three-digit key stated once in random letters; the answer is the key."""
    rng = random.Random(seed * 1000 + index)
    key = str(rng.randint(100, 999))
    filler = "".join(rng.choice("abcdefgh ") for _ in range(length - 40))
    cut = rng.randint(0, len(filler))
    text = filler[:cut] + f" the key is {key}. " + filler[cut:]
    return Sample("toy_recall", length, seed, index, text[:length - 12], " key: ", [key], "exact", max_new_tokens=6)
