"""Where the command line's JSON reports go (one writer for every command and benchmark script)."""

from __future__ import annotations

import json
from pathlib import Path


def write_json(report: dict | list, path: Path) -> None:
    """Write ``report`` as indented JSON to ``path`` (its folder created; numpy numbers as numbers)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=lambda o: o.item() if hasattr(o, "item") else str(o)))
    print(f"wrote {path}")
