"""The ranking policy's network and its file.

``BlockScorer`` is one small MLP applied to every block's ``RANK_FEATURES`` row (shared across blocks and
layers, so it fits any context length and layer count): a keep score per block (the cache keeps each layer's
top-b) and a merge logit (merge instead of evict when the block falls out). Inputs are standardised with the
training set's mean and standard deviation, stored in the file.

The file is one ``torch.save`` of plain tensors and strings (``torch.load(weights_only=True)``: no pickled
code): ``format``, ``version``, the feature names, the architecture, the weights, the sha256 of the weights,
and the training run's summary. A file that is missing, corrupt, foreign, fails its checksum or names a feature
this kvgym does not compute is refused with a ``PolicyFileError`` before anything is used. A file trained on
fewer features (before later ones were added) loads with zero weight on the features it never saw: the same
function it was trained as (``lift_to_features``). ``load_ranker`` also reads the
scorer out of a PPO zip of ``agents.ranker.ppo`` (SB3's ``model.save`` plus a ``kvgym_ranker.json`` entry with
the features and the sha256 of ``policy.pth``), under the same checks, without importing SB3.
"""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

from agents.policy_file import PolicyFileError, atomic_write, sha256_hex
from cache.ranking import RANK_FEATURES

RANKER_FORMAT = "kvgym-ranker"
RANKER_VERSION = 1
PPO_FORMAT = "kvgym-ranker-ppo"  # an SB3 PPO zip of a RankingPolicy (agents.ranker.ppo) with this entry
PPO_ENTRY = "kvgym_ranker.json"


