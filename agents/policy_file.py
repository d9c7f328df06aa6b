"""What every policy file of kvgym shares: one error for a file that cannot be used, the checksum of its
weights, and an atomic write (a kill leaves the old file or the new one, never half of it).

The formats themselves stay with the policy (``agents.ranker``): the ranker's torch file, and its PPO zip,
SB3's ``model.save`` plus one JSON entry (``save_sb3_zip``)."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class PolicyFileError(ValueError):
    """A policy file that cannot be used: missing, corrupt, foreign, failing its checksum, or made for other
    features or spaces than this kvgym computes."""


def sha256_hex(data: bytes) -> str:
    """The sha256 of ``data`` as hex digits."""
    return hashlib.sha256(data).hexdigest()


@contextmanager
def atomic_write(path: str | Path, suffix: str) -> Iterator[str]:
    """A temporary file beside ``path`` to write; when the block ends without error it replaces ``path``
    (readable by everyone: ``mkstemp`` makes it private, a policy file is meant to be shared), otherwise it is
    removed and ``path`` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=suffix, dir=path.parent)
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def save_sb3_zip(model, path: str | Path, entry: str, meta: dict) -> Path:
    """SB3's ``model.save`` to ``path`` (atomically) plus the JSON entry ``entry``: ``meta`` with the sha256 of
    the zip's ``policy.pth`` as ``policy_sha256``, which the loaders check before reading any weight."""
    path = Path(path)
    with atomic_write(path, ".zip") as tmp:
        model.save(tmp)
        with zipfile.ZipFile(tmp) as archive:
            weights = archive.read("policy.pth")
        meta = {**meta, "policy_sha256": sha256_hex(weights)}
        with zipfile.ZipFile(tmp, "a", compression=zipfile.ZIP_DEFLATED) as archive:
            archive.writestr(entry, json.dumps(meta, indent=2, default=str))
    return path
