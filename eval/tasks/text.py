"""Natural-text continuation on public-domain prose (metric ``kl``, scored by the harness).

``input`` is a window of *Alice's Adventures in Wonderland* (``eval/data/alice29.txt``: hard wraps joined,
one paragraph a line) that starts at a seed-chosen paragraph and ends at a word boundary, with the word
count searched so that it is as close as possible to ``length`` tokens; ``continuation`` is the text that
follows (it starts with the separator after the window's last word), about ``CONTINUATION_TOKENS`` tokens
counted as ``tokens(input + continuation) - tokens(input)``. There is no question, ``answer_prefix`` is empty
and ``outputs`` is empty: the harness teacher-forces the continuation and compares the next-token
distributions with those of the full cache (KL) and reports perplexity. ``max_new_tokens`` is the
continuation's token count. ``text_long`` is the same with ~1,024 continuation tokens: long generation, where a
streaming cache must hold its budget while it decodes (StreamingLLM's setting). The window never wraps around the end of the book, so the longest length is
about 37k SmolLM2 tokens.
"""

from __future__ import annotations

from functools import partial

from eval.tasks.base import Sample, register_task
from eval.tasks.common import count_tokens, fit_length, make_rng, prose_parts, prose_text, prose_window

CONTINUATION_TOKENS = 64
LONG_CONTINUATION_TOKENS = 1024  # ``text_long``: long generation under a fixed cache (StreamingLLM's setting)

_TOKENS_PER_WORD: dict[tuple, float] = {}


def tokens_per_word(tokenizer) -> float:
    """SmolLM2-style tokens per whitespace word of the prose, measured once per tokenizer."""
    key = (getattr(tokenizer, "name_or_path", ""), len(tokenizer))
    if key not in _TOKENS_PER_WORD:
        _TOKENS_PER_WORD[key] = count_tokens(tokenizer, prose_text()) / len(prose_parts()[0])
    return _TOKENS_PER_WORD[key]


def text(tokenizer, length: int, seed: int, index: int, continuation_tokens: int = CONTINUATION_TOKENS,
         task: str = "text") -> Sample:
    """A prose window of about ``length`` tokens and its next ~``continuation_tokens`` tokens (see the module
    docstring)."""
    words, _, paragraph_starts = prose_parts()
    total = len(words)
    needed = int((length + continuation_tokens) / tokens_per_word(tokenizer) * 1.15) + 64
    starts = [s for s in paragraph_starts if total - s >= needed]
    if not starts:
        raise ValueError(f"{task}: length {length} is too long for the prose ({total} words)")
    rng = make_rng(task, seed, index)
    start = rng.choice(starts)
    n_max = total - start - 1

    n, window = fit_length(tokenizer, length, lambda n: prose_window(start, n, wrap=False), lambda t: t,
                           1, n_max, what=task)
    window_tokens = count_tokens(tokenizer, window)

    def with_continuation(m: int) -> str:
        return prose_window(start, n + m, wrap=False)

    m, full = fit_length(tokenizer, window_tokens + continuation_tokens, with_continuation, lambda t: t,
                         0, total - start - n, what="text continuation")
    continuation = full[len(window):]
    continuation_tokens = count_tokens(tokenizer, full) - window_tokens
    return Sample(task=task, length=length, seed=seed, index=index, input=window, answer_prefix="",
                  outputs=[], metric="kl", max_new_tokens=continuation_tokens, continuation=continuation,
                  meta={"prose_start_word": start, "prose_words": n, "continuation_words": m,
                        "continuation_tokens": continuation_tokens})


register_task("text")(text)
register_task("text_long")(partial(text, continuation_tokens=LONG_CONTINUATION_TOKENS, task="text_long"))