class BlockScorer(nn.Module):
    """Per-block MLP: ranking features in, a keep score and a merge logit out."""
    def __init__(self, num_features: int = len(RANK_FEATURES), hidden: int = 64):
        super().__init__()
        self.num_features, self.hidden = num_features, hidden
        self.register_buffer("feature_mean", torch.zeros(num_features))
        self.register_buffer("feature_std", torch.ones(num_features))
        self.body = nn.Sequential(nn.Linear(num_features, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.score = nn.Linear(hidden, 1)
        self.merge = nn.Linear(hidden, 1)
        nn.init.constant_(self.merge.bias, -3.0)  # evict unless taught otherwise

    def set_normalisation(self, features: torch.Tensor) -> None:
        """Standardise inputs with the mean and std of ``features`` ``[..., F]`` (constant columns: std 1)."""
        flat = features.reshape(-1, self.num_features).float()
        self.feature_mean.copy_(flat.mean(dim=0))
        std = flat.std(dim=0)
        self.feature_std.copy_(torch.where(std > 1e-6, std, torch.ones_like(std)))

    def forward(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[..., F]`` → keep scores and merge logits, each ``[...]``."""
        hidden = self.body((features.float() - self.feature_mean) / self.feature_std)
        return self.score(hidden).squeeze(-1), self.merge(hidden).squeeze(-1)

    def inference(self) -> NumpyScorer:
        """This network's current weights as a ``NumpyScorer`` (the same function, for deciding in the cache)."""
        return NumpyScorer(self)


class NumpyScorer:
    """A ``BlockScorer``'s forward in float32 without autograd (numpy arrays in and out; the products on torch's
    threads, the ``tanh`` in numpy), for the controller's decisions: the input standardisation
    is folded into the first layer and both heads are one matrix. Same function as the torch module (to float
    rounding), several times faster on a CPU thread (torch's CPU ``tanh`` alone costs ~0.7 ms on a 2k cache's
    3,840 × 64 activations, numpy's ~0.1 ms). A snapshot: later training of the module does not reach it."""

    def __init__(self, model: BlockScorer):
        first, second = model.body[0], model.body[2]
        weight = first.weight.detach().double() / model.feature_std.double()[None]
        self.w1 = weight.T.float().numpy().copy()
        self.b1 = (first.bias.detach().double() - weight @ model.feature_mean.double()).float().numpy()
        self.w2, self.b2 = second.weight.detach().T.numpy().copy(), second.bias.detach().numpy().copy()
        self.heads = torch.cat([model.score.weight, model.merge.weight]).detach().T.numpy().copy()  # [hidden, 2]
        self.heads_bias = torch.cat([model.score.bias, model.merge.bias]).detach().numpy().copy()

    def __call__(self, features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``[..., F]`` → keep scores and merge logits, each ``[...]`` (float32). The products run on torch's
        thread pool (on the same memory): numpy's BLAS brings a second pool, and with two threads each the pools
        stall one another (a 2k decision took 8 ms instead of 2 on this project's 2-core machines)."""
        hidden = np.tanh(_matmul(np.ascontiguousarray(features, np.float32), self.w1) + self.b1)
        hidden = np.tanh(_matmul(hidden, self.w2) + self.b2)
        out = _matmul(hidden, self.heads) + self.heads_bias
        return out[..., 0], out[..., 1]


def _matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return torch.matmul(torch.from_numpy(a), torch.from_numpy(b)).numpy()


def _weights_bytes(state: dict[str, torch.Tensor]) -> bytes:
    buffer = io.BytesIO()
    torch.save({name: state[name] for name in sorted(state)}, buffer)
    return buffer.getvalue()


def save_ranker(model: BlockScorer, path: str | Path, summary: dict | None = None) -> Path:
    """Write ``model`` to ``path`` atomically (a kill leaves the old file or the new one, never half of it)."""
    state = {name: tensor.detach().cpu().clone() for name, tensor in model.state_dict().items()}
    payload = {
        "format": RANKER_FORMAT, "version": RANKER_VERSION, "features": list(RANK_FEATURES),
        "hidden": model.hidden, "state_dict": state,
        "weights_sha256": sha256_hex(_weights_bytes(state)),
        "summary": json.dumps(summary or {}, default=str),
    }
    with atomic_write(path, ".pt") as tmp:
        torch.save(payload, tmp)
    return Path(path)


def _is_sb3_zip(path: Path) -> bool:
    """An SB3 ``model.save`` zip (a torch file is a zip too, without SB3's ``policy.pth``)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return "policy.pth" in archive.namelist()
    except (zipfile.BadZipFile, OSError):
        return False


def _read_ppo_zip(path: Path) -> dict:
    """A ranker payload (as ``save_ranker`` writes one) from a PPO zip of ``agents.ranker.ppo``: its
    ``kvgym_ranker.json`` entry and the scorer's weights out of SB3's ``policy.pth`` (``weights_only``)."""
    try:
        with zipfile.ZipFile(path) as archive:
            if PPO_ENTRY not in archive.namelist():
                raise PolicyFileError(f"{path} is an SB3 zip but not a kvgym ranking policy: it lacks {PPO_ENTRY} "
                                      "(train one with `kvgym train` or `python -m benchmarks.ranker_tools ppo`; the retired slot "
                                      "policies are no longer read)")
            meta = json.loads(archive.read(PPO_ENTRY))
            weights = archive.read("policy.pth")
    except (zipfile.BadZipFile, EOFError, OSError, json.JSONDecodeError, KeyError) as error:
        raise PolicyFileError(f"ranker file {path} is a corrupt zip ({type(error).__name__}); refusing it") from None
    if not isinstance(meta, dict) or meta.get("format") != PPO_FORMAT:
        raise PolicyFileError(f"{path} is not a kvgym ranking policy (format {PPO_FORMAT!r}; the retired slot "
                              "policies are no longer read)")
    if sha256_hex(weights) != meta.get("policy_sha256"):
        raise PolicyFileError(f"ranker file {path}: policy.pth does not match its recorded sha256; refusing it")
    try:
        policy = torch.load(io.BytesIO(weights), map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001  (torch raises many kinds for a damaged file)
        raise PolicyFileError(f"ranker file {path}: policy.pth cannot be read ({type(error).__name__})") from None
    state = {key.removeprefix("scorer."): value for key, value in policy.items() if key.startswith("scorer.")}
    return {**meta, "format": RANKER_FORMAT, "state_dict": state, "weights_sha256": sha256_hex(_weights_bytes(state)),
            "summary": json.dumps(meta.get("summary") or {})}


def load_ranker(path: str | Path) -> tuple[BlockScorer, dict]:
    """``(model, summary)`` from a ranker file (``save_ranker``'s, or a PPO zip of ``agents.ranker.ppo``), checked;
    ``PolicyFileError`` otherwise."""
    path = Path(path)
    if not path.is_file():
        raise PolicyFileError(f"ranker file {path} does not exist (train one with `kvgym train`)")
    payload = _read_ppo_zip(path) if _is_sb3_zip(path) else _read_torch_file(path)
    return _checked_model(path, payload)


def _read_torch_file(path: Path) -> dict:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001  (torch raises many kinds for a damaged file)
        raise PolicyFileError(f"ranker file {path} is corrupt or not a torch file ({type(error).__name__}); "
                              "refusing it") from None
    return payload


def _checked_model(path: Path, payload) -> tuple[BlockScorer, dict]:
    if not isinstance(payload, dict) or payload.get("format") != RANKER_FORMAT:
        raise PolicyFileError(f"{path} is not a kvgym ranker file (format {RANKER_FORMAT!r})")
    if payload.get("version") != RANKER_VERSION:
        raise PolicyFileError(f"{path}: ranker file version {payload.get('version')!r}; this kvgym reads "
                              f"v{RANKER_VERSION}")
    names = payload.get("features")
    unknown = [name for name in names or [] if name not in RANK_FEATURES] if isinstance(names, list) else names
    if not isinstance(names, list) or unknown or len(set(names)) != len(names):
        raise PolicyFileError(f"{path}: trained on block features this kvgym does not compute ({unknown!r}; it "
                              f"computes {', '.join(RANK_FEATURES)}); retrain it")
    state = payload.get("state_dict")
    if not isinstance(state, dict) or sha256_hex(_weights_bytes(state)) != payload.get("weights_sha256"):
        raise PolicyFileError(f"ranker file {path}: the weights do not match their recorded sha256; refusing it")
    model = BlockScorer(len(names), int(payload["hidden"]))
    try:
        model.load_state_dict(state)
    except RuntimeError as error:
        raise PolicyFileError(f"ranker file {path}: weights do not fit the network ({error})") from None
    model = lift_to_features(model, names)
    model.eval()
    return model, json.loads(payload.get("summary") or "{}")


def lift_to_features(model: BlockScorer, names: list[str]) -> BlockScorer:
    """``model`` (inputs: the features ``names``, a subset of ``RANK_FEATURES``) as a ``BlockScorer`` over all of
    ``RANK_FEATURES``, computing the same function: each input column moves to its feature's place, and a feature
    ``names`` lacks gets zero weight (mean 0, std 1)."""
    if list(names) == list(RANK_FEATURES):
        return model
    lifted = BlockScorer(len(RANK_FEATURES), model.hidden)
    columns = [RANK_FEATURES.index(name) for name in names]
    with torch.no_grad():
        lifted.load_state_dict({key: value for key, value in model.state_dict().items()
                                if key not in ("feature_mean", "feature_std", "body.0.weight")}, strict=False)
        lifted.feature_mean.zero_()[columns] = model.feature_mean
        lifted.feature_std.fill_(1.0)[columns] = model.feature_std
        lifted.body[0].weight.zero_()[:, columns] = model.body[0].weight
    return lifted
