"""The paged KV cache as a transformers ``Cache``: per-layer block tables over tiered block pools.

Contract with transformers (see DESIGN.md): keys arrive after RoPE, so a kept block keeps its true
positions; ``get_seq_length()`` is the number of tokens *seen* (logical length), and
``get_mask_sizes(q)`` is ``(resident + q, seen - resident)``. With that, the model's default
``position_ids`` and ``generate()``'s growing attention mask stay right after blocks leave the device.

Reading: attention reads a contiguous per-layer *resident mirror* ``[1, kv_heads, capacity, head_dim]``
that holds the device-resident tokens. New tokens are appended to it in place. This is the cheapest of the
strategies measured in ``research/paged-cache.md`` (DynamicCache ``torch.cat``s its whole cache every step;
the mirror does not), at the price of a second copy of the resident KV. When blocks leave the device
(evict, merge) their slots are filled with the mirror's last entries (a copy of the removed tokens' size,
not of the layer), so after the first removal the mirror is a permutation of the resident tokens, not in
logical order: attention and its statistics do not depend on the order (``mirror_blocks`` maps each slot
to its block), and a forward's new tokens are always the mirror's last entries, which is what the causal
mask of a prefill chunk needs. A prefetch rebuilds the layer's mirror from the pool, in logical order.

Storage: the device pools and the mirrors of all layers are rows of single stacked tensors
(``DeviceStack``), so a batched operation (``merge_blocks``, the mirror compaction) indexes every layer
in one gather / scatter instead of a Python loop over layers.

Files: this one holds the cache's state, operations, budget and bytes; ``paged_layer`` the per-layer
transformers view; ``device_stack`` the stacked storage; ``merging`` the batched merge (a mixin);
``mirrors`` the mirror upkeep (a mixin).
"""

from __future__ import annotations

import copy
import math
import shutil
import tempfile
import weakref
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.cache_utils import Cache

