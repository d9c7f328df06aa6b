"""``kvgym train``: the ranking policy's whole training from one config, resumable at every stage.

A config (``configs/train/<name>.yaml``, or a path; ``key.sub=value`` overrides on the command line) names:

1. **collect**: the samples whose decision points are recorded (``kvgym.envs.decisions.collect``): sets of task
   families × lengths × seeds, plain or chat, for ``train`` and for ``validation`` (which picks the
   checkpoint), with the streaming states of the ``drivers``;
2. **train**: the imitation warm start (listwise, on the future-attention oracle) and the policy-gradient
   stage on the exact regret (``agents.ranker.train``);
3. **ppo** (when ``ppo.timesteps`` > 0): SB3's PPO on the replay of decision points, from the best file so far
   (``agents.ranker.ppo``).

A run lives in ``<runs_dir>/<name>/``: ``config.yaml`` (the resolved config), ``data/{train,validation}/`` (the
decision points, unless ``data_dir`` points elsewhere), ``ranker/`` and ``ppo/`` (each stage's files, metrics
and TensorBoard events: ``kvgym tensorboard --logdir runs``), and ``policy.pt``, the final policy, which loads
as ``ranker:<runs_dir>/<name>/policy.pt``. Collection keeps the files it has written; ``--resume`` continues the
stage a kill interrupted from its last checkpoint (an epoch of the warm start / policy gradient, or PPO's
``last.zip``). Without ``--resume`` a folder that already holds a run is refused, not overwritten.
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import yaml

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "train"
SPLITS = ("train", "validation")

SET_DEFAULTS = {"tasks": ["families_train"], "lengths": [2048], "n": 4, "seed": 201, "chat": False}
DEFAULTS: dict = {
    "name": "ranker",
    "model": "smollm2-135m",
    "runs_dir": "runs",
    "data_dir": "",  # "" = <runs_dir>/<name>/data
    "collect": {
        "drivers": ["quest", "tova"], "streaming_budgets": [0.25, 0.125], "host_blocks": 512, "block_size": 16,
        "train": [dict(SET_DEFAULTS)], "validation": [{**SET_DEFAULTS, "n": 2, "seed": 205}],
    },
    "train": {"warm_epochs": 30, "rl_epochs": 0, "budgets": [0.0625, 0.125, 0.25, 0.5], "drop_features": [],
              "hidden": 64, "lr": 3e-3, "rl_lr": 1e-3, "samples": 8, "batch": 256, "seed": 0},
    "ppo": {"timesteps": 0, "envs": 8, "group": 8, "n_steps": 256, "batch": 256, "epochs": 4, "lr": 1e-4,
            "log_std_init": 0.0, "eval_every": 50_000, "seed": 0},
}


# ------------------------------------------------------------------------------------------------ config
def load_config(path: str | Path | None = None, overrides: list[str] | tuple = ()) -> dict:
    """``DEFAULTS``, then the YAML file (a path, or a name under ``configs/train``), then ``key.sub=value``
    overrides (values parsed as YAML). Unknown keys and values of the wrong kind are refused with a
    ``ValueError`` naming the key and what it accepts."""
    config = copy.deepcopy(DEFAULTS)
    if path is not None:
        file = Path(path)
        if not file.is_file() and (CONFIG_DIR / f"{path}.yaml").is_file():
            file = CONFIG_DIR / f"{path}.yaml"
        if not file.is_file():
            raise ValueError(f"--config {path}: no such file (configs: {sorted(p.stem for p in CONFIG_DIR.glob('*.yaml'))})")
        try:
            data = yaml.safe_load(file.read_text()) or {}
        except yaml.YAMLError as error:
            raise ValueError(f"--config {file}: not valid YAML ({error})") from None
        if not isinstance(data, dict):
            raise ValueError(f"--config {file}: expected a mapping of config keys, got {type(data).__name__}")
        config = _merge(config, data, DEFAULTS)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"override {item!r}: expected key=value, e.g. train.warm_epochs=10 or name=try2")
        update: dict = {}
        node = update
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = yaml.safe_load(value)
        config = _merge(config, update, DEFAULTS)
    _check(config)
    return config


def _merge(base: dict, update: dict, defaults: dict, where: str = "") -> dict:
    merged = copy.deepcopy(base)
    for key, value in update.items():
        name = f"{where}{key}"
        if key not in defaults:
            raise ValueError(f"config key {name!r} is unknown; known keys here: {sorted(defaults)}")
        if isinstance(defaults[key], dict):
            if not isinstance(value, dict):
                raise ValueError(f"config key {name!r} must be a mapping (keys {sorted(defaults[key])}), got {value!r}")
            merged[key] = _merge(base[key], value, defaults[key], f"{name}.")
        elif name in ("collect.train", "collect.validation"):
            if not isinstance(value, list) or not value or not all(isinstance(item, dict) for item in value):
                raise ValueError(f"config key {name!r} must be a non-empty list of sample sets like {SET_DEFAULTS}, "
                                 f"got {value!r}")
            merged[key] = [_merge(SET_DEFAULTS, item, SET_DEFAULTS, f"{name}[{i}].") for i, item in enumerate(value)]
        else:
            merged[key] = _like(defaults[key], value, name)
    return merged


def _like(default, value, name: str):
    """``value`` for the key ``name`` whose default is ``default``, checked to be of the same kind (a number where
    the default is one, an integer where it is an integer, a list of the same kind of items, text, a boolean)."""
    def refuse(kind: str):
        return ValueError(f"config key {name!r} must be {kind}, got {value!r}")

    if isinstance(default, list):
        if not isinstance(value, list):
            raise refuse(f"a list like {default!r}")
        like = default[0] if default else ""  # an empty default list: a list of text
        return [_like(like, item, f"{name}[{i}]") for i, item in enumerate(value)]
    if isinstance(default, str):
        if not isinstance(value, str):
            raise refuse("text")
        return value
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise refuse("true or false")
        return value
    number = value
    if isinstance(value, str):  # YAML reads 1e-4 as text
        try:
            number = float(value)
        except ValueError:
            number = None
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number):
        raise refuse("an integer" if isinstance(default, int) else "a number")
    if isinstance(default, int):
        if not float(number).is_integer():
            raise refuse("an integer")
        return int(number)
    return float(number)


def _check(config: dict) -> None:
    """What the kinds alone do not rule out; all of it fails before a run folder or a model exists."""
    from agents.ranker.train import dropped_columns
    from agents.registry import make_controller
    from eval.tasks.base import get_task

    if not re.fullmatch(r"[A-Za-z0-9_.-]+", config["name"]):
        raise ValueError(f"name {config['name']!r}: use letters, digits, '_', '-', '.' (it names runs/<name>/)")
    collect, train, ppo = config["collect"], config["train"], config["ppo"]
    positive = {"collect.block_size": collect["block_size"], "train.hidden": train["hidden"],
                "train.samples": train["samples"], "train.batch": train["batch"], "ppo.envs": ppo["envs"],
                "ppo.group": ppo["group"], "ppo.n_steps": ppo["n_steps"], "ppo.batch": ppo["batch"],
                "ppo.epochs": ppo["epochs"], "ppo.eval_every": ppo["eval_every"], "train.lr": train["lr"],
                "train.rl_lr": train["rl_lr"], "ppo.lr": ppo["lr"]}
    for split in SPLITS:
        for i, item in enumerate(collect[split]):
            positive[f"collect.{split}[{i}].n"] = item["n"]
            if not item["lengths"] or min(item["lengths"]) < 64:
                raise ValueError(f"collect.{split}[{i}].lengths must be a non-empty list of lengths >= 64, "
                                 f"got {item['lengths']!r}")
            if not item["tasks"]:
                raise ValueError(f"collect.{split}[{i}].tasks must name at least one task")
            for task in item["tasks"]:
                try:
                    get_task(task)
                except ValueError as err:
                    raise ValueError(f"collect.{split}[{i}].tasks: {err}") from None
    for key, value in positive.items():
        if not value > 0:
            raise ValueError(f"{key} must be positive, got {value!r}")
    for key in ("train.warm_epochs", "train.rl_epochs", "collect.host_blocks", "ppo.timesteps"):
        section, field = key.split(".")
        if config[section][field] < 0:
            raise ValueError(f"{key} must be >= 0, got {config[section][field]!r}")
    if ppo["timesteps"] and not 2 <= ppo["batch"] <= ppo["envs"] * ppo["n_steps"]:
        raise ValueError(f"ppo.batch {ppo['batch']}: a minibatch of 2 to ppo.envs × ppo.n_steps = "
                         f"{ppo['envs'] * ppo['n_steps']} rankings")
    if ppo["timesteps"] and ppo["envs"] % ppo["group"]:
        raise ValueError(f"ppo.group {ppo['group']}: must divide ppo.envs ({ppo['envs']})")
    if train["warm_epochs"] + train["rl_epochs"] == 0:
        raise ValueError("train.warm_epochs and train.rl_epochs are both 0: an untrained file is not a policy")
    for key in ("collect.streaming_budgets", "train.budgets"):
        section, field = key.split(".")
        values = config[section][field]
        if not values or not all(0 < b <= 1 for b in values):
            raise ValueError(f"{key} must be a non-empty list of fractions in (0, 1], got {values!r}")
    try:
        dropped_columns(tuple(train["drop_features"]))
    except ValueError as err:
        raise ValueError(f"train.{err}") from None
    for spec in collect["drivers"]:
        try:
            make_controller(spec)
        except ValueError as err:
            raise ValueError(f"collect.drivers: {err}") from None
    seen: dict[tuple, str] = {}
    for split in SPLITS:  # one file name per (task, length, seed, index): two sets must not share a seed
        for i, item in enumerate(collect[split]):
            for task in item["tasks"]:
                for length in item["lengths"]:
                    key = (task, length, item["seed"])
                    if key in seen:
                        raise ValueError(f"collect.{split}[{i}] and {seen[key]} both draw {task} at {length} tokens "
                                         f"with seed {item['seed']}: give each set its own seed")
                    seen[key] = f"collect.{split}[{i}]"


# ------------------------------------------------------------------------------------------------ the run
def run_folder(config: dict) -> Path:
    """``<runs_dir>/<name>``."""
    return Path(config["runs_dir"]).expanduser() / config["name"]


def data_folder(config: dict) -> Path:
    """Where the decision points go: ``data_dir``, or the run's ``data/``."""
    return Path(config["data_dir"]).expanduser() if config["data_dir"] else run_folder(config) / "data"


def train_pipeline(config: dict, resume: bool = False, model=None, tokenizer=None, log=print) -> Path:
    """Run ``config``'s stages (see the module docstring); returns the final policy file. ``model`` /
    ``tokenizer``: an already loaded model (default: ``config["model"]``, loaded once; collection skips the files
    it has already written)."""
    from agents.ranker.model import load_ranker, save_ranker
    from agents.ranker.train import train
    from agents.registry import make_controller
    from kvgym.envs.decisions import collect, driver_name, load_records

    folder = run_folder(config)
    saved = folder / "config.yaml"
    if saved.exists() and not resume:
        raise ValueError(f"{folder} already holds a run: pass --resume to continue it, or name=<another name>")
    if resume and saved.exists():
        before, now = _flat(yaml.safe_load(saved.read_text())), _flat(config)
        changed = sorted(k for k in now if before.get(k) != now[k])
        if changed:
            log(f"resuming {folder} with changed settings: {', '.join(changed)}")
    folder.mkdir(parents=True, exist_ok=True)
    saved.write_text(yaml.safe_dump(config, sort_keys=False))

    settings = config["collect"]
    if model is None:
        from cache.models import load_model

        loaded = load_model(config["model"])
        model, tokenizer = loaded.model, loaded.tokenizer
    drivers = {driver_name(spec): make_controller(spec) for spec in settings["drivers"]}
    for split in SPLITS:
        for item in settings[split]:
            collect(model, tokenizer, item["tasks"], item["lengths"], item["n"], item["seed"], data_folder(config) / split,
                    chat=item["chat"], block_size=settings["block_size"], drivers=drivers,
                    streaming_budgets=tuple(settings["streaming_budgets"]), host_blocks=settings["host_blocks"], log=log)
    records = {split: load_records(sorted((data_folder(config) / split).glob("*.pt"))) for split in SPLITS}
    log(f"decision points: {len(records['train'])} train, {len(records['validation'])} validation "
        f"(from {data_folder(config)})")

    stage = config["train"]
    summary = train(records["train"], records["validation"], folder / "ranker", warm_epochs=stage["warm_epochs"],
                    rl_epochs=stage["rl_epochs"], samples=stage["samples"], batch=stage["batch"], lr=stage["lr"],
                    rl_lr=stage["rl_lr"], hidden=stage["hidden"], seed=stage["seed"],
                    drop_features=tuple(stage["drop_features"]), budgets=tuple(stage["budgets"]),
                    resume=resume and (folder / "ranker" / "last.pt").exists(), log=log)
    best = folder / "ranker" / "ranker.pt"
    ppo = config["ppo"]
    if ppo["timesteps"] > 0:
        from agents.ranker.ppo import train_ppo

        summary = train_ppo(records["train"], records["validation"], folder / "ppo", timesteps=ppo["timesteps"],
                            start=best, envs=ppo["envs"], n_steps=ppo["n_steps"], batch=ppo["batch"],
                            epochs=ppo["epochs"], lr=ppo["lr"], log_std_init=ppo["log_std_init"],
                            eval_every=ppo["eval_every"], hidden=stage["hidden"], group=ppo["group"], seed=ppo["seed"],
                            resume=resume, log=log)
        if (folder / "ppo" / "ranker.pt").is_file():
            best = folder / "ppo" / "ranker.pt"
    scorer, meta = load_ranker(best)
    policy = save_ranker(scorer, folder / "policy.pt", {**meta, "config": config["name"], "from": str(best)})
    (folder / "summary.json").write_text(json.dumps({"policy": str(policy), "from": str(best), **summary},
                                                    indent=2, default=str))
    log(f"policy: {policy} (load it as ranker:{policy})")
    return policy


def _flat(config: dict, where: str = "") -> dict:
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{where}{key}."))
        else:
            flat[f"{where}{key}"] = json.dumps(value)
    return flat

