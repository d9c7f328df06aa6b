"""Frequent-words extraction (RULER ``fwe``: `scripts/data/synthetic/freq_words_extraction.py`, §6.5).

A vocabulary of ``length // 50`` words is drawn from the shipped word lists (nouns and adjectives; RULER
draws random six-letter "coded words" instead); the word of rank k appears ``floor(N * k**-2 / zeta(2))``
times (Zipf, alpha = 2.0), the rank-1 word is replaced by the noise token "...", and the words are shuffled
and joined by spaces. ``N`` is searched to fit the length. Prompt (RULER's template, unchanged):

    Read the following coded text and track the frequency of each coded word. Find the three most
    frequently appeared coded words. {context}
    Question: Do not provide any explanation. Please ignore the dots '....'. What are the three most
    frequently appeared words in the above coded text?

answer prefix " Answer: According to the coded text above, the three most frequently appeared words
are:". Gold: the words of ranks 2-4; ``string_match_all``; 50 new tokens.
"""

from __future__ import annotations

from functools import cache, lru_cache

from eval.tasks.base import Sample, register_task
from eval.tasks.common import fit_length, last_line, make_rng, word_list

TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most "
            "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please "
            "ignore the dots '....'. What are the three most frequently appeared words in the above coded "
            "text?")
ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
ALPHA = 2.0
NOISE = "..."
MAX_NEW_TOKENS = 50


@cache
def zeta(alpha: float, terms: int = 100_000) -> float:
    """Riemann zeta for alpha > 1 (partial sum plus the integral tail)."""
    return sum(k ** -alpha for k in range(1, terms + 1)) + terms ** (1 - alpha) / (alpha - 1)


@lru_cache(maxsize=1)
def fwe_words() -> tuple[str, ...]:
    """Nouns then adjectives, dropping any word that is a substring of another (substring scoring)."""
    words = list(dict.fromkeys(word_list("nouns") + word_list("adjectives")))
    return tuple(w for w in words if not any(w != o and w in o for o in words))


def word_counts(num_words: int, vocab_size: int, alpha: float = ALPHA) -> list[int]:
    """Zipf-distributed counts of ``vocab_size`` words summing to about ``num_words``."""
    z = zeta(alpha)
    return [int(num_words * k ** -alpha / z) for k in range(1, vocab_size + 1)]


@register_task("fwe")
def fwe(tokenizer, length: int, seed: int, index: int) -> Sample:
    """Frequent-words extraction (see the module docstring)."""
    rng = make_rng("fwe", seed, index)
    vocab_size = max(length // 50, 5)
    pool = fwe_words()
    if vocab_size > len(pool):
        raise ValueError(f"fwe: length {length} needs {vocab_size} words, the word lists hold {len(pool)}")
    vocab = rng.sample(pool, vocab_size)
    vocab[0] = NOISE  # the top-ranked word is noise
    outputs = vocab[1:4]

    def build(n: int) -> str:
        words = [w for w, c in zip(vocab, word_counts(n, vocab_size), strict=True) for _ in range(c)]
        make_rng("fwe", seed, index, salt=f"shuffle/{n}").shuffle(words)
        return TEMPLATE.format(context=" ".join(words))

    n, text = fit_length(tokenizer, length, build, lambda t: t + ANSWER_PREFIX, 0, 4 * length, what="fwe")
    return Sample(task="fwe", length=length, seed=seed, index=index, input=text, question=last_line(text), answer_prefix=ANSWER_PREFIX,
                  outputs=list(outputs), metric="string_match_all", max_new_tokens=MAX_NEW_TOKENS,
                  meta={"vocab": vocab, "counts": word_counts(n, vocab_size), "alpha": ALPHA, "num_words": n})

