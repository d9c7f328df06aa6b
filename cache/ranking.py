"""The ranking action: at a decision point a policy scores **every block of every layer** (resident and
offloaded) and the cache keeps the top-b of each layer on device.

- ``block_features(view)`` → ``[L, N, F]`` float32, one row of ``RANK_FEATURES`` per block: the numbers the
  field's heuristics rank by (window, last-query and accumulated attention, mean and max over query heads, as
  log shares of the layer and as within-layer ranks; Quest's bound of the latest query's logit, known for
  offloaded blocks too, and the share of attention those bounds give each block under the vote of the latest
  forward's counted queries (in streaming, the question's: the only query-side signal an offloaded block has);
  key norm, key distinctiveness, query similarity), the
  block's place (position, distance from the end, sink, layer depth), its tier, the phase, and its layer's
  memory pressure and budget. A pure function of a ``CacheView``: the env, the training data and the
  controller loaded into the cache all see the same numbers.
- ``keep_top(view, scores, merge)`` → the ``Placement`` (one device mask per layer) that makes each layer's
  device set its pinned blocks (sinks, the newest block) plus its best-scoring other blocks up to the budget: blocks that fall out are
  evicted (to the host or disk when the cache has them, else dropped), or **merged** into their neighbours
  where ``merge`` is positive and a merge is legal; offloaded blocks that rise in are **prefetched**; the rest
  are kept. Evict, merge, prefetch and keep are all the policy's; the budget holds without a fallback.

The regret reward of a ranking lives with the other reward terms (``kvgym.envs.reward.ranking_regret``).
"""

from __future__ import annotations

import numpy as np
import torch

from cache.controller import PHASES, CacheView, Op
from cache.placement import Placement
from cache.tiers import Tier

MASS_KINDS = (("last", "mean"), ("last", "max"), ("last_query", "mean"), ("last_query", "max"),
              ("observed", "mean"), ("observed", "max"))
RANK_FEATURES = (
    "valid", "layer_depth", "position", "distance_from_end", "sink", "newest",
    *[f"{kind}_{over}_{form}" for kind, over in MASS_KINDS for form in ("log_share", "rank")],
    *[f"page_bound_{over}_{form}" for over in ("mean", "max") for form in ("log_share", "rank")],
    *[f"window_bound_{over}_{form}" for over in ("mean", "max") for form in ("log_share", "rank")],
    "key_norm_rank", "key_distinct_rank", "query_similarity", "query_similarity_rank",
    "tier_device", "tier_host", "tier_disk", "sentence_boundary",
    *[f"phase_{phase}" for phase in PHASES],
    "layer_pressure", "layer_budget_fraction",
)
NUM_RANK_FEATURES = len(RANK_FEATURES)
BUDGET_COLUMN = RANK_FEATURES.index("layer_budget_fraction")
PRESSURE_COLUMN = RANK_FEATURES.index("layer_pressure")


def stable_argsort(keyed: np.ndarray) -> np.ndarray:
    """``np.argsort(keyed, axis=-1, kind="stable")`` (ties in index order, NaN last), faster for float32: each value
    becomes an int64 key that sorts as the float does (its bits, the negative ones' magnitude flipped) with its
    index in the low 32 bits, so numpy's vectorised (unstable) integer sort gives the stable order, 3-7x sooner
    than the stable float sort on a 2k cache's ranks. Other dtypes take numpy's stable sort."""
    if keyed.dtype != np.float32:
        return np.argsort(keyed, axis=-1, kind="stable")
    keyed = np.where(np.isnan(keyed), np.float32(np.nan), keyed + np.float32(0.0))  # one NaN; -0.0 ties +0.0
    bits = keyed.view(np.int32)
    sortable = np.where(bits < 0, bits ^ np.int32(0x7FFFFFFF), bits).astype(np.int64)
    keys = (sortable << 32) | np.arange(keyed.shape[-1], dtype=np.int64)
    return np.sort(keys, axis=-1) & 0xFFFFFFFF


