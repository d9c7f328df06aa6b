"""What a task produces and how it is scored; the registry of task generators."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

METRICS = ("string_match_all", "string_match_part", "exact", "kl")


@dataclass
class Sample:
    """One evaluation sample.

    ``input`` is the long context and the question (plain text; the harness may wrap it in the chat
    template), ``answer_prefix`` is appended after it (may be empty), ``outputs`` are the gold strings and
    ``metric`` says how they are scored (RULER's ``string_match_all`` / ``string_match_part``, ``exact``
    for passkey, ``kl`` for natural-text continuation, where ``continuation`` is the text that is
    teacher-forced and compared with the full cache).
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

    def __post_init__(self):
        if self.metric not in METRICS:
            raise ValueError(f"sample {self.task}/{self.index}: metric {self.metric!r} is not one of {METRICS}")

    @property
    def prompt(self) -> str:
        return self.input + self.answer_prefix

    def to_dict(self) -> dict:
        return asdict(self)


# name -> generator(tokenizer, length, seed, index) -> Sample; filled by the task modules
TASKS: dict[str, Callable[..., Sample]] = {}


def register_task(name: str):
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