from cache.block_table import BlockTables
from cache.device_stack import DeviceStack
from cache.errors import CacheOperationError
from cache.fallback import FALLBACK_RULES, eviction_key
from cache.merging import MergeMixin
from cache.mirrors import MirrorMixin
from cache.paged_layer import PagedLayer
from cache.stats import BlockStats
from cache.tiers import Tier, TierPool


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
    - ``track_query_max``: also keep each block's largest single-query attention per head
      (``BlockStats.query_max_heads``; KVzip's score; costs a per-query reduction in every forward).
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
    track_query_max: bool = False

    def __post_init__(self):
        for name in ("block_size", "sink_blocks", "stats_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"CacheConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("host_blocks", "disk_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"CacheConfig.{name} must be >= 0, got {getattr(self, name)}")


def available_memory_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None



class PagedKVCache(MergeMixin, MirrorMixin, Cache):
    """A paged, tiered KV cache for one sequence, usable as ``cache=`` in ``model(...)`` and ``generate``.

    Tiers: ``device`` (attended), ``host`` and ``disk`` (offloaded; not attended). Operations act on
    ``(layer, logical block)``: ``evict`` moves a device block to the host tier if it has room, else to
    disk, else drops it; ``prefetch`` brings a host or disk block back; ``merge`` folds a block into the
    most similar kept tokens. The sink block(s) and the newest block are pinned. Every attention call's
    bytes read and every operation's bytes moved are counted; ``close()`` deletes the disk files.
    """

    layer_class = PagedLayer

    def __init__(self, model_config, cache_config: CacheConfig | None = None):
        self.model_config = model_config
        self.config = cache_config or CacheConfig()
        self.block_size = self.config.block_size
        text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        self.num_layers = text_config.num_hidden_layers
        self.max_tokens = self.config.max_tokens or text_config.max_position_embeddings
        self.max_blocks = -(-self.max_tokens // self.block_size)
        self.device_blocks = self.config.device_blocks or self.max_blocks + 1
        self.tables = BlockTables(self.num_layers, self.max_blocks, self.block_size)
        # per-KV-head drops (``drop_head``): True where a KV head no longer attends a device block
        self.num_kv_heads = int(getattr(text_config, "num_key_value_heads", None)
                                or getattr(text_config, "num_attention_heads", 1))
        self.head_dropped = torch.zeros(self.num_layers, self.num_kv_heads, self.max_blocks, dtype=torch.bool)
        self.any_head_dropped = False  # until the first drop, device_load is the block count (the decode hot path)
        self.stats = BlockStats(self.num_layers, self.max_blocks, self.config.recent_decay,
                                self.config.attended_share, self.config.track_query_max)
        self.pools: list[dict[Tier, TierPool]] = [{} for _ in range(self.num_layers)]
        self._stacks: list[DeviceStack] = []  # stacked device pools and mirrors (see _init_pools)
        self._stack_of: list[DeviceStack | None] = [None] * self.num_layers
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
        # [heads, q, dim]: the latest forward's counted queries (its last stats_window), post-RoPE
        self.window_queries: list[torch.Tensor | None] = [None] * self.num_layers
        # SentenceKV's sentence cache: sum of the decode queries of the sentence being generated, per layer
        self.sentence_query_sum: list[torch.Tensor | None] = [None] * self.num_layers
        self.sentence_query_count = 0
        self.last_forward_tokens = 0  # tokens fed by the latest forward pass (1 = a decode step)
        self.last_forward_queries = 0  # queries whose attention went into the latest statistics
        self.bytes_moved: dict[tuple[str, str], int] = defaultdict(int)
        self.operation_log: list[dict] = []
        self.key_stats_stale: set[int] = set()  # layers whose newest block took decode tokens since its summary
        super().__init__(layers=[self.layer_class(self, i) for i in range(self.num_layers)])

    # ----------------------------------------------------------------- transformers plumbing
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        attention_kwargs = kwargs.get("kwargs")
        if isinstance(attention_kwargs, dict):
            attention_kwargs["paged_cache"] = self  # reaches the paged attention function
        return self.layers[layer_idx].update(key_states, value_states)

    def _check_memory(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
        """Refuse pools that cannot fit in the memory this machine has free (before allocating them: a huge
        ``block_size`` or tier would otherwise take minutes to fail, or take all the memory)."""
        available = available_memory_bytes()
        if available is None:
            return
        per_block = 2 * self.block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        blocks = self.config.host_blocks + (2 * self.device_blocks if torch.device(device).type == "cpu" else 0)
        needed = self.num_layers * blocks * per_block
        if needed > 0.9 * available:
            raise ValueError(
                f"the paged cache needs {needed / 2**30:.1f} GiB of CPU memory ({self.num_layers} layers x "
                f"{blocks} blocks of {self.block_size} tokens: device pool and its mirror "
                f"{self.device_blocks} blocks, host tier {self.config.host_blocks}), but {available / 2**30:.1f} GiB "
                "are free: use a smaller --block-size (16 is the default) or fewer --host-blocks")

    def _init_pools(self, layer: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
        """Create ``layer``'s tier pools and attach its mirror. Its device pool and mirror are views of the
        stacked storage of all layers, allocated for every layer at the first call; a layer whose shape
        differs from the first one's gets a stack of its own."""
        if not self._stacks:
            self._check_memory(kv_heads, head_dim, dtype, device)
        if self._stacks and self._stacks[0].fits(layer, kv_heads, head_dim, dtype, device):
            stack = self._stacks[0]
        else:
            layers = list(range(self.num_layers)) if not self._stacks else [layer]
            stack = DeviceStack.take(layers, self.device_blocks, self.block_size, kv_heads, head_dim, dtype, device)
            self._stacks.append(stack)
        self._stack_of[layer] = stack
        self.layers[layer].attach(stack, stack.row[layer])
        pools = {Tier.DEVICE: TierPool(Tier.DEVICE, self.device_blocks, self.block_size, kv_heads, head_dim,
                                       dtype, device, storage=stack.pool_storage(layer))}
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

    def record_attention(self, layer: int, head_mass: torch.Tensor, num_queries: int,
                         last_query: torch.Tensor | None = None, observers: torch.Tensor | None = None,
                         per_query: torch.Tensor | None = None) -> None:
        """Take one layer's per-head attention mass over its resident mirror, ``[heads, resident]`` summed over
        the ``num_queries`` counted queries; ``last_query`` ``[heads, resident]`` is the last query's alone,
        ``observers`` ``[resident]`` how many counted queries could see each token (None: all of them),
        ``per_query`` ``[heads, q, resident]`` each query's (used only with ``track_query_max``). The
        statistics of all layers are updated together after the last layer."""
        query_max = None
        if self.config.track_query_max and per_query is not None:
            mirror = self.layers[layer].mirror_blocks[: head_mass.shape[-1]] - layer * self.max_blocks
            by_block = torch.zeros(*per_query.shape[:2], self.max_blocks)
            by_block.index_add_(2, mirror, per_query.float().cpu())
            query_max = by_block.amax(dim=1)  # [heads, max_blocks]
        if observers is None:
            observers = torch.full((head_mass.shape[-1],), float(num_queries))
        self._pending_mass[layer] = (head_mass, head_mass if last_query is None else last_query, observers, query_max)
        if layer == self.num_layers - 1:
            self._flush_attention(num_queries)

    def _flush_attention(self, num_queries: int) -> None:
        layers = [layer for layer, pending in enumerate(self._pending_mass) if pending is not None]
        if not layers:
            return
        pending = [self._pending_mass[layer] for layer in layers]
        heads = pending[0][0].shape[0]
        size = self.num_layers * self.max_blocks
        # the per-token rows (2H masses, then the observers) are summed per block first: the mirror is
        # block-aligned, so that is a reshape (_mirror_block_sums) and the index_add runs over blocks, not tokens
        index, sums = self._mirror_block_sums(
            layers, [torch.cat([item[0], item[1], item[2][None].to(item[0])]) for item in pending])
        by_block = torch.zeros(2 * heads + 1, size)
        by_block.index_add_(1, index, sums.float().cpu())
        observers = by_block[-1]
        by_block = by_block[:-1].view(2, heads, self.num_layers, self.max_blocks).transpose(1, 2)  # [2, L, H, N]
        query_max = None
        if self.config.track_query_max:
            query_max = torch.zeros(self.num_layers, heads, self.max_blocks)
            for layer, item in zip(layers, pending, strict=True):
                if item[3] is not None:
                    query_max[layer] = item[3]
        resident_blocks = torch.tensor([self.tables.count_in(layer, Tier.DEVICE) for layer in range(self.num_layers)])
        self.stats.record_attention(by_block[0], num_queries, resident_blocks, self.tables.seen[0],
                                    last_query=by_block[1], observers=observers.view(self.num_layers, self.max_blocks),
                                    query_max=query_max)
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

    def record_query(self, layer: int, queries: torch.Tensor) -> None:
        """Keep the latest forward's counted queries ``[heads, q, dim]`` (post-RoPE) of ``layer`` and, for
        decode steps, add the query to the running sum of the current sentence's queries."""
        query = queries[:, -1]
        self.last_query[layer] = query
        self.window_queries[layer] = queries
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
        physical = self.tables.physical[layer, blocks]
        count = physical.numel()
        if count == 0:
            return
        first = int(physical[0])
        if count > 1 and int(physical[-1]) - first == count - 1 and bool((physical.diff() == 1).all()):
            keys = pool.keys[first : first + count]  # consecutive blocks (a fresh prefill): a view, no gather
        else:
            keys = pool.keys[physical.to(pool.keys.device)]
        self.stats.summarize_keys(layer, blocks, keys, self.tables.num_tokens[layer, blocks])

    def refresh_key_stats(self) -> None:
        """Bring the newest block's key summaries up to date in every layer that decoded since its last
        summary (a chunked forward summarises every block it writes; merges re-summarise what they change)."""
        for layer in sorted(self.key_stats_stale):
            n = self.tables.num_logical(layer)
            if n and self.pools[layer]:
                self.summarize_keys(layer, torch.tensor([n - 1]))
        self.key_stats_stale.clear()

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
        self._restore_heads(layer, block)
        for tier in (Tier.HOST, Tier.DISK):
            pool = self.pools[layer].get(tier)
            if pool is not None and pool.allocator.num_free:
                self._move(layer, block, Tier.DEVICE, tier)
                break
        else:
            self.device_pool(layer).allocator.free(int(self.tables.physical[layer, block]))
            self.tables.move(layer, block, Tier.DROPPED)
            tier = Tier.DROPPED
        self._leave_mirror(layer, block)
        self._log("evict", layer, block, tier)
        return tier

    def drop_head(self, layer: int, block: int, head: int) -> Tier:
        """KV head ``head`` of ``layer`` stops attending ``block``: kvpress's per-head pruning, done as kvpress does
        it, by masking (the block's tokens get a -inf log weight for that head, the additive attention bias merges
        use). When the block's last head goes, the block is evicted (``evict``: host, disk or dropped) and its
        memory freed; until then it stays resident for the other heads, so its memory and the bytes read for it
        are not saved, while the budget counts only its heads still attending (``device_load``). Returns the
        block's tier. Refused (``CacheOperationError``) for pinned or non-device blocks and for a head dropped
        already."""
        self._check_evictable(layer, block, "drop_head")
        if not 0 <= head < self.num_kv_heads:
            raise CacheOperationError(f"drop_head: KV head {head} is out of range 0..{self.num_kv_heads - 1}")
        dropped = self.head_dropped[layer, :, block]
        if bool(dropped[head]):
            raise CacheOperationError(f"drop_head: KV head {head} of layer {layer} already dropped block {block}")
        if int(dropped.sum()) + 1 == self.num_kv_heads:
            return self.evict(layer, block)
        dropped[head] = True
        self.any_head_dropped = True
        pool = self.device_pool(layer)
        pool.log_weights[int(self.tables.physical[layer, block]), :, head] = float("-inf")
        pool.has_merged = True
        self.layers[layer].mirror_stale = True
        self._log("drop_head", layer, block, Tier.DEVICE)
        return Tier.DEVICE

    def device_load(self, layer: int) -> float:
        """The device blocks of ``layer``, each counted by the share of its KV heads still attending it: what a
        budget bounds (equal to the device block count when no head was dropped)."""
        blocks = self.tables.count_in(layer, Tier.DEVICE)
        if not self.any_head_dropped:
            return float(blocks)
        n = self.tables.num_logical(layer)
        dropped = self.head_dropped[layer, :, :n]
        if not bool(dropped.any()):
            return float(blocks)
        on_device = self.tables.tier[layer, :n] == Tier.DEVICE
        return blocks - float((dropped & on_device).sum()) / self.num_kv_heads

    def _restore_heads(self, layer: int, block: int) -> None:
        """Undo a block's head drops (before it leaves the device: a later prefetch brings it back whole)."""
        dropped = self.head_dropped[layer, :, block]
        if bool(dropped.any()):
            pool = self.device_pool(layer)
            weights = pool.log_weights[int(self.tables.physical[layer, block])]
            weights[:, dropped.to(weights.device)] = 0.0
            dropped.zero_()

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

    def clone(self, **config_changes) -> PagedKVCache:
        """An independent copy of a cache that has nothing offloaded (e.g. right after a dense prefill), to run
        several policies from one shared prefill. ``config_changes`` may change the tiers' sizes, ``disk_dir``,
        the statistics knobs and ``track_query_max``; the block size, capacity and device pool stay."""
        fixed = ("block_size", "max_tokens", "device_blocks")
        changed = sorted(name for name in config_changes if name in fixed and config_changes[name] != getattr(self.config, name))
        if changed:
            raise ValueError(f"clone: {changed} cannot change (the tables and device pool are copied as they are)")
        if any(self.tables.count_in(layer, tier) for layer in range(self.num_layers) for tier in (Tier.HOST, Tier.DISK)):
            raise ValueError("clone: the cache has offloaded blocks; only a cache with nothing on host or disk is cloned")
        config = CacheConfig(**{**self.config.__dict__, **config_changes})
        new = PagedKVCache(self.model_config, config)
        new.tables = copy.deepcopy(self.tables)
        new.head_dropped, new.any_head_dropped = self.head_dropped.clone(), self.any_head_dropped
        stats = copy.deepcopy(self.stats)
        stats.track_query_max, stats.recent_decay, stats.attended_share = (
            config.track_query_max, config.recent_decay, config.attended_share)
        if config.track_query_max and stats.acc_mass_heads is not None and stats.query_max_heads is None:
            stats.query_max_heads = torch.zeros_like(stats.acc_mass_heads)
        new.stats = stats
        for layer, pools in enumerate(self.pools):
            if not pools:
                continue
            source = pools[Tier.DEVICE]
            _, _, kv_heads, head_dim = source.kv_shape
            new._init_pools(layer, kv_heads, head_dim, source.dtype, source.keys.device)
            target = new.pools[layer][Tier.DEVICE]
            target.keys.copy_(source.keys)
            target.values.copy_(source.values)
            target.log_weights.copy_(source.log_weights)
            target.has_merged = source.has_merged
            target.allocator = copy.deepcopy(source.allocator)
            old_layer, new_layer = self.layers[layer], new.layers[layer]
            for name in ("resident", "mirror_stale", "dtype", "device", "is_initialized", "positions_synced",
                         "norms_synced", "mirror_end"):
                setattr(new_layer, name, getattr(old_layer, name))
            new_layer.pending_removals = list(old_layer.pending_removals)
            # the new layer's mirror tensors are views of the new cache's stacked storage: copy into them
            for name in ("mirror_keys", "mirror_values", "mirror_blocks", "mirror_log_weights", "mirror_positions",
                         "mirror_norms"):
                getattr(new_layer, name).copy_(getattr(old_layer, name))
        for name in ("bytes_per_token", "mirror_bytes_copied", "sentence_query_count", "last_forward_tokens",
                     "last_forward_queries"):
            setattr(new, name, getattr(self, name))
        for name in ("bytes_read", "last_bytes_read", "attention_calls", "last_query", "window_queries"):
            setattr(new, name, list(getattr(self, name)))
        new.sentence_query_sum = [None if q is None else q.clone() for q in self.sentence_query_sum]
        new.sentence_end = self.sentence_end.clone()
        new.bytes_moved = defaultdict(int, self.bytes_moved)
        new.operation_log = list(self.operation_log)
        new.key_stats_stale = set(self.key_stats_stale)
        return new

    def reopen_disk(self) -> None:
        """Unmap and map again every layer's disk pool (the content survives; used to check persistence)."""
        for pools in self.pools:
            if Tier.DISK in pools:
                pools[Tier.DISK].reopen()

    def close(self) -> None:
        """Release the pools and delete the disk tier's files and folder. The device storage goes back to a
        small process-wide pool that the next cache of the same shape reuses (see ``DeviceStack``): tensors
        taken from a closed cache (``resident_keys_values``, pool views) must not be used after ``close()``."""
        for pools in self.pools:
            for pool in pools.values():
                pool.close()
        for layer in self.layers:
            layer.mirror_keys = layer.mirror_values = layer.mirror_blocks = layer.mirror_log_weights = None
            layer.mirror_positions = layer.mirror_norms = None
        for stack in self._stacks:
            stack.release()
        self.pools = [{} for _ in range(self.num_layers)]
        self._stacks, self._stack_of = [], [None] * self.num_layers
        if self.disk_dir is not None:
            self._remove_disk_dir()

    def _log(self, operation: str, layer: int, block: int, destination: Tier) -> None:
        self.operation_log.append({"op": operation, "layer": layer, "block": block, "to": destination.name.lower(),
                                   "seen": self.tables.seen[layer]})

    def enforce_budget(self, budget_blocks: list[int], rule: str = "lowest_mass") -> int:
        """Evict until every layer's ``device_load`` is at most ``budget_blocks[layer]``; returns evictions made.

        ``rule`` picks the victim among unpinned device blocks: ``lowest_mass`` (lowest accumulated
        attention mass, ties to the oldest), ``heavy_recent`` (H2O's split: the newest ``budget // 2``
        logical blocks are a protected recent window, the others go by lowest accumulated mass; recent
        blocks are taken, by mass, only when nothing else is left) or ``oldest``.
        """
        if rule not in FALLBACK_RULES:
            raise ValueError(f"unknown fallback rule {rule!r}: use one of {FALLBACK_RULES}")
        evictions = 0
        n = self.num_logical_blocks()
        order = None
        for layer in range(self.num_layers):
            load = self.device_load(layer)
            excess = math.ceil(load - budget_blocks[layer] - 1e-9)
            if excess <= 0:
                continue
            candidates = self.tables.blocks_in(layer, Tier.DEVICE)
            candidates = candidates[~self.pinned_mask(layer)[candidates]]
            if order is None:  # cache.fallback's eviction keys, computed once for all layers
                order = torch.from_numpy(eviction_key(self.stats.acc_mass[:, :n], budget_blocks, rule))
            # stable sort keeps ascending block order among equal keys: oldest first
            candidates = candidates[torch.sort(order[layer, candidates], stable=True).indices]
            for block in candidates.tolist():  # a block some heads dropped frees less than a whole block
                if load <= budget_blocks[layer] + 1e-9:
                    break
                load -= 1.0 - float(self.head_dropped[layer, :, block].sum()) / self.num_kv_heads
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
