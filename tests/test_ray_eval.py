"""``kvgym eval --ray``: a local two-worker Ray gives the records a sequential run gives, and a worker killed
mid-grid loses no finished run (the tiny folder model; custom samples from a tasks file)."""

import json
import os
import signal

import pytest

ray = pytest.importorskip("ray")

TIMING = ("ttft_ms", "decode_ms_per_token")


def tasks_file(tmp_path, count=4):
    path = tmp_path / "toy.jsonl"
    lines = []
    for index in range(count):
        filler = " ".join(f"word{(index * 7 + k) % 13}" for k in range(40))
        lines.append(json.dumps({"context": f"{filler} The code is {1000 + index}. {filler}",
                                 "question": " What is the code?", "answer_prefix": " The code is",
                                 "outputs": [str(1000 + index)], "metric": "string_match_all", "max_new_tokens": 4}))
    path.write_text("\n".join(lines) + "\n")
    return path


def grid(loaded, path, out, ray_settings=None):
    from eval.harness import evaluate

    evaluate(loaded.model, loaded.tokenizer, "lru,tova", "0.5", None, [], 1, 0, out, tasks_file=path, chat=False,
             block_size=8, prefill_chunk=32, progress=False, plots=False, ray=ray_settings)
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    return {(r["controller"], r["budget"], r["index"]): r for r in rows}, len(rows)


def same(a: dict, b: dict) -> bool:
    for field in a.keys() | b.keys():
        if field in TIMING:
            continue
        x, y = a.get(field), b.get(field)
        if isinstance(x, float) and isinstance(y, float):
            if x != pytest.approx(y, rel=1e-4, abs=1e-7):
                return False
        elif x != y:
            return False
    return True


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_ray_records_equal_a_sequential_run_and_survive_a_killed_worker(tiny_checkpoint, tmp_path, local_ray,
                                                                        monkeypatch):
    import psutil
    import torch

    import eval.ray_eval as ray_eval
    from cache.models import load_model

    torch.set_num_threads(1)  # the workers run one thread each: the same arithmetic
    loaded = load_model(str(tiny_checkpoint))
    path = tasks_file(tmp_path)
    sequential, count = grid(loaded, path, tmp_path / "sequential")
    assert count == 4 * 3

    original, killed = ray_eval.run_on_ray, []

    def kill_a_worker_after_the_first_sample(ray_settings, settings, pending):
        for number, pair in enumerate(original(ray_settings, settings, pending)):
            if number == 0:  # a worker's process dies while the others' samples are in flight
                workers = [p for p in psutil.process_iter(["cmdline"]) if "EvalWorker" in " ".join(p.info["cmdline"] or [])]
                os.kill(workers[-1].pid, signal.SIGKILL)
                killed.append(workers[-1].pid)
            yield pair

    monkeypatch.setattr(ray_eval, "run_on_ray", kill_a_worker_after_the_first_sample)
    settings = {"address": "local", "workers": 2, "model": str(tiny_checkpoint), "device": "cpu", "dtype": None}
    distributed, count = grid(loaded, path, tmp_path / "ray", settings)
    assert killed and count == 4 * 3  # every run once: none lost, none duplicated
    assert distributed.keys() == sequential.keys()
    assert all(same(sequential[key], distributed[key]) for key in sequential)
    # negative control: the comparison notices a changed answer
    changed = dict(distributed[next(iter(distributed))], text="something else")
    assert not same(sequential[next(iter(distributed))], changed)
    # resume: a rerun finds every record and runs nothing
    again, count = grid(loaded, path, tmp_path / "ray", settings)
    assert count == 4 * 3
