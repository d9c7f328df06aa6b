"""The layout rule of ``DESIGN.md`` checked on the source: which project folder may import which.

``cache/`` imports nothing of ``agents/``, ``kvgym/`` or ``eval/``; ``kvgym/`` (the envs: everything but the
command line) imports ``cache/`` and the task package (``eval.tasks``: the generators and their answer metric,
``eval.tasks.scoring``), never ``agents/``. Every import statement counts, including those inside functions.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("agents", "cache", "eval", "kvgym")
ALLOWED = {
    "cache": ("cache",),
    "kvgym": ("cache", "kvgym", "eval.tasks"),
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
    command_line = {ROOT / "kvgym" / "cli.py", ROOT / "kvgym" / "generate.py"}  # they import every part
    return [path for path in paths if path not in command_line]


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_every_module_follows_the_layout_rule(folder):
    paths = modules_of(folder)
    assert paths, f"no modules found under {folder}/"
    found = {str(path.relative_to(ROOT)): violations(path.read_text(), folder) for path in paths}
    assert not {path: bad for path, bad in found.items() if bad}
    if folder == "kvgym":
        assert ROOT / "kvgym" / "envs" / "kvcache.py" in paths  # the envs are among the checked modules


def test_the_envs_do_not_import_sb3():
    """The envs are Gymnasium's; SB3's ``VecEnv`` adapter lives with training (``agents.ranker.ppo``)."""
    paths = sorted((ROOT / "kvgym" / "envs").glob("*.py"))
    assert ROOT / "kvgym" / "envs" / "kvcache.py" in paths
    found = {path.name: [m for m in imported_modules(path.read_text()) if m.split(".")[0] in ("stable_baselines3", "sb3_contrib")]
             for path in paths}
    assert not {name: bad for name, bad in found.items() if bad}
    assert imported_modules("from stable_baselines3.common.vec_env import VecEnv") == ["stable_baselines3.common.vec_env"]


def test_the_checker_flags_forbidden_imports():
    source = '''
import numpy as np
from cache.controller import Op
from eval.tasks.base import get_task


def load():
    from agents.registry import make_controller
    import agents.baselines.oracle
    from eval.ranking_fidelity import spearman
    from . import sibling
    return make_controller
'''
    assert violations(source, "kvgym") == ["agents.registry", "agents.baselines.oracle", "eval.ranking_fidelity"]
    assert violations(source, "cache") == ["eval.tasks.base", "agents.registry", "agents.baselines.oracle",
                                           "eval.ranking_fidelity"]
    assert violations("import evaluation\nfrom cachetools import LRUCache\n", "cache") == []  # prefixes, not names


# ------------------------------------------------------------------------------- results/: evidence, not artefacts
RESULTS_FILE_LIMIT = 1_000_000  # bytes
ARTEFACTS = ("events.out.tfevents", ".pt", ".npz", ".zip", ".ckpt", ".safetensors")


def results_problems(files: list[tuple[str, int]]) -> list[str]:
    """What breaks the rule for ``results/`` among ``(path, size)``: a file over 1 MB, or an artefact (event file,
    checkpoint, array) that training or a command regenerates."""
    problems = []
    for path, size in files:
        if size > RESULTS_FILE_LIMIT:
            problems.append(f"{path}: {size / 1e6:.1f} MB (over 1 MB: compress it or keep a summary)")
        if any(marker in Path(path).name for marker in ARTEFACTS if marker.startswith("events")) or \
                Path(path).suffix in ARTEFACTS:
            problems.append(f"{path}: an artefact (event file or checkpoint), not evidence")
    return problems


def test_results_hold_evidence_under_one_megabyte_each():
    import subprocess

    listed = subprocess.run(["git", "ls-files", "results"], cwd=ROOT, capture_output=True, text=True)
    paths = listed.stdout.split() if listed.returncode == 0 else [
        str(p.relative_to(ROOT)) for p in (ROOT / "results").rglob("*") if p.is_file()]
    assert paths, "no file under results/ was found: the check would pass vacuously"
    files = [(path, (ROOT / path).stat().st_size) for path in paths if (ROOT / path).is_file()]
    assert results_problems(files) == []
    # negative control: the rule rejects what it is meant to reject
    assert len(results_problems([("results/a/samples.jsonl", 2_000_000), ("results/b/ranker.pt", 10),
                                 ("results/c/events.out.tfevents.1.vm", 10), ("results/d/summary.md", 10)])) == 3


def long_modules(limits: dict[str, int]) -> list[str]:
    """Modules of the package folders over their line limit (``limits``: a path's own limit, else ``"*"``)."""
    found = []
    for folder in ("cache", "agents", "kvgym", "eval"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            name = str(path.relative_to(ROOT))
            lines = len(path.read_text().splitlines())
            if lines > limits.get(name, limits["*"]):
                found.append(f"{name}: {lines} lines")
    return found


def test_files_of_one_job_each_stay_short():
    """Issue 38: no module of the package above 600 lines, the command line at most 400 (it parses and calls)."""
    assert long_modules({"*": 600, "kvgym/cli.py": 400}) == []
    assert long_modules({"*": 300}), "negative control: a tighter limit must find the long modules"


def test_the_repository_stays_under_five_megabytes():
    """Issue 38: the tracked files (evidence, code, policies) total under 5 MB."""
    import subprocess

    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    total = sum((ROOT / path).stat().st_size for path in listed.stdout.splitlines() if (ROOT / path).is_file())
    assert total > 1_000_000, "the listing found almost nothing: the check would pass vacuously"
    assert total < 5_000_000, f"tracked files total {total / 1e6:.2f} MB"


# ------------------------------------------------------------------------ a policy loads without the env (issue 37)
LOADED_AFTER = """
import sys
{statement}
print(sorted(m for m in ("gymnasium", "stable_baselines3", "kvgym") if m in sys.modules))
"""


def modules_after(statement: str) -> str:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", LOADED_AFTER.format(statement=statement)], cwd=ROOT,
                          capture_output=True, text=True, env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                                                               "PATH": "/usr/bin:/bin"}, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_policy_loads_and_decides_without_gymnasium_or_sb3():
    """The shipped ranker, loaded as a controller and deciding on a live cache, imports neither the envs nor their
    libraries (its features and top-b rule are ``cache.ranking``); importing kvgym (the negative control) does."""
    decide = ("from agents.registry import make_controller\n"
              "from tests.conftest import make_tiny_llama\n"
              "from cache.paged_cache import CacheConfig\n"
              "from cache.runner import Runner\n"
              "Runner(make_tiny_llama(), cache_config=CacheConfig(block_size=8), controller=make_controller('ranker'),"
              " budget=0.3, prefill_chunk=32).run(list(range(2, 150)), max_new_tokens=4)")
    assert modules_after(decide) == "[]"
    assert modules_after("import kvgym") == "['gymnasium', 'kvgym']"
