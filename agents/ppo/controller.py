"""A trained PPO policy as a cache ``Controller``, and the policy file it loads.

The policy file is SB3's ``model.save`` zip (so ``MaskablePPO.load`` still opens it) with one more entry,
``kvgym_policy.json``: the observation layout (layers, candidates, feature names), the VecNormalize statistics
of the normalised keys, the policy's hyper-parameters, the sha256 of ``policy.pth``, and the run's config and
commit. ``PPOController.load`` reads only that entry and ``policy.pth`` (``weights_only``: no pickled code),
rebuilds the actor in plain torch and picks, per candidate slot, the best legal op (masked argmax): no env, no
SB3 ``predict``. A file that is not a zip, lacks the entry, fails its checksum, or whose spaces do not fit the
cache is refused with a ``PolicyFileError`` before anything is used.
"""

from __future__ import annotations

import io
import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from agents.policy_file import PolicyFileError, save_sb3_zip, sha256_hex
from agents.ppo.network import (
    OBSERVATION_KEYS,
    SlotNetwork,
    SlotOpHead,
    flatten_observation,
    masked_argmax,
    observation_sizes,
)
from agents.ranker.model import PPO_ENTRY as RANKER_PPO_ENTRY
from cache.controller import CacheView, Decision
from kvgym.envs.observation import (
    BLOCK_FEATURES,
    FALLBACK_RULE,
    GLOBAL_FEATURES,
    NUM_OPS,
    decode_action,
    encode,
)

POLICY_ENTRY = "kvgym_policy.json"
POLICY_FORMAT = "kvgym-ppo-policy"
POLICY_VERSION = 1
SENTENCE = BLOCK_FEATURES.index("sentence_boundary")


def save_policy(model, path: str | Path, vecnormalize=None, extra: dict | None = None) -> Path:
    """Write ``model`` (a MaskablePPO with ``SlotScorerPolicy``) and the normalisation statistics of
    ``vecnormalize`` to ``path`` (atomically: a kill leaves the old file or the new one, never half of it)."""
    policy = model.policy
    normalisation = {}
    if vecnormalize is not None and vecnormalize.norm_obs:
        for key in vecnormalize.norm_obs_keys:
            stats = vecnormalize.obs_rms[key]
            normalisation[key] = {"mean": np.asarray(stats.mean, np.float64).tolist(),
                                  "var": np.asarray(stats.var, np.float64).tolist()}
    meta = {
        "format": POLICY_FORMAT, "version": POLICY_VERSION,
        "num_layers": policy.num_layers, "num_candidates": policy.num_candidates, "num_ops": NUM_OPS,
        "block_features": list(BLOCK_FEATURES), "global_features": list(GLOBAL_FEATURES),
        "hidden": policy.hidden, "keep_bias": policy.keep_bias,
        "normalisation": normalisation,
        "clip_obs": float(vecnormalize.clip_obs) if vecnormalize is not None else None,
        "epsilon": float(vecnormalize.epsilon) if vecnormalize is not None else 1e-8,
        "sentence_features": False,
        "fallback_rule": FALLBACK_RULE,
        **(extra or {}),
    }
    return save_sb3_zip(model, path, POLICY_ENTRY, meta)


