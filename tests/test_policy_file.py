"""The policy files' shared pieces: one error class for every format, and the atomic write."""
import os
import stat

import pytest

from agents.policy_file import PolicyFileError, atomic_write
from agents.ranker import model as ranker_model


def test_the_policy_format_refuses_with_the_one_error_class():
    assert ranker_model.PolicyFileError is PolicyFileError


def test_atomic_write_replaces_the_file_only_when_the_write_completes(tmp_path):
    path = tmp_path / "sub" / "policy.pt"
    with atomic_write(path, ".pt") as tmp:
        assert os.path.dirname(tmp) == str(path.parent)  # beside the target: os.replace stays on one filesystem
        open(tmp, "w").write("first")
    assert path.read_text() == "first"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644

    with pytest.raises(RuntimeError, match="killed"):
        with atomic_write(path, ".pt") as tmp:
            open(tmp, "w").write("half of the seco")
            raise RuntimeError("killed mid-write")
    assert path.read_text() == "first"  # the old file, whole
    assert sorted(p.name for p in path.parent.iterdir()) == ["policy.pt"]  # no temporary left behind
