"""What a task produces and how it is scored; the registry of task generators."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

METRICS = ("string_match_all", "string_match_part", "exact", "kl")


@dataclass
class Turn:
    """A later turn of a multi-turn sample: its question, the answer prefix and the gold strings."""

    question: str
    outputs: list[str]
    answer_prefix: str = ""


@dataclass
class Sample:
    """One evaluation sample.

    ``input`` is the long context followed by the question (plain text; the harness may wrap it in the chat
    template): ``input == context + question``. A generator sets ``question`` (the suffix of ``input`` that
    asks) and ``context`` is derived; a sample without a question is all context. ``answer_prefix`` is
    appended after the question (may be empty), ``outputs`` are the gold strings and ``metric`` says how
    they are scored (RULER's ``string_match_all`` / ``string_match_part``, ``exact`` for passkey, ``kl`` for
    natural-text continuation, where ``continuation`` is the text that is teacher-forced and compared with
    the full cache). ``turns`` are the later questions of a multi-turn sample, asked one after another
    once the previous answer is complete.
    """

    task: str
    length: int
    seed: int
    index: int
    input: str
    answer_prefix: str
    outputs: list[str]
    metric: str
    max_new_tokens: int = 32
    continuation: str | None = None
    meta: dict = field(default_factory=dict)
    question: str = ""
    context: str | None = None
    turns: list[Turn] = field(default_factory=list)

    def __post_init__(self):
        if self.metric not in METRICS:
            raise ValueError(f"sample {self.task}/{self.index}: metric {self.metric!r} is not one of {METRICS}")
        if self.context is None:
            if not self.input.endswith(self.question):
                raise ValueError(f"sample {self.task}/{self.index}: the question is not the end of the input")
            self.context = self.input[: len(self.input) - len(self.question)]
        elif self.context + self.question != self.input:
            raise ValueError(f"sample {self.task}/{self.index}: input must equal context + question")
        self.turns = [turn if isinstance(turn, Turn) else Turn(**turn) for turn in self.turns]
        for number, turn in enumerate(self.turns, start=2):
            if not turn.question.strip() or not turn.outputs:
                raise ValueError(f"sample {self.task}/{self.index}: turn {number} needs a question and gold outputs")

    @classmethod
    def from_parts(cls, *, context: str, question: str, **fields) -> Sample:
        """A sample from its context and question (``input`` is their concatenation)."""
        return cls(input=context + question, question=question, context=context, **fields)

    @property
    def all_outputs(self) -> list[list[str]]:
        """The gold strings of every turn, the first turn's first."""
        return [self.outputs] + [turn.outputs for turn in self.turns]

    @property
    def prompt(self) -> str:
        return self.input + self.answer_prefix

    def to_dict(self) -> dict:
        return asdict(self)


# name -> generator(tokenizer, length, seed, index) -> Sample; filled by the task modules
TASKS: dict[str, Callable[..., Sample]] = {}


def register_task(name: str):
    """Decorator: register a sample generator under ``name``."""
    def decorator(generator):
        TASKS[name] = generator
        return generator
    return decorator


def get_task(name: str) -> Callable[..., Sample]:
    """The generator registered as ``name`` (importing ``eval.tasks`` registers every built-in task; a
    test or plug-in registers more with ``register_task``)."""
    import eval.tasks  # noqa: F401  (registration of the built-in tasks)

    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}: choose from {', '.join(sorted(TASKS)) or '(none registered)'}")
    return TASKS[name]


def sample_seed(seed: int, task: str, length: int, index: int) -> int:
    """The seed of one sample: stable across processes and machines (not Python's salted ``hash``). The
    length is left out on purpose: the generators then put the same needles and questions at every length,
    so results pair across lengths."""
    digest = hashlib.sha256(f"{seed}:{task}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF
