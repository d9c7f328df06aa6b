"""``kvgym train``: MaskablePPO with the slot-scorer policy on the replay env, evaluated live.

A run lives in ``<runs_dir>/<name>/``:

- ``config.yaml`` (the resolved config) and ``run.json`` (git commit, versions, start times);
- ``tb/``: TensorBoard events (SB3's ``rollout/``, ``train/``, ``time/``; kvgym's ``cache/`` reward components,
  KL, bytes moved, ops per step, fallbacks; ``eval/`` live reward and ``accuracy/`` of the policy and of each
  baseline on the same held-out episodes), with a custom-scalars layout;
- ``checkpoints/``: ``ppo_<steps>_steps.zip`` + ``ppo_vecnormalize_<steps>_steps.pkl`` every
  ``checkpoint_every`` steps; ``--resume`` continues from the newest readable pair;
- ``policy.zip``: the final policy in kvgym's format (``PPOController.load``); ``best/best_model.zip`` (SB3's).

Training steps the replay env (``kvgym traces build``; the traces are built first when missing), in
``n_envs`` copies under ``DummyVecEnv`` (no model in the loop), with ``VecNormalize`` on the rewards and on the
per-layer and global observation keys only (``blocks`` holds one-hots and per-slot features whose slot order
carries meaning, so it is left as is). An optional live fine-tune follows (``live_finetune_timesteps``, on the batched live vector env).
Evaluation runs the live env (the model decodes) on held-out sample seeds.
"""

from __future__ import annotations

import copy
import json
import math
import pickle
import platform
import re
import subprocess
import time
import zipfile
from pathlib import Path

import numpy as np
import yaml

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "train"

DEFAULTS: dict = {
    "name": "ppo",
    "runs_dir": "runs",
    "model": "smollm2-135m",
    "seed": 0,
    "total_timesteps": 100_000,
    "n_envs": 8,
    "checkpoint_every": 10_000,
    "live_finetune_timesteps": 0,
    "traces": {"dir": None, "tasks": ["passkey"], "lengths": [1024], "n": 4, "seed": 1000, "chat": False},
    "env": {"num_candidates": 32, "prefill_chunk": 64, "decide_every": 8, "budget_range": [0.125, 0.5],
            "lambda_bytes": 0.01, "kl_scale": 20.0, "mass_scale": 0.0, "merge_credit": 0.5, "max_episode_steps": 4096},
    "normalize": {"norm_obs_keys": ["layer_pressure", "globals"], "norm_reward": True, "clip_obs": 10.0,
                  "clip_reward": 10.0},
    "policy": {"hidden": 64, "keep_bias": 2.0},
    "imitation": {"teacher": None, "steps": 4000, "epochs": 10, "batch_size": 256, "learning_rate": 1e-3},
    "ppo": {"learning_rate": 3e-4, "n_steps": 256, "batch_size": 512, "n_epochs": 4, "gamma": 0.99,
            "gae_lambda": 0.95, "clip_range": 0.2, "ent_coef": 0.0, "vf_coef": 0.5, "max_grad_norm": 0.5,
            "target_kl": 0.03},
    "eval": {"every": 20_000, "episodes": 4, "seed": 424242, "tasks": ["passkey"], "lengths": [1024],
             "budget_range": [0.125, 0.5], "baselines": ["lru", "h2o", "streamingllm"], "chat": False},
}


# ---------------------------------------------------------------------- config
NULLABLE = {"traces.dir", "imitation.teacher", "ppo.target_kl"}  # keys that also take null


def _merge(base: dict, update: dict, where: str = "") -> dict:
    merged = copy.deepcopy(base)
    for key, value in update.items():
        name = f"{where}{key}"
        if key not in base:
            raise ValueError(f"config key {name!r} is unknown; known keys here: {sorted(base)}")
        if isinstance(base[key], dict):
            if not isinstance(value, dict):
                raise ValueError(f"config key {name!r} must be a mapping (keys {sorted(base[key])}), got {value!r}")
            merged[key] = _merge(base[key], value, f"{where}{key}.")
        elif value is None and name in NULLABLE:
            merged[key] = None
        else:
            merged[key] = _like(DEFAULTS_BY_KEY.get(name, base[key]), value, name)
    return merged


def _like(default, value, name: str):
    """``value`` for the key ``name`` whose default is ``default``, checked to be of the same kind: a number where
    the default is one (YAML reads ``1e-4`` as a string: accepted as a number), an integer where it is an
    integer, a list of the same kind of items, text. A ``ValueError`` naming the key, the value and the
    accepted type otherwise."""
    def refuse(kind: str):
        return ValueError(f"config key {name!r} must be {kind}, got {value!r}")

    if isinstance(default, list):
        if not isinstance(value, list):
            raise refuse(f"a list like {default!r}")
        return [_like(default[0], item, f"{name}[{i}]") for i, item in enumerate(value)] if default else value
    if default is None or isinstance(default, str):
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise refuse("text" + (" or null" if name in NULLABLE else ""))
        return str(value)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise refuse("true or false")
        return value
    number = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number):
        raise refuse(("an integer" if isinstance(default, int) else "a number")
                     + (" or null" if name in NULLABLE else ""))
    if isinstance(default, int):
        if not float(number).is_integer():
            raise refuse("an integer")
        return int(number)
    return float(number)


def _flatten(config: dict, where: str = "") -> dict:
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{where}{key}."))
        else:
            flat[f"{where}{key}"] = value
    return flat


# the type of each key comes from DEFAULTS, whatever an earlier layer (the YAML file) set it to
DEFAULTS_BY_KEY = _flatten(DEFAULTS)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple = ()) -> dict:
    """DEFAULTS, then the YAML file (a path, or a name under ``configs/train``), then ``key.sub=value``
    overrides (values parsed as YAML). Unknown keys are refused with the list of known ones."""
    config = copy.deepcopy(DEFAULTS)
    if path is not None:
        file = Path(path)
        if not file.is_file() and (CONFIG_DIR / f"{path}.yaml").is_file():
            file = CONFIG_DIR / f"{path}.yaml"
        if not file.is_file():
            raise FileNotFoundError(f"--config {path}: no such file (configs: "
                                    f"{sorted(p.stem for p in CONFIG_DIR.glob('*.yaml'))})")
        data = yaml.safe_load(file.read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{file}: expected a mapping of config keys")
        config = _merge(config, data)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r}: expected key=value, e.g. total_timesteps=5000 or ppo.n_steps=128")
        update: dict = {}
        node = update
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = yaml.safe_load(value)
        config = _merge(config, update)
    _check(config)
    return config


def _check(config: dict) -> None:
    """Values the types alone do not rule out; everything here fails before a run folder exists."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", str(config["name"])):
        raise ValueError(f"name {config['name']!r}: use letters, digits, '_', '-', '.' (it names runs/<name>/)")
    flat = _flatten(config)
    for key in ("total_timesteps", "n_envs", "checkpoint_every", "traces.n", "env.num_candidates",
                "env.prefill_chunk", "env.decide_every", "env.max_episode_steps", "policy.hidden", "ppo.n_steps",
                "ppo.batch_size", "ppo.n_epochs", "eval.episodes", "imitation.steps", "imitation.epochs",
                "imitation.batch_size"):
        if flat[key] < 1:
            raise ValueError(f"{key} must be a positive integer, got {flat[key]!r}")
    for key in ("eval.every", "live_finetune_timesteps"):
        if flat[key] < 0:
            raise ValueError(f"{key} must be an integer >= 0, got {flat[key]!r}")
    for key in ("ppo.learning_rate", "imitation.learning_rate"):
        if flat[key] <= 0:
            raise ValueError(f"{key} must be a positive number, got {flat[key]!r}")
    if not 0 < flat["ppo.gamma"] <= 1:
        raise ValueError(f"ppo.gamma must be in (0, 1], got {flat['ppo.gamma']!r}")
    for key in ("env.budget_range", "eval.budget_range"):
        value = flat[key]
        if len(value) != 2 or not 0 < value[0] <= value[1] <= 1:
            raise ValueError(f"{key} must be [low, high] with 0 < low <= high <= 1, got {value!r}")
    for key in ("traces.lengths", "eval.lengths"):
        if not flat[key] or min(flat[key]) < 1:
            raise ValueError(f"{key} must be a non-empty list of positive integers, got {flat[key]!r}")
    from eval.tasks.base import get_task

    for key in ("traces.tasks", "eval.tasks"):
        if not flat[key]:
            raise ValueError(f"{key} must name at least one task")
        for task in flat[key]:
            try:
                get_task(task)
            except ValueError as err:
                raise ValueError(f"{key}: {err}") from None
    ppo = config["ppo"]
    if (ppo["n_steps"] * config["n_envs"]) % ppo["batch_size"]:
        raise ValueError(f"ppo.batch_size {ppo['batch_size']} must divide ppo.n_steps × n_envs = "
                         f"{ppo['n_steps'] * config['n_envs']}")
    for key in config["normalize"]["norm_obs_keys"]:
        if key not in ("layer_pressure", "tier_occupancy", "globals", "blocks"):
            raise ValueError(f"normalize.norm_obs_keys: {key!r} is not an observation key")
    from agents.registry import make_controller
    from agents.scripted import make_policy

    for name in config["eval"]["baselines"]:
        try:
            make_controller(name)
        except ValueError as err:
            raise ValueError(f"eval.baselines: {err}") from None
    if config["imitation"]["teacher"]:
        try:
            make_policy(config["imitation"]["teacher"])
        except ValueError as err:
            raise ValueError(f"imitation.teacher: {err}") from None


def git_commit() -> str | None:
    """The checkout's commit hash, or None outside a git checkout."""
    try:
        root = Path(__file__).resolve().parents[2]
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


# ---------------------------------------------------------------------- envs
def trace_dir(config: dict) -> Path:
    """The folder of the recorded traces a training config names (its own, or one keyed by its settings)."""
    traces = config["traces"]
    if traces["dir"]:
        return Path(traces["dir"]).expanduser()
    from cache.models import kvgym_home

    return kvgym_home() / "traces" / config["name"]


def ensure_traces(config: dict, model=None, tokenizer=None) -> Path:
    """The config's trace folder, built (resumably) when its index is missing."""
    folder = trace_dir(config)
    if (folder / "index.json").is_file():
        return folder
    from kvgym.envs.traces import build_traces

    model, tokenizer = _model(config, model, tokenizer)
    traces = config["traces"]
    print(f"building replay traces in {folder} (tasks {traces['tasks']}, lengths {traces['lengths']}, n {traces['n']})")
    build_traces(model, tokenizer, list(traces["tasks"]), list(traces["lengths"]), int(traces["n"]),
                 int(traces["seed"]), folder, prefill_chunk=config["env"]["prefill_chunk"], chat=traces["chat"],
                 model_name=config["model"])
    return folder


def _model(config: dict, model, tokenizer):
    if model is not None:
        return model, tokenizer
    from cache.models import load_model

    loaded = load_model(config["model"])
    return loaded.model, loaded.tokenizer


def make_replay_env(config: dict, folder: Path):
    """The replay env a training config describes, wrapped for SB3 (time limit, monitor)."""
    from gymnasium.wrappers import TimeLimit
    from stable_baselines3.common.monitor import Monitor

    from kvgym.envs.replay import PagedKVCacheReplayEnv

    env_config = dict(config["env"])
    steps = env_config.pop("max_episode_steps")
    return Monitor(TimeLimit(PagedKVCacheReplayEnv(str(folder), **env_config), steps))


def live_env_kwargs(config: dict, tasks, lengths, budget_range, chat: bool) -> dict:
    """``PagedKVCacheEnv`` arguments: the given task mix, with the config's ``env`` settings."""
    env_config = config["env"]
    return dict(tasks=tuple(tasks), lengths=tuple(lengths), budget_range=tuple(budget_range),
                num_candidates=env_config["num_candidates"], prefill_chunk=env_config["prefill_chunk"],
                decide_every=env_config["decide_every"], lambda_bytes=env_config["lambda_bytes"], chat=chat)


def make_live_env(config: dict, model, tokenizer):
    """The live evaluation env: the ``eval`` task mix (held-out seeds), ``Monitor`` + ``TimeLimit``."""
    from gymnasium.wrappers import TimeLimit
    from stable_baselines3.common.monitor import Monitor

    from kvgym.envs.paged_kv import PagedKVCacheEnv

    evaluation = config["eval"]
    env = PagedKVCacheEnv(model, tokenizer, **live_env_kwargs(config, evaluation["tasks"], evaluation["lengths"],
                                                             evaluation["budget_range"], evaluation["chat"]))
    return Monitor(TimeLimit(env, config["env"]["max_episode_steps"]))


def _vec_normalize(venv, config: dict, training: bool = True):
    from stable_baselines3.common.vec_env import VecNormalize

    norm = config["normalize"]
    return VecNormalize(venv, training=training, norm_obs=bool(norm["norm_obs_keys"]),
                        norm_obs_keys=list(norm["norm_obs_keys"]) or None,
                        norm_reward=norm["norm_reward"] and training, clip_obs=norm["clip_obs"],
                        clip_reward=norm["clip_reward"], gamma=config["ppo"]["gamma"])


# ---------------------------------------------------------------------- callbacks
SCALAR_LAYOUT = {
    "kvgym": {
        "reward components": ["Multiline", ["cache/reward_kl", "cache/reward_mass", "cache/reward_bytes",
                                            "cache/reward_task"]],
        "KL and lost mass": ["Multiline", ["cache/kl", "cache/lost_mass"]],
        "operations per step": ["Multiline", ["cache/evict", "cache/merge", "cache/prefetch", "cache/fallbacks"]],
        "bytes moved (MB per step)": ["Multiline", ["cache/mb_moved"]],
        "accuracy vs baselines (live, held-out)": ["Multiline", ["accuracy/.*"]],
    }
}


def _callbacks():
    from sb3_contrib.common.maskable.callbacks import MaskableEvalCallback
    from stable_baselines3.common.callbacks import BaseCallback

    class CacheScalars(BaseCallback):
        """Means over each rollout of the envs' ``info``: the reward's terms as the env computed them
        (``kvgym.envs.reward``: ``cache/reward_<term>``), KL, bytes, ops, fallbacks."""

        def _on_step(self) -> bool:
            for info in self.locals["infos"]:
                if "reward_terms" not in info:
                    continue
                record = self.logger.record_mean
                for name, value in info["reward_terms"].items():
                    record(f"cache/reward_{name}", value)
                record("cache/kl", info["kl"])
                record("cache/mb_moved", info.get("bytes_moved", 0) / 2**20)
                record("cache/lost_mass", info.get("lost_mass", 0.0))
                record("cache/fallbacks", info.get("fallbacks", 0))
                record("cache/illegal_ops", info.get("illegal_ops", 0))
                for op in ("evict", "merge", "prefetch"):
                    record(f"cache/{op}", info.get("ops", {}).get(op, 0))
            return True

    class LiveEval(MaskableEvalCallback):
        """MaskableEvalCallback on the live env, re-seeded before every evaluation so each one sees the same
        held-out episodes; logs the policy's mean task score (``accuracy/ppo``) next to each baseline's on
        those episodes (``accuracy/<name>``, computed once), and the gap to the best one."""

        def __init__(self, eval_env, seed: int, baselines: dict[str, float], **kwargs):
            super().__init__(eval_env, **kwargs)
            self.seed, self.baselines, self.scores = seed, baselines, []

        def _log_success_callback(self, locals_, globals_):
            super()._log_success_callback(locals_, globals_)
            if locals_["done"]:
                self.scores.append(float(locals_["info"].get("task_score", 0.0)))

        def _on_step(self) -> bool:
            evaluating = self.eval_freq > 0 and self.n_calls % self.eval_freq == 0
            if evaluating:
                self.eval_env.seed(self.seed)
                self.scores = []
            keep_going = super()._on_step()
            if evaluating and self.scores:
                accuracy = float(np.mean(self.scores))
                self.logger.record("accuracy/ppo", accuracy)
                for name, value in self.baselines.items():
                    self.logger.record(f"accuracy/{name}", value)
                if self.baselines:
                    self.logger.record("accuracy/ppo_minus_best_baseline", accuracy - max(self.baselines.values()))
                self.logger.dump(self.num_timesteps)
            return keep_going

    return CacheScalars, LiveEval


def baseline_accuracy(config: dict, model, tokenizer, run_dir: Path) -> dict[str, float]:
    """Mean task score of each baseline on the live eval episodes (the same seeds as the policy's evaluation);
    cached in ``run_dir/baseline_accuracy.json``."""
    from agents.registry import make_controller

    evaluation = config["eval"]
    path = run_dir / "baseline_accuracy.json"
    key = {"seed": evaluation["seed"], "episodes": evaluation["episodes"], "tasks": evaluation["tasks"],
           "lengths": evaluation["lengths"], "budget_range": evaluation["budget_range"]}
    cached = json.loads(path.read_text()) if path.is_file() else {}
    if cached.get("key") != key:
        cached = {"key": key, "accuracy": {}}
    env = None
    for name in evaluation["baselines"]:
        if name in cached["accuracy"]:
            continue
        env = env or make_live_env(config, model, tokenizer).unwrapped  # one env: its full-cache references are reused
        scores = []
        for episode in range(evaluation["episodes"]):
            env.reset(seed=evaluation["seed"] if episode == 0 else None)
            controller = make_controller(name)
            info = {}
            while not env.done:
                info = env.step_decisions(controller.decide(env.cache_view()))[-1]
            scores.append(float(info.get("task_score", 0.0)))
        cached["accuracy"][name] = float(np.mean(scores))
        path.write_text(json.dumps(cached, indent=2))
    if env is not None:
        env.close()
    return {name: cached["accuracy"][name] for name in evaluation["baselines"]}


# ---------------------------------------------------------------------- checkpoints
def _checkpoint_pairs(run_dir: Path) -> list[tuple[int, Path, Path]]:
    """``(steps, model_zip, vecnormalize_pkl)`` of every checkpoint with both files, newest first."""
    pairs = []
    for path in (run_dir / "checkpoints").glob("ppo_*_steps.zip"):
        match = re.fullmatch(r"ppo_(\d+)_steps\.zip", path.name)
        stats = path.with_name(f"ppo_vecnormalize_{match.group(1)}_steps.pkl") if match else None
        if match and stats.is_file():
            pairs.append((int(match.group(1)), path, stats))
    return sorted(pairs, reverse=True)


def _checkpoint_problem(path: Path, stats: Path) -> str | None:
    """Why a checkpoint pair cannot be loaded, as far as reading its files tells (``None``: both read)."""
    try:  # a kill during a save leaves a truncated zip or pickle
        with zipfile.ZipFile(path) as archive:
            if archive.testzip() is not None or "policy.pth" not in archive.namelist():
                return f"{path.name}: incomplete model archive"
    except (zipfile.BadZipFile, OSError) as err:
        return f"{path.name}: {err}"
    try:
        with open(stats, "rb") as f:
            pickle.load(f)
    except Exception as err:  # a damaged pickle raises anything: EOFError, UnpicklingError, ValueError, ...
        return f"{stats.name}: unreadable statistics ({type(err).__name__}: {err})"
    return None


def latest_checkpoint(run_dir: Path):
    """``(model_zip, vecnormalize_pkl, steps)`` of the newest checkpoint whose model archive and normalisation
    statistics both read, or None."""
    for steps, path, stats in _checkpoint_pairs(run_dir):
        problem = _checkpoint_problem(path, stats)
        if problem is None:
            return path, stats, steps
        print(f"skipping checkpoint {steps}: {problem}")
    return None


def _load_checkpoint(run_dir: Path, raw):
    """``(checkpoint, venv, agent)`` from the newest checkpoint whose statistics and model both load (a damaged
    one is skipped, with a message), or None when the run has no checkpoint; a ``ValueError`` listing why each
    failed when there are checkpoints but none loads."""
    from sb3_contrib import MaskablePPO
    from stable_baselines3.common.vec_env import VecNormalize

    failures = []
    for steps, path, stats in _checkpoint_pairs(run_dir):
        problem = _checkpoint_problem(path, stats)
        if problem is None:
            try:
                venv = VecNormalize.load(str(stats), raw)
                agent = MaskablePPO.load(str(path), env=venv, device="cpu")
                return (path, stats, steps), venv, agent
            except Exception as err:  # reported below; never a silent fresh start
                problem = f"{type(err).__name__}: {err}"
        print(f"--resume: skipping checkpoint {steps} ({problem})")
        failures.append(f"{steps} steps: {problem}")
    if failures:
        raise ValueError(f"--resume: no checkpoint in {run_dir / 'checkpoints'} loads:\n  " + "\n  ".join(failures))
    return None


# ---------------------------------------------------------------------- training
def train(config: dict, resume: bool = False, model=None, tokenizer=None, progress_bar: bool = True) -> Path:
    """Train (or resume) the run described by ``config``; returns the run folder. ``model``/``tokenizer`` replace
    ``config["model"]`` (tests pass a tiny model). The run folder is written only once the config has validated
    and the agent is built (on ``resume``, from the newest checkpoint that loads); ``run.json`` records the start
    after that."""
    import torch
    from sb3_contrib import MaskablePPO
    from stable_baselines3.common.callbacks import CallbackList, CheckpointCallback
    from stable_baselines3.common.logger import configure
    from stable_baselines3.common.vec_env import DummyVecEnv

    from agents.ppo.controller import save_policy
    from agents.ppo.policy import SlotScorerPolicy

    _check(config)
    run_dir = Path(config["runs_dir"]) / config["name"]
    if not resume and (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir()):
        raise FileExistsError(f"{run_dir} already holds a run; pass --resume to continue it, or another name=...")

    needs_model = config["eval"]["every"] > 0 or config["live_finetune_timesteps"] > 0
    if needs_model or not (trace_dir(config) / "index.json").is_file():
        model, tokenizer = _model(config, model, tokenizer)
    folder = ensure_traces(config, model, tokenizer)
    seed, n_envs = int(config["seed"]), int(config["n_envs"])
    raw = DummyVecEnv([lambda: make_replay_env(config, folder) for _ in range(n_envs)])
    loaded = _load_checkpoint(run_dir, raw) if resume else None
    if loaded:
        checkpoint, venv, agent = loaded
    else:
        if resume:
            print(f"--resume: no checkpoint in {run_dir / 'checkpoints'}; starting from scratch")
        checkpoint = None
        venv = _vec_normalize(raw, config)
        agent = MaskablePPO(SlotScorerPolicy, venv, policy_kwargs=dict(config["policy"]), seed=seed, device="cpu",
                            verbose=0, **config["ppo"])

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    run_info = json.loads((run_dir / "run.json").read_text()) if (run_dir / "run.json").is_file() else {"starts": []}
    run_info.update(commit=git_commit(), python=platform.python_version(), torch=torch.__version__)
    run_info["starts"].append({"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "resumed_from": str(checkpoint[0])
                               if checkpoint else None, "commit": run_info["commit"]})
    (run_dir / "run.json").write_text(json.dumps(run_info, indent=2))
    agent.set_logger(configure(str(run_dir / "tb"), ["tensorboard", "csv"]))
    if not checkpoint and config["imitation"]["teacher"]:
        _imitate(agent, venv, config, folder, run_dir)
    _write_layout(run_dir / "tb")

    CacheScalars, LiveEval = _callbacks()
    callbacks = [CacheScalars(),
                 CheckpointCallback(max(config["checkpoint_every"] // n_envs, 1), str(run_dir / "checkpoints"),
                                    name_prefix="ppo", save_vecnormalize=True)]
    if config["eval"]["every"] > 0:
        baselines = baseline_accuracy(config, model, tokenizer, run_dir)
        eval_env = _vec_normalize(DummyVecEnv([lambda: make_live_env(config, model, tokenizer)]),
                                  config, training=False)
        callbacks.append(LiveEval(eval_env, config["eval"]["seed"], baselines,
                                  n_eval_episodes=config["eval"]["episodes"],
                                  eval_freq=max(config["eval"]["every"] // n_envs, 1),
                                  best_model_save_path=str(run_dir / "best"), log_path=str(run_dir / "eval"),
                                  deterministic=True, verbose=0))
    remaining = config["total_timesteps"] - agent.num_timesteps
    extra = {"config": config, "commit": run_info["commit"]}
    if remaining > 0:
        agent.learn(remaining, callback=CallbackList(callbacks), reset_num_timesteps=False,
                    progress_bar=progress_bar)
    save_policy(agent, run_dir / "policy_replay.zip", venv, {**extra, "timesteps": agent.num_timesteps})

    live_steps = int(config["live_finetune_timesteps"])
    if live_steps > 0:  # n_envs live episodes on the training tasks, one batched forward per step
        from stable_baselines3.common.vec_env import VecMonitor

        from kvgym.envs.vector import PagedKVCacheVecEnv

        traces = config["traces"]
        batched = PagedKVCacheVecEnv(
            n_envs, model=model, tokenizer=tokenizer, max_episode_steps=config["env"]["max_episode_steps"],
            **live_env_kwargs(config, traces["tasks"], traces["lengths"], config["env"]["budget_range"],
                              traces["chat"]))
        live = _vec_normalize(VecMonitor(batched), config)
        live.obs_rms, live.ret_rms = venv.obs_rms, venv.ret_rms
        live.seed(seed + 10_000)
        agent.set_env(live)
        agent.learn(live_steps, callback=CallbackList(callbacks[:1]), reset_num_timesteps=False,
                    progress_bar=progress_bar)
        venv = live
    path = save_policy(agent, run_dir / "policy.zip", venv, {**extra, "timesteps": agent.num_timesteps})
    print(f"policy written to {path} ({agent.num_timesteps} timesteps); TensorBoard: tensorboard --logdir "
          f"{config['runs_dir']}")
    return run_dir


def _imitate(agent, venv, config: dict, folder: Path, run_dir: Path) -> None:
    """Behaviour-clone the configured teacher before PPO (``agents.ppo.imitation``); logs ``imitation/*``."""
    from agents.ppo.imitation import clone, collect

    settings = config["imitation"]
    env = make_replay_env(config, folder).unwrapped
    data = collect(env, settings["teacher"], int(settings["steps"]), seed=int(config["seed"]))
    losses = clone(agent, venv, data, epochs=int(settings["epochs"]), batch_size=int(settings["batch_size"]),
                   learning_rate=float(settings["learning_rate"]), seed=int(config["seed"]))
    actions, _ = agent.predict(venv.normalize_obs(data["observations"]), action_masks=data["masks"],
                               deterministic=True)
    agreement = float((actions == data["actions"]).mean())
    for epoch, loss in enumerate(losses):
        agent.logger.record("imitation/loss", loss)
        agent.logger.dump(epoch)
    agent.logger.record("imitation/agreement", agreement)
    agent.logger.dump(len(losses))
    (run_dir / "imitation.json").write_text(json.dumps({"teacher": settings["teacher"], "samples": len(data["actions"]),
                                                        "losses": losses, "agreement": agreement}, indent=2))
    print(f"imitation of {settings['teacher']}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, agreement {agreement:.3f}")


def _write_layout(log_dir: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(log_dir))
    writer.add_custom_scalars(SCALAR_LAYOUT)
    writer.close()