def within_layer_rank(values: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """``[..., L, N]`` → each valid entry's rank among its layer's valid entries (``valid``: ``[L, N]``), scaled to
    0 (lowest) .. 1 (highest); invalid entries get 0. Ties share the lower rank's order (stable). Several value
    arrays stacked on leading axes are ranked in one sort."""
    keyed = np.where(valid, values, -np.inf)  # float32 stays float32 (the fast stable sort)
    order = stable_argsort(keyed)
    ranks = np.empty(keyed.shape, np.float32)
    np.put_along_axis(ranks, order, np.broadcast_to(np.arange(keyed.shape[-1], dtype=np.float32), keyed.shape), axis=-1)
    invalid = (~valid).sum(axis=-1, keepdims=True)
    count = np.maximum(valid.sum(axis=-1, keepdims=True) - 1, 1)
    return np.where(valid, (ranks - invalid) / count, 0.0).astype(np.float32)


def log_share(values: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """``[L, N]`` non-negative values → ``log(N · value / layer total + 1e-4)`` over valid entries (0 = an even
    share; invalid entries get the floor)."""
    values = np.where(valid, np.maximum(values, 0.0), 0.0).astype(np.float64)
    total = values.sum(axis=1, keepdims=True)
    share = values / np.where(total > 0, total, 1.0) * values.shape[1]
    return np.log(share + 1e-4).astype(np.float32)


def softmax_log_share(logits: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """``[L, N]`` logits → ``log_share`` of their softmax over each layer's valid entries."""
    keyed = np.where(valid, logits, -np.inf).astype(np.float64)
    weights = np.exp(keyed - keyed.max(axis=1, keepdims=True, initial=-1e300))
    return log_share(np.nan_to_num(weights), valid)


def _mass(view: CacheView, kind: str, over: str) -> np.ndarray:
    if kind == "observed":
        heads = view.acc_mass_heads
        if heads is None:
            return np.zeros((view.num_layers, view.num_blocks), np.float32)
        observers = view.cache.stats.observers[:, : view.num_blocks] / view.num_tokens.clamp(min=1)
        heads = heads / observers.clamp(min=1.0)[:, None, :]
        return (heads.mean(dim=1) if over == "mean" else heads.amax(dim=1)).numpy()
    return view.mass(kind, over).numpy()


def block_features(view: CacheView) -> np.ndarray:
    """``[L, N, len(RANK_FEATURES)]`` float32 features of every block (see the module docstring)."""
    num_layers, n = view.num_layers, view.num_blocks
    tier = view.tier.numpy()
    valid = view.live_blocks.numpy()
    features = np.zeros((num_layers, n, NUM_RANK_FEATURES), np.float32)
    column = iter(range(NUM_RANK_FEATURES))
    blocks = np.arange(n, dtype=np.float32)
    features[..., next(column)] = valid
    features[..., next(column)] = (np.arange(num_layers, dtype=np.float32) / max(num_layers - 1, 1))[:, None]
    features[..., next(column)] = (blocks / max(n - 1, 1))[None]
    features[..., next(column)] = (np.log1p(n - 1 - blocks) / np.log1p(max(n, 1)))[None]
    features[..., next(column)] = (blocks < view.cache.config.sink_blocks)[None]
    features[..., next(column)] = (blocks == n - 1)[None]
    ranked = []  # (column, [L, N] values): ranked together in one sort at the end
    for kind, over in MASS_KINDS:
        mass = _mass(view, kind, over)
        features[..., next(column)] = log_share(mass, valid)
        ranked.append((next(column), mass))
    bound = view.page_bound  # [L, N, heads]: Quest's bound, offloaded blocks included
    for over in ("mean", "max"):
        if bound is None:
            next(column), next(column)
            continue
        summary = (bound.mean(dim=-1) if over == "mean" else bound.amax(dim=-1)).numpy()
        features[..., next(column)] = softmax_log_share(summary / np.sqrt(view.last_query.shape[-1]), valid)
        ranked.append((next(column), summary))  # the logit's order: a positive scale changes no rank
    vote = view.window_bound_share  # [L, N, heads]: the window's queries' softmax of their bounds, averaged
    for over in ("mean", "max"):
        if vote is None:
            next(column), next(column)
            continue
        share = (vote.mean(dim=-1) if over == "mean" else vote.amax(dim=-1)).numpy()
        features[..., next(column)] = log_share(share, valid)
        ranked.append((next(column), share))
    mean_key = view.mean_key
    if mean_key is not None:
        norm = -view.mean_key_norm.mean(dim=-1)  # Knorm: a low key norm draws attention
        layer_mean = (mean_key * torch.from_numpy(valid)[..., None, None]).sum(dim=1, keepdim=True)
        unit_layer_mean = torch.nn.functional.normalize(layer_mean, dim=-1, eps=1e-8)
        distinct = -(view.unit_mean_key * unit_layer_mean).sum(dim=-1).mean(dim=-1)  # KeyDiff: unit_cosine
        ranked.append((next(column), norm.numpy()))
        ranked.append((next(column), distinct.numpy()))
    else:
        next(column), next(column)
    similarity = view.query_similarity.numpy()
    features[..., next(column)] = similarity
    ranked.append((next(column), similarity))
    for tier_value in (Tier.DEVICE, Tier.HOST, Tier.DISK):
        features[..., next(column)] = tier == tier_value
    features[..., next(column)] = view.sentence_boundary.numpy()[None]
    for phase in PHASES:
        features[..., next(column)] = view.phase == phase
    features[..., next(column)] = view.pressure.numpy()[:, None]
    features[..., next(column)] = (view.budget_blocks.numpy() / max(n, 1))[:, None]
    assert next(column, None) is None, "every feature column is filled"
    columns, values = zip(*ranked, strict=True)
    features[..., list(columns)] = np.moveaxis(within_layer_rank(np.stack(values), valid), 0, -1)
    return features


PHASE_COLUMNS = [RANK_FEATURES.index(f"phase_{phase}") for phase in PHASES]


def check_blind_phase(blind_phase: str) -> None:
    """Refuse a ``blind_phase`` that is not one of the runner's phases."""
    if blind_phase not in PHASES:
        raise ValueError(f"blind_phase: expected one of {', '.join(PHASES)}, got {blind_phase!r}")


def policy_features(view: CacheView, blind_phase: str = "prefill") -> np.ndarray:
    """``block_features`` as the ranking policy sees them: a one-shot compression made before the question is
    read (``view.question_read`` False) shows the phase ``blind_phase`` (default ``prefill``: the policy learns
    question-blind decisions mid-prefill, and ``compress`` with the question read); ``compress`` leaves it."""
    check_blind_phase(blind_phase)
    features = block_features(view)
    if view.phase == "compress" and not view.question_read:
        features[..., PHASE_COLUMNS] = [phase == blind_phase for phase in PHASES]
    return features


def top_b(keyed, candidates, room):
    """``[..., N]`` bool: each row's ``room`` (``[...]``, clipped at 0) highest ``keyed`` scores among its
    ``candidates``; ties keep block order; non-candidates are never kept; NaN scores are the caller's to clear. The
    one top-b rule: ``keep_top`` and the replay twin call it on numpy arrays (it answers in numpy), training on
    batched torch tensors (``kvgym.envs.reward.kept_by_ranking``); a test holds the two paths equal."""
    if isinstance(keyed, np.ndarray):  # numpy's own sort: no conversions on the replay's hot path
        masked = np.where(candidates, keyed, -np.inf)  # float32 stays float32 (the fast stable sort)
        order = stable_argsort(-masked)  # best first; ties keep block order
        rank = np.empty_like(order)
        np.put_along_axis(rank, order, np.broadcast_to(np.arange(order.shape[-1]), order.shape), axis=-1)
        return candidates & (rank < np.maximum(np.asarray(room), 0)[..., None])
    scores, candidates = torch.as_tensor(keyed), torch.as_tensor(candidates)
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    masked = torch.where(candidates, scores, torch.tensor(-torch.inf, dtype=scores.dtype))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1]).expand_as(order))
    kept = candidates & (rank < torch.as_tensor(room).clamp(min=0)[..., None])
    return kept


