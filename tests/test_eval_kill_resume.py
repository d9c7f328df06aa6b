"""An eval killed with SIGKILL at random points, 20 times, then resumed: no finished record is lost, none is
duplicated, and the finished folder holds exactly the grid (issue 41). The grid is short and runs on the tiny
random Llama saved as a folder model; each kill lands somewhere between the start of the process and the end
of a full run (records are appended one line at a time, as each run ends)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter

GRID = ["--controllers", "lru,h2o,tova", "--budgets", "0.25,0.5", "--tasks", "passkey", "--lengths", "256",
        "--n", "4", "--no-chat", "--no-plots", "--protocol", "streaming"]


def _keys(path) -> list[tuple]:
    if not path.is_file():
        return []
    keys = []
    text = path.read_text()
    lines = text.splitlines()
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            assert number == len(lines) and not text.endswith("\n"), f"line {number} is damaged, not the last"
            continue  # the interrupted last write: dropped on resume
        keys.append((record["controller"], record["budget"], record["index"]))
    return keys


def test_sigkill_at_random_points_loses_and_duplicates_nothing(tiny_checkpoint, tmp_path):
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "kvgym.cli", "eval", "--model", str(tiny_checkpoint), *GRID, "--out", str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    subprocess.run(argv, env=env, check=True, capture_output=True, cwd=tmp_path, timeout=600)
    full_run = time.perf_counter() - start
    wanted = set(_keys(out / "samples.jsonl"))
    assert len(wanted) == 4 * (1 + 3 * 2)
    (out / "samples.jsonl").unlink()

    rng = random.Random(0)
    finished: set[tuple] = set()
    for _ in range(20):
        process = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(rng.uniform(0.3, 1.0) * full_run)
        process.send_signal(signal.SIGKILL)
        process.wait()
        keys = _keys(out / "samples.jsonl")
        duplicated = [key for key, count in Counter(keys).items() if count > 1]
        assert not duplicated, duplicated
        assert finished <= set(keys), finished - set(keys)  # nothing finished is lost
        finished = set(keys)
    subprocess.run(argv, env=env, check=True, capture_output=True, cwd=tmp_path, timeout=600)
    keys = _keys(out / "samples.jsonl")
    assert sorted(keys) == sorted(wanted) and len(keys) == len(set(keys))
