"""The layout rule of ``DESIGN.md`` checked on the source: which project folder may import which.

``cache/`` imports nothing of ``agents/``, ``kvgym/`` or ``eval/``; ``kvgym/`` (the envs: everything but the
command line) imports ``cache/`` and the task generators (``eval.tasks``, and ``eval.scoring``, the tasks' answer
metric), never ``agents/``. Every import statement counts, including those inside functions.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("agents", "cache", "eval", "kvgym")
ALLOWED = {
    "cache": ("cache",),
    "kvgym": ("cache", "kvgym", "eval.tasks", "eval.scoring"),
}


def imported_modules(source: str) -> list[str]:
    """Every absolute module an ``import`` or ``from ... import`` statement of ``source`` names."""
    modules = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.append(node.module)
    return modules


def violations(source: str, folder: str) -> list[str]:
    """The project modules ``source`` (a module of ``folder``) imports against the layout rule."""
    allowed = ALLOWED[folder]
    bad = []
    for module in imported_modules(source):
        if module.split(".")[0] not in PROJECT:
            continue  # the standard library and third-party packages
        if not any(module == prefix or module.startswith(prefix + ".") for prefix in allowed):
            bad.append(module)
    return bad


def modules_of(folder: str) -> list[Path]:
    paths = sorted((ROOT / folder).rglob("*.py"))
    return [path for path in paths if path != ROOT / "kvgym" / "cli.py"]  # the command line imports everything


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_every_module_follows_the_layout_rule(folder):
    paths = modules_of(folder)
    assert paths, f"no modules found under {folder}/"
    found = {str(path.relative_to(ROOT)): violations(path.read_text(), folder) for path in paths}
    assert not {path: bad for path, bad in found.items() if bad}
    if folder == "kvgym":
        assert ROOT / "kvgym" / "envs" / "replay.py" in paths  # the envs are among the checked modules


def test_the_checker_flags_forbidden_imports():
    source = '''
import numpy as np
from cache.controller import Op
from eval.tasks.base import get_task


def load():
    from agents.registry import make_controller
    import agents.baselines.oracle
    from eval.replay_compare import spearman
    from . import sibling
    return make_controller
'''
    assert violations(source, "kvgym") == ["agents.registry", "agents.baselines.oracle", "eval.replay_compare"]
    assert violations(source, "cache") == ["eval.tasks.base", "agents.registry", "agents.baselines.oracle",
                                           "eval.replay_compare"]
    assert violations("import evaluation\nfrom cachetools import LRUCache\n", "cache") == []  # prefixes, not names
