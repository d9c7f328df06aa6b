"""The paged KV cache as a transformers ``Cache``: per-layer block tables over tiered block pools.

Contract with transformers (see DESIGN.md): keys arrive after RoPE, so a kept block keeps its true
positions; ``get_seq_length()`` is the number of tokens *seen* (logical length), and
``get_mask_sizes(q)`` is ``(resident + q, seen - resident)``. With that, the model's default
``position_ids`` and ``generate()``'s growing attention mask stay right after blocks leave the device.

Reading: attention reads a contiguous per-layer *resident mirror* ``[1, kv_heads, capacity, head_dim]``
that holds the device-resident tokens in logical order. New tokens are appended to it in place; it is
rebuilt from the device pool only when the layer's table changes (an eviction, a prefetch). This is the
cheapest of the strategies measured in ``research/paged-cache.md`` (DynamicCache ``torch.cat``s its whole
cache every step; the mirror does not), at the price of a second copy of the resident KV.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from cache.block_table import BlockTables
from cache.stats import BlockStats
from cache.tiers import Tier, TierPool


class CacheOperationError(ValueError):
    """An operation that the cache refuses (pinned block, wrong tier, no room); the cache is unchanged."""


@dataclass
class CacheConfig:
    """Shape and policy knobs of a ``PagedKVCache``.

    - ``block_size``: tokens per block.
    - ``max_tokens``: logical capacity (default: the model's ``max_position_embeddings``).
    - ``device_blocks``: device pool capacity per layer (default: enough for ``max_tokens``).
    - ``host_blocks``, ``disk_blocks``: host and disk pool capacity per layer. An evicted block goes to
      the host tier if it has room, else to the disk tier, else it is dropped (0 and 0: offload off).
    - ``disk_dir``: folder for the disk tier's memory-mapped files (default: a fresh temporary folder);
      ``PagedKVCache.close()`` deletes the files.
    - ``sink_blocks``: leading blocks that are pinned on the device (the attention sink).
    - ``stats_window``: for a multi-token forward (prefill), attention statistics come from its last
      ``stats_window`` queries (SnapKV's observation window); a decode step always contributes its query.
    - ``recent_decay``, ``attended_share``: see ``BlockStats``.
    """

    block_size: int = 16
    max_tokens: int | None = None
    device_blocks: int | None = None
    host_blocks: int = 0
    disk_blocks: int = 0
    disk_dir: str | None = None
    sink_blocks: int = 1
    stats_window: int = 64
    recent_decay: float = 0.9
    attended_share: float = 1.0

    def __post_init__(self):
        for name in ("block_size", "sink_blocks", "stats_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"CacheConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("host_blocks", "disk_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"CacheConfig.{name} must be >= 0, got {getattr(self, name)}")


FALLBACK_RULES = ("lowest_mass", "heavy_recent", "oldest")
RECENT_PENALTY = 1e9  # added to a recent block's eviction key: it sorts after every older block


class PagedLayer(CacheLayerMixin):
    """One decoder layer's view of the paged cache; all state lives in the parent ``PagedKVCache``."""

    is_compileable = False
    is_sliding = False

    def __init__(self, cache: PagedKVCache, layer_idx: int):
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.resident = 0  # tokens in the resident mirror
        self.mirror_stale = False
        self.mirror_keys: torch.Tensor | None = None
        self.mirror_values: torch.Tensor | None = None
        # each mirror slot's block as an index into the flattened [layers, max_blocks] statistics
        self.mirror_blocks: torch.Tensor | None = None
        self.mirror_log_weights: torch.Tensor | None = None  # [kv_heads, capacity]; used once merges happen

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _, kv_heads, _, head_dim = key_states.shape
        self.cache._init_pools(self.layer_idx, kv_heads, head_dim, key_states.dtype, key_states.device)
        capacity = self.cache.device_pool(self.layer_idx).num_blocks * self.cache.block_size
        shape = (1, kv_heads, capacity, head_dim)
        self.mirror_keys = torch.empty(shape, dtype=key_states.dtype, device=key_states.device)
        self.mirror_values = torch.empty(shape, dtype=value_states.dtype, device=value_states.device)
        self.mirror_blocks = torch.empty(capacity, dtype=torch.int64)
        self.mirror_log_weights = torch.zeros(kv_heads, capacity, dtype=torch.float32, device=key_states.device)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if key_states.shape[0] != 1:
            raise ValueError(f"PagedKVCache supports batch size 1, got a batch of {key_states.shape[0]}")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        cache, layer = self.cache, self.layer_idx
        num_new = key_states.shape[-2]
        if layer == 0:
            cache.last_forward_tokens = num_new
        pool = cache.device_pool(layer)
        previous = self.resident
        if num_new == 1:  # decode step: Python-int fast path
            physical, offset, block = cache.tables.append_one(layer, pool.allocator)
            pool.keys[physical, offset] = key_states[0, :, 0]
            pool.values[physical, offset] = value_states[0, :, 0]
            if pool.has_merged:
                pool.log_weights[physical, offset] = 0.0
            if offset == 0 and block > 0:  # the previous block just became full: summarise its keys
                cache.summarize_keys(layer, torch.tensor([block - 1]))
            logical = block + layer * cache.max_blocks
        else:
            slots, logical = cache.tables.append(layer, num_new, pool.allocator)
            pool.flat_keys().index_copy_(0, slots.to(pool.keys.device), key_states[0].transpose(0, 1))
            pool.flat_values().index_copy_(0, slots.to(pool.values.device), value_states[0].transpose(0, 1))
            if pool.has_merged:
                pool.flat_log_weights().index_fill_(0, slots.to(pool.keys.device), 0.0)
            cache.summarize_keys(layer, torch.arange(int(logical[0]), int(logical[-1]) + 1))
            logical = logical + layer * cache.max_blocks

        if self.mirror_stale:
            self._rebuild_mirror()
        else:
            end = previous + num_new
            self.mirror_keys[:, :, previous:end] = key_states
            self.mirror_values[:, :, previous:end] = value_states
            self.mirror_blocks[previous:end] = logical
            if pool.has_merged:
                self.mirror_log_weights[:, previous:end] = 0.0
            self.resident = end
        cache._count_read(layer, self.resident)
        if previous == 0 and self.resident == num_new:
            return key_states, value_states  # a fresh prefill: attend the incoming states, no copy back
        return self.mirror_keys[:, :, : self.resident], self.mirror_values[:, :, : self.resident]

    def _rebuild_mirror(self) -> None:
        """Gather the device-resident tokens, in logical order, from the pool into the mirror."""
        pool = self.cache.device_pool(self.layer_idx)
        slots, blocks = self.cache.tables.resident_slots(self.layer_idx)
        slots = slots.to(pool.keys.device)
        count = slots.numel()
        self.mirror_keys[0, :, :count] = pool.flat_keys().index_select(0, slots).transpose(0, 1)
        self.mirror_values[0, :, :count] = pool.flat_values().index_select(0, slots).transpose(0, 1)
        self.mirror_blocks[:count] = blocks + self.layer_idx * self.cache.max_blocks
        self.cache.mirror_bytes_copied += count * self.cache.bytes_per_token
        if pool.has_merged:
            self.mirror_log_weights[:, :count] = pool.flat_log_weights().index_select(0, slots).transpose(0, 1)
        self.resident = count
        self.mirror_stale = False

    def attention_bias(self) -> torch.Tensor | None:
        """``[kv_heads, resident]`` log weights to add to attention scores, or None when nothing is merged."""
        if not self.cache.device_pool(self.layer_idx).has_merged:
            return None
        return self.mirror_log_weights[:, : self.resident]

    def resident_keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The attended keys/values ``[1, kv_heads, resident, head_dim]`` (after pending table changes)."""
        if self.mirror_stale:
            self._rebuild_mirror()
        return self.mirror_keys[:, :, : self.resident], self.mirror_values[:, :, : self.resident]

    def get_seq_length(self) -> int:
        return self.cache.tables.seen[self.layer_idx]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        resident = self.cache.tables.resident_tokens(self.layer_idx) if self.mirror_stale else self.resident
        return resident + query_length, self.get_seq_length() - resident

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.resident = 0
        self.mirror_stale = False


class PagedKVCache(Cache):
    """A paged, tiered KV cache for one sequence, usable as ``cache=`` in ``model(...)`` and ``generate``.

    Tiers: ``device`` (attended), ``host`` and ``disk`` (offloaded; not attended). Operations act on
    ``(layer, logical block)``: ``evict`` moves a device block to the host tier if it has room, else to
    disk, else drops it; ``prefetch`` brings a host or disk block back; ``merge`` folds a block into the
    most similar kept tokens. The sink block(s) and the newest block are pinned. Every attention call's
    bytes read and every operation's bytes moved are counted; ``close()`` deletes the disk files.
    """

    layer_class = PagedLayer

    def __init__(self, model_config, cache_config: CacheConfig | None = None):
        self.config = cache_config or CacheConfig()
        self.block_size = self.config.block_size
        text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        self.num_layers = text_config.num_hidden_layers
        self.max_tokens = self.config.max_tokens or text_config.max_position_embeddings
        self.max_blocks = -(-self.max_tokens // self.block_size)
        self.device_blocks = self.config.device_blocks or self.max_blocks + 1
        self.tables = BlockTables(self.num_layers, self.max_blocks, self.block_size)
        self.stats = BlockStats(self.num_layers, self.max_blocks, self.config.recent_decay,
                                self.config.attended_share)
        self.pools: list[dict[Tier, TierPool]] = [{} for _ in range(self.num_layers)]
        self.disk_dir: Path | None = None
        if self.config.disk_blocks:
            root = self.config.disk_dir
            if root is not None:
                Path(root).mkdir(parents=True, exist_ok=True)
            self.disk_dir = Path(tempfile.mkdtemp(prefix="kvgym-disk-", dir=root))
            self._remove_disk_dir = weakref.finalize(self, shutil.rmtree, self.disk_dir, True)
        self.bytes_per_token = 0  # K + V bytes of one token in one layer, known after the first write
        self.bytes_read = [0] * self.num_layers  # by attention, cumulative
        self.last_bytes_read = [0] * self.num_layers  # by the layer's latest attention call
        self.attention_calls = [0] * self.num_layers
        self.mirror_bytes_copied = 0  # device-to-device copies that rebuild resident mirrors after table changes
        self._pending_mass: list[torch.Tensor | None] = [None] * self.num_layers
        # token-level facts the controller view summarises per block
        self.sentence_end = torch.zeros(self.max_blocks * self.block_size, dtype=torch.bool)
        self.last_query: list[torch.Tensor | None] = [None] * self.num_layers  # [heads, dim] of the latest query
        # SentenceKV's sentence cache: sum of the decode queries of the sentence being generated, per layer
        self.sentence_query_sum: list[torch.Tensor | None] = [None] * self.num_layers
        self.sentence_query_count = 0
        self.last_forward_tokens = 0  # tokens fed by the latest forward pass (1 = a decode step)
        self.last_forward_queries = 0  # queries whose attention went into the latest statistics
        self.bytes_moved: dict[tuple[str, str], int] = defaultdict(int)
        self.operation_log: list[dict] = []
        super().__init__(layers=[self.layer_class(self, i) for i in range(self.num_layers)])

    # ----------------------------------------------------------------- transformers plumbing
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        attention_kwargs = kwargs.get("kwargs")
        if isinstance(attention_kwargs, dict):
            attention_kwargs["paged_cache"] = self  # reaches the paged attention function
        return self.layers[layer_idx].update(key_states, value_states)

    def _init_pools(self, layer: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
        pools = {Tier.DEVICE: TierPool(Tier.DEVICE, self.device_blocks, self.block_size, kv_heads, head_dim,
                                       dtype, device)}
        if self.config.host_blocks:
            pools[Tier.HOST] = TierPool(Tier.HOST, self.config.host_blocks, self.block_size, kv_heads, head_dim,
                                        dtype, "cpu")
        if self.config.disk_blocks:
            pools[Tier.DISK] = TierPool(Tier.DISK, self.config.disk_blocks, self.block_size, kv_heads, head_dim,
                                        dtype, "cpu", disk_dir=self.disk_dir, layer=layer)
        self.pools[layer] = pools
        self.bytes_per_token = 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def device_pool(self, layer: int) -> TierPool:
        return self.pools[layer][Tier.DEVICE]

    def record_attention(self, layer: int, token_mass: torch.Tensor, num_queries: int, scale: float = 1.0) -> None:
        """Take one layer's per-token attention mass over its resident mirror (times ``scale``, e.g. 1/heads to
        average over query heads). The statistics of all layers are updated together after the last layer."""
        self._pending_mass[layer] = token_mass
        if layer == self.num_layers - 1:
            self._flush_attention(num_queries, scale)

    def _flush_attention(self, num_queries: int, scale: float) -> None:
        layers = [layer for layer, mass in enumerate(self._pending_mass) if mass is not None]
        if not layers:
            return
        masses = [self._pending_mass[layer] for layer in layers]
        index = torch.cat([self.layers[layer].mirror_blocks[: mass.numel()] for layer, mass in zip(layers, masses, strict=True)])
        block_mass = torch.zeros(self.num_layers * self.max_blocks)
        block_mass.index_add_(0, index, torch.cat(masses).cpu(), alpha=scale)
        resident_blocks = torch.tensor([self.tables.count_in(layer, Tier.DEVICE) for layer in range(self.num_layers)])
        self.stats.record_attention(block_mass.view(self.num_layers, self.max_blocks), num_queries,
                                    resident_blocks, self.tables.seen[0])
        self._pending_mass = [None] * self.num_layers
        self.last_forward_queries = num_queries
        if num_queries == 1:
            self.sentence_query_count += 1
            if self.sentence_end[self.tables.seen[0] - 1]:  # that token closed a sentence: start a new one
                self.sentence_query_count = 0
                self.sentence_query_sum = [None] * self.num_layers
        else:  # a prefill chunk: the generated sentence starts after the prompt
            self.sentence_query_count = 0
            self.sentence_query_sum = [None] * self.num_layers

    def record_query(self, layer: int, query: torch.Tensor) -> None:
        """Keep the latest query ``[heads, dim]`` of ``layer`` and, for decode steps, add it to the running
        sum of the current sentence's queries."""
        self.last_query[layer] = query
        if self.sentence_query_sum[layer] is None:
            self.sentence_query_sum[layer] = query.detach().float().clone()
        else:
            self.sentence_query_sum[layer].add_(query)

    def observe_tokens(self, start: int, sentence_end: torch.Tensor) -> None:
        """Record which tokens at positions ``start..`` end a sentence (the runner calls this; the cache
        itself never sees token ids)."""
        self.sentence_end[start : start + sentence_end.numel()] = sentence_end.cpu()

    def summarize_keys(self, layer: int, blocks: torch.Tensor) -> None:
        """Recompute the key summaries (sum, min, max) of ``layer``'s device ``blocks`` from the pool."""
        pool = self.device_pool(layer)
        physical = self.tables.physical[layer, blocks].to(pool.keys.device)
        self.stats.summarize_keys(layer, blocks, pool.keys[physical], self.tables.num_tokens[layer, blocks])

    def refresh_key_stats(self) -> None:
        """Bring every layer's newest (partially filled) block's key summaries up to date."""
        for layer in range(self.num_layers):
            n = self.tables.num_logical(layer)
            if n and self.pools[layer]:
                self.summarize_keys(layer, torch.tensor([n - 1]))

    def _count_read(self, layer: int, resident: int) -> None:
        read = resident * self.bytes_per_token
        self.bytes_read[layer] += read
        self.last_bytes_read[layer] = read
        self.attention_calls[layer] += 1

    # ----------------------------------------------------------------- state
    @property
    def seen(self) -> int:
        """Tokens seen by the cache (its logical length)."""
        return self.tables.seen[0]

    def num_logical_blocks(self, layer: int = 0) -> int:
        return self.tables.num_logical(layer)

    def pinned_mask(self, layer: int) -> torch.Tensor:
        """Bool ``[num_logical]``: the sink block(s) and the newest block."""
        n = self.tables.num_logical(layer)
        pinned = torch.zeros(n, dtype=torch.bool)
        pinned[: self.config.sink_blocks] = True
        if n:
            pinned[n - 1] = True
        return pinned

    def is_pinned(self, layer: int, block: int) -> bool:
        n = self.tables.num_logical(layer)
        return block < self.config.sink_blocks or block == n - 1

    def blocks_per_tier(self) -> dict[str, list[int]]:
        """Per tier name, the number of blocks of each layer in it (dropped included)."""
        return {tier.name.lower(): [self.tables.count_in(layer, tier) for layer in range(self.num_layers)]
                for tier in (Tier.DEVICE, Tier.HOST, Tier.DISK, Tier.DROPPED)}

    def tier_occupancy(self) -> torch.Tensor:
        """``[3]`` fraction of the device, host and disk pools in use, over all layers (0 when absent)."""
        occupancy = []
        for tier in (Tier.DEVICE, Tier.HOST, Tier.DISK):
            pools = [pools[tier] for pools in self.pools if tier in pools]
            capacity = sum(pool.num_blocks for pool in pools)
            used = sum(pool.allocator.num_used for pool in pools)
            occupancy.append(used / capacity if capacity else 0.0)
        return torch.tensor(occupancy)

    def resident_tokens(self, layer: int) -> int:
        return self.tables.resident_tokens(layer)

    def resident_keys_values(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layers[layer].resident_keys_values()

    # ----------------------------------------------------------------- operations
    def check_block(self, layer: int, block: int, operation: str) -> Tier:
        """The tier of ``layer``'s logical ``block``; ``CacheOperationError`` naming ``operation`` if out of range."""
        if not 0 <= layer < self.num_layers:
            raise CacheOperationError(f"{operation}: layer {layer} is out of range 0..{self.num_layers - 1}")
        n = self.tables.num_logical(layer)
        if not 0 <= block < n:
            raise CacheOperationError(f"{operation}: block {block} of layer {layer} is out of range 0..{n - 1}")
        return Tier(int(self.tables.tier[layer, block]))

    def _check_evictable(self, layer: int, block: int, operation: str) -> None:
        tier = self.check_block(layer, block, operation)
        if tier != Tier.DEVICE:
            raise CacheOperationError(
                f"{operation}: block {block} of layer {layer} is not on the device (it is {tier.name})")
        if self.is_pinned(layer, block):
            raise CacheOperationError(f"{operation}: block {block} of layer {layer} is pinned (sink or newest block)")

    def _move(self, layer: int, block: int, source: Tier, target: Tier) -> None:
        """Copy a block between tier pools and update the table; the caller checked there is room."""
        from_pool, to_pool = self.pools[layer][source], self.pools[layer][target]
        source_block = int(self.tables.physical[layer, block])
        target_block = to_pool.allocator.allocate()
        to_pool.copy_block(from_pool, source_block, target_block)
        from_pool.allocator.free(source_block)
        self.tables.move(layer, block, target, target_block)
        self.bytes_moved[(source.name.lower(), target.name.lower())] += from_pool.bytes_per_block

    def evict(self, layer: int, block: int) -> Tier:
        """Move a device block to the next tier with room (host, then disk), else drop it; returns where
        it went. Refused (``CacheOperationError``, nothing changed) for pinned or non-device blocks."""
        self._check_evictable(layer, block, "evict")
        for tier in (Tier.HOST, Tier.DISK):
            pool = self.pools[layer].get(tier)
            if pool is not None and pool.allocator.num_free:
                self._move(layer, block, Tier.DEVICE, tier)
                break
        else:
            self.device_pool(layer).allocator.free(int(self.tables.physical[layer, block]))
            self.tables.move(layer, block, Tier.DROPPED)
            tier = Tier.DROPPED
        self.layers[layer].mirror_stale = True
        self._log("evict", layer, block, tier)
        return tier

    def prefetch(self, layer: int, block: int) -> None:
        """Bring a host or disk block back to the device (a bit-exact copy)."""
        tier = self.check_block(layer, block, "prefetch")
        if tier not in (Tier.HOST, Tier.DISK):
            raise CacheOperationError(
                f"prefetch: block {block} of layer {layer} is {tier.name}; only HOST or DISK blocks can be prefetched"
            )
        if not self.device_pool(layer).allocator.num_free:
            raise CacheOperationError(f"prefetch: the device pool of layer {layer} is full; evict a block first")
        self._move(layer, block, tier, Tier.DEVICE)
        self.layers[layer].mirror_stale = True
        self._log("prefetch", layer, block, Tier.DEVICE)

    def merge(self, layer: int, block: int, min_similarity: float | None = None) -> int:
        """Free a device block, folding each of its tokens into the most similar token that stays.

        Rule: weighted key/value averaging with proportional attention. For each KV head, every token of
        the block joins the resident token (outside the block) whose key is most cosine-similar, as in
        D2O's nearest-neighbour merge (Wan et al., 2024, arXiv 2406.13035, §3.3); the pair is replaced by
        the count-weighted mean of their keys and values and the merged slot's log count is added to its
        attention scores, as in ToMe's proportional attention (Bolya et al., ICLR 2023). When the two keys
        are equal this reproduces their joint attention exactly. Tokens whose best similarity is below
        ``min_similarity`` are dropped instead of folded. Returns the number of tokens folded; refused when
        there is no candidate to fold into.
        """
        self._check_evictable(layer, block, "merge")
        pool = self.device_pool(layer)
        targets = self.tables.blocks_in(layer, Tier.DEVICE)
        targets = targets[targets != block]
        if targets.numel() == 0:
            raise CacheOperationError(f"merge: layer {layer} has no other device block to merge block {block} into")
        bs = self.block_size
        source_slots = int(self.tables.physical[layer, block]) * bs + torch.arange(
            int(self.tables.num_tokens[layer, block]))
        counts = self.tables.num_tokens[layer, targets].to(torch.int64)
        offsets = torch.arange(bs)
        target_slots = (self.tables.physical[layer, targets, None] * bs + offsets)[offsets < counts[:, None]]
        keys, values, weights = pool.flat_keys(), pool.flat_values(), pool.flat_log_weights()
        source_keys = keys[source_slots].float()  # [s, kv_heads, dim]
        target_keys = keys[target_slots].float()  # [t, kv_heads, dim]
        similarity = torch.einsum("shd,thd->hst", torch.nn.functional.normalize(source_keys, dim=-1),
                                  torch.nn.functional.normalize(target_keys, dim=-1))
        best_similarity, nearest = similarity.max(dim=-1)  # [kv_heads, s]
        if min_similarity is None:
            folded = torch.ones_like(nearest, dtype=torch.bool)
        else:
            folded = best_similarity >= min_similarity
        if not bool(folded.any()):
            raise CacheOperationError(
                f"merge: no token of block {block} in layer {layer} reaches similarity {min_similarity} "
                f"with a kept token (best {float(best_similarity.max()):.3f}); evict it instead")
        source_weight = torch.exp(weights[source_slots].T) * folded  # [kv_heads, s]
        target_weight = torch.exp(weights[target_slots].T)  # [kv_heads, t]
        heads = source_keys.shape[1]
        new_weight = target_weight.clone()
        new_weight.scatter_add_(1, nearest, source_weight)
        # one index_add over (target token, head) rows: row t * heads + h
        rows = (nearest * heads + torch.arange(heads)[:, None]).flatten()  # [kv_heads * s], head-major
        merged = {}
        for name, source, target in (("keys", source_keys, target_keys),
                                     ("values", values[source_slots].float(), values[target_slots].float())):
            total = (target * target_weight.T[..., None]).reshape(-1, target.shape[-1])  # [t * kv_heads, dim]
            weighted = (source * source_weight.T[..., None]).transpose(0, 1).reshape(-1, source.shape[-1])
            total.index_add_(0, rows, weighted)
            merged[name] = total.view(target.shape) / new_weight.T[..., None]
        keys[target_slots] = merged["keys"].to(keys.dtype)
        values[target_slots] = merged["values"].to(values.dtype)
        weights[target_slots] = torch.log(new_weight).T
        pool.has_merged = True
        pool.allocator.free(int(self.tables.physical[layer, block]))
        self.tables.move(layer, block, Tier.DROPPED)
        self.summarize_keys(layer, targets)
        self.layers[layer].mirror_stale = True
        self._log("merge", layer, block, Tier.DROPPED)
        return int(folded.sum())

    def reopen_disk(self) -> None:
        """Unmap and map again every layer's disk pool (the content survives; used to check persistence)."""
        for pools in self.pools:
            if Tier.DISK in pools:
                pools[Tier.DISK].reopen()

    def close(self) -> None:
        """Release the pools and delete the disk tier's files and folder."""
        for pools in self.pools:
            for pool in pools.values():
                pool.close()
        self.pools = [{} for _ in range(self.num_layers)]
        if self.disk_dir is not None:
            self._remove_disk_dir()

    def _log(self, operation: str, layer: int, block: int, destination: Tier) -> None:
        self.operation_log.append({"op": operation, "layer": layer, "block": block, "to": destination.name.lower(),
                                   "seen": self.tables.seen[layer]})

    def enforce_budget(self, budget_blocks: list[int], rule: str = "lowest_mass") -> int:
        """Evict until every layer has at most ``budget_blocks[layer]`` device blocks; returns evictions made.

        ``rule`` picks the victim among unpinned device blocks: ``lowest_mass`` (lowest accumulated
        attention mass, ties to the oldest), ``heavy_recent`` (H2O's split: the newest ``budget // 2``
        logical blocks are a protected recent window, the others go by lowest accumulated mass; recent
        blocks are taken, by mass, only when nothing else is left) or ``oldest``.
        """
        if rule not in FALLBACK_RULES:
            raise ValueError(f"unknown fallback rule {rule!r}: use one of {FALLBACK_RULES}")
        evictions = 0
        n = self.num_logical_blocks()
        for layer in range(self.num_layers):
            excess = self.tables.count_in(layer, Tier.DEVICE) - budget_blocks[layer]
            if excess <= 0:
                continue
            candidates = self.tables.blocks_in(layer, Tier.DEVICE)
            candidates = candidates[~self.pinned_mask(layer)[candidates]]
            if rule != "oldest":
                key = self.stats.acc_mass[layer, candidates].double()
                if rule == "heavy_recent":
                    key = key + (candidates >= n - budget_blocks[layer] // 2).double() * RECENT_PENALTY
                # stable sort keeps ascending block order among equal keys: oldest first
                candidates = candidates[torch.sort(key, stable=True).indices]
            for block in candidates[:excess].tolist():
                self.evict(layer, block)
                evictions += 1
        return evictions

    def bytes_summary(self) -> dict:
        return {
            "bytes_read_total": sum(self.bytes_read),
            "bytes_read_last_call": sum(self.last_bytes_read),
            "bytes_moved": {f"{a}->{b}": n for (a, b), n in self.bytes_moved.items()},
            "mirror_bytes_copied": self.mirror_bytes_copied,
        }