def keep_top(view: CacheView, scores, merge=None, stay: float = 0.0) -> Placement:
    """The ``Placement`` (tensor-form decision) that leaves on each layer's device its pinned blocks plus its
    highest ``scores`` (``[L, N]``) blocks up to the layer's budget (dropped blocks cannot return); under a global budget (``view.total_budget``)
    the highest scores over all layers up to the total, so the scores decide each layer's share. A device block that falls out is merged
    into its neighbours where ``merge`` (``[L, N]``, optional) is > 0 and merging is legal, else evicted; an
    offloaded block that rises in is prefetched (``cache.placement``: the order they are applied in).

    ``stay`` ≥ 0 is a hysteresis against moving blocks back and forth: the blocks already on device rank with
    ``stay`` standard deviations of their layer's candidate scores added, so an offloaded block comes back only
    when it beats the resident block it displaces by that margin (0: the plain top-b)."""
    scores = np.asarray(scores, np.float64)
    if scores.shape != (view.num_layers, view.num_blocks):
        raise ValueError(f"ranking scores: expected shape {(view.num_layers, view.num_blocks)}, got {scores.shape}")
    if not stay >= 0:
        raise ValueError(f"stay: expected a margin >= 0 (in standard deviations of a layer's scores), got {stay!r}")
    tier, pinned = view.tier.numpy(), view.pinned.numpy()
    live = tier != Tier.DROPPED
    candidates = live & ~pinned
    if stay > 0:
        finite = candidates & np.isfinite(scores)
        count = np.maximum(finite.sum(axis=1, keepdims=True), 1)
        mean = np.where(finite, scores, 0.0).sum(axis=1, keepdims=True) / count
        spread = np.sqrt(np.where(finite, (scores - mean) ** 2, 0.0).sum(axis=1, keepdims=True) / count)
        scores = scores + stay * spread * (tier == Tier.DEVICE)
    # best first among each layer's candidates (a global budget: among all layers'); ties keep block order (layer
    # order first); NaN ranks last among candidates
    keyed = np.where(candidates, np.nan_to_num(scores, nan=-1e300, posinf=1e300, neginf=-1e300), -np.inf)
    if view.total_budget is None:
        chosen = top_b(keyed, candidates, view.budget_blocks.numpy().astype(np.int64) - (pinned & live).sum(axis=1))
    else:
        room = max(int(view.total_budget) - int((pinned & live).sum()), 0)
        order = np.argsort(-keyed.ravel(), kind="stable")
        chosen = np.zeros(keyed.size, bool)
        chosen[order[:room]] = True
        chosen = candidates & chosen.reshape(keyed.shape)
    leaving = (tier == Tier.DEVICE) & candidates & ~chosen
    merging = np.zeros_like(leaving)
    if merge is not None:
        merging = leaving & (np.asarray(merge, np.float32) > 0)
        if merging.any():  # legality only where the policy asks to merge
            merging &= view.legal_ops[..., Op.MERGE].numpy()
    return Placement(device=chosen | (pinned & (tier == Tier.DEVICE)), merge=merging, tier=tier,
                     free=view.device_free.numpy())
