"""``kvgym eval --ray [ADDRESS]``: the grid's samples sent to a Ray cluster (issue 40).

Each worker is a Ray actor that loads the model once (by name: an alias, a folder every node can read, or a hub
id) and runs whole samples: the full cache first, then every run of the sample the folder does not hold yet, with
the one-shot protocols' dense prefill shared as in a local run (``eval.harness.sample_records``, the same code).
The driver keeps the records: it appends each sample's records to ``samples.jsonl`` as the sample returns, so the
folder is resumable exactly as a local run's, and a worker that dies mid-sample is restarted and the sample run
again (nothing it finished is lost: finished samples are already on disk). Ray is imported only here, only when
``--ray`` is given. ``ADDRESS``: a running cluster (``ray start --head`` prints it; ``auto`` finds a local one);
without it a local Ray is started with one worker per CPU.
"""

from __future__ import annotations


class EvalWorker:
    """One model and one ``_Context``; ``run(item, seed, keys)`` → the sample's ``(key, record)`` list."""

    def __init__(self, model: str, device: str, dtype: str | None, settings: dict, threads: int):
        import torch

        from cache.models import load_model
        from eval.harness import _Context

        torch.set_num_threads(threads)
        loaded = load_model(model, device=device, dtype=dtype)
        self.context = _Context(loaded.model, loaded.tokenizer, **settings)  # the driver's run settings
        self.generators: dict = {}

    def run(self, item, seed: int, keys: list[tuple]) -> list[tuple[tuple, dict]]:
        from eval.harness import _make_sample, sample_records
        from eval.inputs import task_generator

        if item.sample is None and item.task not in self.generators:
            self.generators[item.task] = task_generator(item.task)
        sample, sample_seed_value = _make_sample(self.context, item, self.generators, seed)
        return list(sample_records(self.context, item, sample, sample_seed_value, keys))


def run_on_ray(ray_settings: dict, settings: dict, pending: list[tuple]):
    """Yield ``(key, record)`` of every pending ``(item, seed, keys)`` as its sample returns from a worker."""
    import ray
    from ray.util import ActorPool

    address = ray_settings.get("address")
    if not ray.is_initialized():
        if address in (None, "", "local"):
            ray.init(num_cpus=ray_settings.get("workers"), include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    cpus = int(ray.cluster_resources().get("CPU", 1))
    count = max(1, min(int(ray_settings.get("workers") or cpus), cpus, len(pending)))
    threads = max(1, cpus // count)
    worker = ray.remote(num_cpus=1, max_restarts=-1, max_task_retries=-1)(EvalWorker)
    actors = [worker.remote(ray_settings["model"], ray_settings.get("device", "cpu"), ray_settings.get("dtype"),
                            settings, threads) for _ in range(count)]
    pool = ActorPool(actors)
    try:
        for records in pool.map_unordered(lambda actor, job: actor.run.remote(*job), pending):
            yield from records
    finally:
        for actor in actors:
            ray.kill(actor)
