"""Long-horizon tasks: seeded, offline generators of prompts with gold answers.

Importing this package registers every task in :data:`eval.tasks.base.TASKS`
(``name -> generator(tokenizer, length, seed, index) -> Sample``): passkey, niah_single, niah_multikey,
niah_multivalue, niah_multiquery, vt, fwe, research, text, the multi-turn mt_niah, mt_kv, mt_passkey, and
the retrieval families families_train and families_heldout (``eval.tasks.families``: the generalization split).
"""

from eval.tasks import families, fwe, multiturn, niah, passkey, research, text, vt  # noqa: F401  (registration)
from eval.tasks.base import TASKS, Sample, get_task, register_task

__all__ = ["TASKS", "Sample", "get_task", "register_task", "generate"]


def generate(name: str, tokenizer, length: int, seed: int = 0, index: int = 0) -> Sample:
    """One sample of task ``name``."""
    return get_task(name)(tokenizer, length, seed, index)