def read_policy(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(meta, state_dict)`` of a policy file, checked; ``PolicyFileError`` otherwise."""
    path = Path(path)
    if not path.is_file():
        raise PolicyFileError(f"policy file {path} does not exist (train one with `kvgym train`)")
    try:
        with zipfile.ZipFile(path) as archive:
            names = set(archive.namelist())
            if RANKER_PPO_ENTRY in names:
                raise PolicyFileError(f"{path} is a ranking policy (`kvgym ranker ppo`), not a slot policy: load it "
                                      f"as ranker:{path}")
            if POLICY_ENTRY not in names or "policy.pth" not in names:
                raise PolicyFileError(f"{path} is not a kvgym policy: it lacks {POLICY_ENTRY} or policy.pth "
                                      "(save policies with kvgym train / agents.ppo.controller.save_policy)")
            meta = json.loads(archive.read(POLICY_ENTRY))
            weights = archive.read("policy.pth")
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, json.JSONDecodeError, KeyError) as error:
        raise PolicyFileError(f"policy file {path} is corrupt ({type(error).__name__}: {error}); refusing it") from error
    if meta.get("format") != POLICY_FORMAT or meta.get("version") != POLICY_VERSION:
        raise PolicyFileError(f"{path}: format {meta.get('format')!r} v{meta.get('version')!r}; this kvgym reads "
                              f"{POLICY_FORMAT!r} v{POLICY_VERSION}")
    if sha256_hex(weights) != meta.get("policy_sha256"):
        raise PolicyFileError(f"policy file {path}: policy.pth does not match its recorded sha256; refusing it")
    expected = {"block_features": list(BLOCK_FEATURES), "global_features": list(GLOBAL_FEATURES), "num_ops": NUM_OPS}
    for key, value in expected.items():
        if meta.get(key) != value:
            raise PolicyFileError(f"{path}: the policy was trained with {key} = {meta.get(key)!r}; this kvgym's "
                                  f"observation has {value!r}")
    try:
        state = torch.load(io.BytesIO(weights), map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - any failure to unpickle means the file is unusable
        raise PolicyFileError(f"policy file {path}: policy.pth cannot be read ({error}); refusing it") from error
    return meta, state


@dataclass
class PPOController:
    """A trained policy file (``kvgym train``) as a controller: ``PPOController.load(path)`` or the spec
    ``ppo:PATH`` (``kvgym generate --controller ppo:PATH``, ``kvgym eval --controllers ppo:PATH,lru``)."""

    path: str
    _meta: dict = field(init=False, repr=False)
    positional_parameter = "path"  # the spec ppo:PATH

    def __post_init__(self):
        meta, state = read_policy(self.path)
        self._meta = meta
        self.num_layers, self.num_candidates = int(meta["num_layers"]), int(meta["num_candidates"])
        self.network = SlotNetwork(self.num_layers, self.num_candidates, int(meta["hidden"]))
        self.head = SlotOpHead(int(meta["hidden"]), float(meta["keep_bias"]))
        try:
            self.network.load_state_dict(_prefixed(state, "mlp_extractor."), strict=True)
            self.head.load_state_dict(_prefixed(state, "action_net."), strict=True)
        except RuntimeError as error:
            raise PolicyFileError(f"policy file {self.path}: its weights do not fit the recorded network "
                                  f"({error}); refusing it") from error
        self.network.eval()
        self.head.eval()
        self._normalisation = {key: (torch.tensor(value["mean"], dtype=torch.float32),
                                     torch.tensor(value["var"], dtype=torch.float32).add(float(meta["epsilon"])).sqrt())
                               for key, value in meta.get("normalisation", {}).items()}
        sizes = observation_sizes(self.num_layers, self.num_candidates)
        for key, (mean, _) in self._normalisation.items():
            if key not in sizes or mean.shape[0] != sizes[key]:
                raise PolicyFileError(f"policy file {self.path}: normalisation of {key!r} has {mean.shape[0]} "
                                      f"values, the observation {sizes.get(key)}")
        self._clip = meta.get("clip_obs")
        # the budget fallback the policy trained with (the Runner uses it when this controller drives)
        self.fallback_rule = meta.get("fallback_rule", "lowest_mass")

    @classmethod
    def load(cls, path: str | Path) -> PPOController:
        return cls(str(path))

    @property
    def meta(self) -> dict:
        return dict(self._meta)

    def check_fits(self, num_layers: int) -> None:
        if num_layers != self.num_layers:
            raise PolicyFileError(f"policy file {self.path} was trained for a {self.num_layers}-layer model; the "
                                  f"cache has {num_layers} layers (its observation space differs); train a policy "
                                  "for this model")

    def prepare(self, observation: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """One raw observation as the policy saw it in training: ``[1, n]`` tensors, the normalised keys
        normalised with the run's VecNormalize statistics (and clipped), sentence boundaries zeroed when the
        training envs had none."""
        tensors = {key: torch.as_tensor(np.asarray(observation[key]), dtype=torch.float32).reshape(1, -1)
                   for key in OBSERVATION_KEYS}
        if not self._meta.get("sentence_features", False):
            blocks = tensors["blocks"].reshape(1, self.num_candidates, len(BLOCK_FEATURES)).clone()
            blocks[..., SENTENCE] = 0.0
            tensors["blocks"] = blocks.reshape(1, -1)
        for key, (mean, std) in self._normalisation.items():
            value = (tensors[key] - mean) / std
            tensors[key] = value.clamp(-self._clip, self._clip) if self._clip is not None else value
        return tensors

    @torch.no_grad()
    def act(self, observation: dict[str, np.ndarray], mask: np.ndarray) -> np.ndarray:
        """Ops ``[K]`` for one raw (unnormalised) observation and its ``[K, 4]`` (or flat) mask: the best legal
        op per slot (the deterministic action of the trained policy)."""
        logits = self.head(self.network.forward_actor(flatten_observation(self.prepare(observation))))
        mask = torch.as_tensor(np.asarray(mask, bool)).reshape(1, -1)
        return masked_argmax(logits, mask)[0].numpy()

    def decide(self, view: CacheView) -> list[Decision]:
        self.check_fits(view.num_layers)
        cache = view.cache
        total = max(int(cache.config.max_tokens or view.seen), 1)
        budget_fraction = float(view.budget_blocks.float().mean()) * cache.block_size / total
        full_bytes = total * cache.bytes_per_token * view.num_layers
        moved = sum(cache.bytes_moved.values()) / max(full_bytes, 1)
        encoded = encode(view, self.num_candidates, view.seen / total, min(budget_fraction, 1.0), moved)
        decisions, _ = decode_action(self.act(encoded.observation, encoded.mask), encoded)
        return decisions


def _prefixed(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {key[len(prefix):]: value for key, value in state.items() if key.startswith(prefix)}
