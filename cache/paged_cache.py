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
(``_DeviceStack``), so a batched operation (``merge_blocks``, the mirror compaction) indexes every layer
in one gather / scatter instead of a Python loop over layers.
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
from transformers.cache_utils import Cache, CacheLayerMixin

from cache.block_table import BlockTables
from cache.fallback import FALLBACK_RULES, eviction_key
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


MERGE_CHUNK = 1 << 24  # most similarity scores (floats) a merge holds at once; larger batches go in chunks


class _DeviceStack:
    """The device pools and resident mirrors of several layers stacked in single tensors; row ``i`` belongs
    to ``layers[i]``, and each layer's ``TierPool`` and mirror tensors are views of its row.

    - ``pool_keys``/``pool_values`` ``[G, blocks, block_size, kv_heads, head_dim]``, ``pool_log_weights``
      ``[G, blocks, block_size, kv_heads]`` (fp32);
    - ``mirror_keys``/``mirror_values`` ``[G, kv_heads, capacity, head_dim]``, ``mirror_log_weights`` and
      ``mirror_norms`` (inverse key norms) ``[G, kv_heads, capacity]`` (fp32), ``mirror_blocks`` and ``mirror_positions``
      ``[G, capacity]`` (int64, on the CPU: they index CPU statistics and tables).
    """

    def __init__(self, layers: list[int], num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device):
        g, capacity = len(layers), num_blocks * block_size
        self.layers = list(layers)
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self.kv_heads, self.head_dim, self.capacity, self.num_blocks = kv_heads, head_dim, capacity, num_blocks
        self.dtype, self.device = dtype, torch.device(device)
        self.pool_keys = torch.empty(g, num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
        self.pool_values = torch.empty_like(self.pool_keys)
        self.pool_log_weights = torch.zeros(g, num_blocks, block_size, kv_heads, dtype=torch.float32, device=device)
        self.mirror_keys = torch.empty(g, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.mirror_values = torch.empty_like(self.mirror_keys)
        self.mirror_log_weights = torch.zeros(g, kv_heads, capacity, dtype=torch.float32, device=device)
        self.mirror_norms = torch.zeros(g, kv_heads, capacity, dtype=torch.float32, device=device)
        self.mirror_blocks = torch.zeros(g, capacity, dtype=torch.int64)
        self.mirror_positions = torch.zeros(g, capacity, dtype=torch.int64)
        self.layer_of_row = torch.tensor(self.layers, dtype=torch.int64)
        self.row_of_layer = torch.full((max(self.layers) + 1,), -1, dtype=torch.int64)
        self.row_of_layer[self.layer_of_row] = torch.arange(g)

    # Storage of closed caches, reused by the next cache of the same geometry: on the CPU a fresh allocation
    # costs a page fault per 4 KiB on first write (the pools and mirrors of a 4k-token SmolLM2 prompt are
    # ~400 MB), which DynamicCache, keeping the model's own key/value tensors, never pays. (CUDA has its own
    # caching allocator.) At most RELEASED_MAX stacks are kept.
    released: list[_DeviceStack] = []
    RELEASED_MAX = 2

    @classmethod
    def take(cls, layers: list[int], num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
             dtype: torch.dtype, device) -> _DeviceStack:
        """A released stack of this geometry (its log weights zeroed; keys, values and the rest are garbage,
        as from ``torch.empty``), else a new one."""
        geometry = (list(layers), num_blocks, block_size * num_blocks, kv_heads, head_dim, dtype, torch.device(device))
        for i, stack in enumerate(cls.released):
            if stack.geometry == geometry:
                del cls.released[i]
                stack.pool_log_weights.zero_()
                stack.mirror_log_weights.zero_()
                return stack
        return cls(layers, num_blocks, block_size, kv_heads, head_dim, dtype, device)

    def release(self) -> None:
        """Give the storage back for reuse (CPU only); its cache must not touch it again."""
        if self.device.type == "cpu":
            _DeviceStack.released = ([self] + _DeviceStack.released)[: _DeviceStack.RELEASED_MAX]

    @property
    def geometry(self) -> tuple:
        return (self.layers, self.num_blocks, self.capacity, self.kv_heads, self.head_dim, self.dtype, self.device)

    def fits(self, layer: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device) -> bool:
        return (layer in self.row and (kv_heads, head_dim, dtype) == (self.kv_heads, self.head_dim, self.dtype)
                and torch.device(device) == self.device)

    def pool_storage(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        row = self.row[layer]
        return self.pool_keys[row], self.pool_values[row], self.pool_log_weights[row]


def _inverse_norm(keys: torch.Tensor) -> torch.Tensor:
    """1 / the L2 norm over the last dim, in fp32 (a zero key gets 1e12: its cosine with anything is 0)."""
    return torch.linalg.vector_norm(keys.float(), dim=-1).clamp_(min=1e-12).reciprocal_()


def _row_block(tensor: torch.Tensor, rows: list[int], end: int) -> torch.Tensor:
    """``tensor[rows, ..., :end]`` along dim 1 (2-D) or 2 (4-D): a view when ``rows`` is a contiguous range."""
    if rows == list(range(rows[0], rows[-1] + 1)):
        picked = tensor[rows[0] : rows[-1] + 1]
    else:
        picked = tensor[torch.tensor(rows, device=tensor.device)]
    return picked[:, :end] if tensor.dim() == 2 else picked[:, :, :end]


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
        # what merges and removals need, filled lazily (see _sync_positions / _sync_norms):
        self.mirror_positions: torch.Tensor | None = None  # [capacity] each slot's token position (CPU)
        self.mirror_norms: torch.Tensor | None = None  # [kv_heads, capacity] each slot's 1 / key norm (fp32)
        self.positions_synced = 0  # mirror_positions is valid below this slot
        self.norms_synced = 0  # mirror_norms is valid below this slot
        self.mirror_end = 0  # position after the last token appended to the mirror
        self.pending_removals: list[int] = []  # flat ids of blocks that left the device since the last sync

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _, kv_heads, _, head_dim = key_states.shape
        # the device pool and the mirror are views of the cache's stacked storage (see _DeviceStack)
        self.cache._init_pools(self.layer_idx, kv_heads, head_dim, key_states.dtype, key_states.device)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def attach(self, stack: _DeviceStack, row: int) -> None:
        """Make this layer's mirror tensors views of ``stack``'s row ``row``."""
        self.mirror_keys = stack.mirror_keys[row : row + 1]
        self.mirror_values = stack.mirror_values[row : row + 1]
        self.mirror_blocks = stack.mirror_blocks[row]
        self.mirror_log_weights = stack.mirror_log_weights[row]
        self.mirror_positions = stack.mirror_positions[row]
        self.mirror_norms = stack.mirror_norms[row]

    @property
    def needs_sync(self) -> bool:
        """The mirror lags the block table (a rebuild or pending removals)."""
        return self.mirror_stale or bool(self.pending_removals)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if key_states.shape[0] != 1:
            raise ValueError(f"PagedKVCache supports batch size 1, got a batch of {key_states.shape[0]}")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        cache, layer = self.cache, self.layer_idx
        num_new = key_states.shape[-2]
        if layer == 0:
            cache.last_forward_tokens = num_new
        if self.needs_sync:  # table changes since the last forward: bring every layer's mirror up to date
            cache._sync_mirrors()
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
            cache.key_stats_stale.add(layer)  # the newest block's summary waits for refresh_key_stats
            logical = block + layer * cache.max_blocks
        else:
            slots, logical = cache.tables.append(layer, num_new, pool.allocator)
            first, last = int(slots[0]), int(slots[-1])
            if last - first == num_new - 1:  # consecutive slots (a fresh prefill): plain slice copies
                pool.flat_keys()[first : last + 1] = key_states[0].transpose(0, 1)
                pool.flat_values()[first : last + 1] = value_states[0].transpose(0, 1)
                if pool.has_merged:
                    pool.flat_log_weights()[first : last + 1] = 0.0
            else:
                pool.flat_keys().index_copy_(0, slots.to(pool.keys.device), key_states[0].transpose(0, 1))
                pool.flat_values().index_copy_(0, slots.to(pool.values.device), value_states[0].transpose(0, 1))
                if pool.has_merged:
                    pool.flat_log_weights().index_fill_(0, slots.to(pool.keys.device), 0.0)
            cache.summarize_keys(layer, torch.arange(int(logical[0]), int(logical[-1]) + 1))
            logical = logical + layer * cache.max_blocks

        end = previous + num_new
        self.mirror_keys[:, :, previous:end] = key_states
        self.mirror_values[:, :, previous:end] = value_states
        self.mirror_blocks[previous:end] = logical
        if pool.has_merged:
            self.mirror_log_weights[:, previous:end] = 0.0
        self.resident = end
        self.mirror_end = cache.tables.seen[layer]
        cache._count_read(layer, self.resident)
        if previous == 0 and self.resident == num_new:
            return key_states, value_states  # a fresh prefill: attend the incoming states, no copy back
        return self.mirror_keys[:, :, : self.resident], self.mirror_values[:, :, : self.resident]

    def _rebuild_mirror(self) -> None:
        """Gather the device-resident tokens, in logical order, from the pool into the mirror."""
        pool = self.cache.device_pool(self.layer_idx)
        slots, blocks = self.cache.tables.resident_slots(self.layer_idx)
        bs = self.cache.block_size
        count = slots.numel()
        self.mirror_positions[:count] = blocks * bs + slots % bs
        slots = slots.to(pool.keys.device)
        self.mirror_keys[0, :, :count] = pool.flat_keys().index_select(0, slots).transpose(0, 1)
        self.mirror_values[0, :, :count] = pool.flat_values().index_select(0, slots).transpose(0, 1)
        self.mirror_blocks[:count] = blocks + self.layer_idx * self.cache.max_blocks
        self.cache.mirror_bytes_copied += count * self.cache.bytes_per_token
        if pool.has_merged:
            self.mirror_log_weights[:, :count] = pool.flat_log_weights().index_select(0, slots).transpose(0, 1)
        self.resident = count
        self.mirror_stale = False
        self.pending_removals = []
        self.positions_synced, self.norms_synced = count, 0
        self.mirror_end = self.cache.tables.seen[self.layer_idx]

    def _sync_positions(self) -> None:
        """Fill ``mirror_positions`` up to ``resident``: the slots past ``positions_synced`` hold the tokens
        appended since the last sync, which are the newest ones, in order, ending at ``mirror_end``."""
        start, end = self.positions_synced, self.resident
        if start < end:
            self.mirror_positions[start:end] = torch.arange(self.mirror_end - (end - start), self.mirror_end)
            self.positions_synced = end

    def _sync_norms(self) -> None:
        """Fill ``mirror_norms`` (each slot's inverse key norm per KV head) up to ``resident``; only merges
        need them."""
        start, end = self.norms_synced, self.resident
        if start < end:
            keys = self.mirror_keys[0, :, start:end]
            self.mirror_norms[:, start:end] = _inverse_norm(keys)
            self.norms_synced = end

    def attention_bias(self) -> torch.Tensor | None:
        """``[kv_heads, resident]`` log weights to add to attention scores, or None when nothing is merged."""
        if not self.cache.device_pool(self.layer_idx).has_merged:
            return None
        return self.mirror_log_weights[:, : self.resident]

    def resident_keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The attended keys/values ``[1, kv_heads, resident, head_dim]`` (after pending table changes), in
        logical order until a block leaves the device, in the mirror's order after that (see the module)."""
        if self.needs_sync:
            self.cache._sync_mirrors()
        return self.mirror_keys[:, :, : self.resident], self.mirror_values[:, :, : self.resident]

    def get_seq_length(self) -> int:
        return self.cache.tables.seen[self.layer_idx]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        resident = self.cache.tables.resident_tokens(self.layer_idx) if self.needs_sync else self.resident
        return resident + query_length, self.get_seq_length() - resident

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.resident = 0
        self.mirror_stale = False
        self.pending_removals = []
        self.positions_synced = self.norms_synced = self.mirror_end = 0


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
        self._stacks: list[_DeviceStack] = []  # stacked device pools and mirrors (see _init_pools)
        self._stack_of: list[_DeviceStack | None] = [None] * self.num_layers
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
            stack = _DeviceStack.take(layers, self.device_blocks, self.block_size, kv_heads, head_dim, dtype, device)
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

    def check_merge(self, layer: int, block: int, others: list[int] = ()) -> None:
        """Refuse (``CacheOperationError``, nothing changed) a merge of ``layer``'s ``block`` that
        ``merge_blocks`` would refuse before comparing any key, given the ``others`` blocks of the same layer
        already in the batch: a pinned or non-device block, a block listed twice, no device block left to
        fold into."""
        self._check_evictable(layer, block, "merge")
        if block in others:
            raise CacheOperationError(f"merge: block {block} of layer {layer} is listed twice")
        if self.tables.count_in(layer, Tier.DEVICE) <= len(others) + 1:
            raise CacheOperationError(f"merge: layer {layer} has no other device block to merge block {block} into")

    def merge(self, layer: int, block: int, min_similarity: float | None = None) -> int:
        """Free a device block, folding each of its tokens into the most similar token that stays.

        Rule: weighted key/value averaging with proportional attention. For each KV head, every token of
        the block joins the resident token (outside the block) whose key is most cosine-similar, as in
        D2O's nearest-neighbour merge (Wan et al., 2024, arXiv 2406.13035, §3.3); the pair is replaced by
        the count-weighted mean of their keys and values and the merged slot's log count is added to its
        attention scores, as in ToMe's proportional attention (Bolya et al., ICLR 2023). When the two keys
        are equal this reproduces their joint attention exactly. Tokens whose best similarity is below
        ``min_similarity`` are dropped instead of folded. Returns the number of tokens folded; refused when
        there is no candidate to fold into. ``merge_blocks`` does the work (one block is a batch of one).
        """
        return self.merge_blocks([(layer, block)], min_similarity)[0]

    def merge_blocks(self, pairs, min_similarity: float | None = None) -> list[int]:
        """Merge many ``(layer, block)`` device blocks at once (``merge``'s rule); returns the tokens folded
        for each pair, in order.

        Simultaneous within a layer: every block of the batch folds into the layer's blocks that stay after
        the batch (never into another block of the batch), so the result does not depend on the order of
        the pairs. All layers go through one batched pass: a gather of the source keys, one matmul against
        each layer's resident keys (cosine similarity through cached key norms), one weighted sum per
        touched (target token, KV head) and one scatter into the pools and the mirrors; the source slots are
        then filled from the mirrors' tails. All or nothing: any refusal (``check_merge``'s, or a block none
        of whose tokens reaches ``min_similarity``) raises before anything changes.
        """
        pairs = [(int(layer), int(block)) for layer, block in pairs]
        if not pairs:
            return []
        by_layer = self._merge_batch(pairs)
        self._sync_mirrors()
        groups: dict[int, tuple[_DeviceStack, list[int]]] = {}
        for layer in sorted(by_layer):
            stack = self._stack_of[layer]
            groups.setdefault(id(stack), (stack, []))[1].append(layer)
        plans = [self._plan_merge(stack, layers, by_layer, min_similarity) for stack, layers in groups.values()]
        if min_similarity is not None:
            for plan in plans:
                for (layer, block), (folded, best) in plan["per_pair"].items():
                    if folded == 0:
                        raise CacheOperationError(
                            f"merge: no token of block {block} in layer {layer} reaches similarity {min_similarity} "
                            f"with a kept token (best {best:.3f}); evict it instead")
        folded = {}
        for plan in plans:
            self._apply_merge(plan)
            folded.update({pair: count for pair, (count, _) in plan["per_pair"].items()})
        for layer, block in pairs:
            self._log("merge", layer, block, Tier.DROPPED)
        return [folded[pair] for pair in pairs]

    def _merge_batch(self, pairs: list[tuple[int, int]]) -> dict[int, list[int]]:
        """The batch's blocks per layer, after ``check_merge``'s checks (vectorised; on any doubt the checks
        run pair by pair, which raises the first refusal's error)."""
        by_layer: dict[int, list[int]] = {}
        valid = True
        for layer, block in pairs:
            blocks = by_layer.setdefault(layer, [])
            if (not 0 <= layer < self.num_layers or not 0 <= block < self.tables.num_logical(layer)
                    or self.is_pinned(layer, block) or block in blocks):
                valid = False
                break
            blocks.append(block)
        if valid:
            tiers = self.tables.tier[[layer for layer, _ in pairs], [block for _, block in pairs]]
            valid = bool((tiers == Tier.DEVICE).all()) and all(
                self.tables.count_in(layer, Tier.DEVICE) > len(blocks) for layer, blocks in by_layer.items())
        if not valid:
            by_layer = {}
            for layer, block in pairs:
                self.check_merge(layer, block, by_layer.get(layer, []))
                by_layer.setdefault(layer, []).append(block)
        return by_layer

    def _plan_merge(self, stack: _DeviceStack, layers: list[int], by_layer: dict[int, list[int]],
                    min_similarity: float | None) -> dict:
        """Find each source token's most similar kept token, per KV head, for the ``layers`` of ``stack``
        (synced mirrors); changes nothing."""
        rows = [stack.row[layer] for layer in layers]
        for layer in layers:
            self.layers[layer]._sync_positions()
            self.layers[layer]._sync_norms()
        resident = torch.tensor([self.layers[layer].resident for layer in layers])
        width = int(resident.max())
        live = torch.arange(width)[None, :] < resident[:, None]  # [G, width]
        columns = max(len(by_layer[layer]) for layer in layers)
        lookup = torch.full((len(layers), self.max_blocks), -1, dtype=torch.int64)  # block -> its column in the batch
        entries = torch.tensor([(i, block, c) for i, layer in enumerate(layers) for c, block in enumerate(by_layer[layer])])
        lookup[entries[:, 0], entries[:, 1]] = entries[:, 2]
        column = lookup.gather(1, self._local_blocks(stack, layers, rows, width))  # [G, width]
        is_source = (column >= 0) & live
        source_row, source_slot = is_source.nonzero(as_tuple=True)
        counts = is_source.sum(dim=1)
        rank = torch.arange(source_row.numel()) - (counts.cumsum(0) - counts)[source_row]
        sources = int(counts.max())
        source_pos = torch.zeros(len(layers), sources, dtype=torch.int64)
        source_pos[source_row, rank] = source_slot
        source_valid = torch.zeros(len(layers), sources, dtype=torch.bool)
        source_valid[source_row, rank] = True
        source_column = torch.zeros(len(layers), sources, dtype=torch.int64)
        source_column[source_row, rank] = column[source_row, source_slot]

        device, heads, capacity = stack.device, stack.kv_heads, stack.capacity
        rows_t = torch.tensor(rows)
        # flat mirror row of (layer, head, slot): (row * heads + head) * capacity + slot
        line = ((rows_t[:, None] * heads + torch.arange(heads)[None, :]) * capacity)[:, :, None]  # [G, kv, 1]
        source_rows = (line + source_pos[:, None, :]).to(device)  # [G, kv, S]
        source_keys = stack.mirror_keys.view(-1, stack.head_dim).index_select(0, source_rows.flatten())
        source_unit = torch.nn.functional.normalize(source_keys.float(), dim=-1).view(*source_rows.shape, -1)
        source_unit = source_unit.transpose(-1, -2)  # [G, kv, dim, S]
        inverse_norms = _row_block(stack.mirror_norms, rows, width)[..., None]
        excluded = (source_row.to(device), slice(None), source_slot.to(device))  # a source slot is no target
        # [G, kv_heads, width, chunk] scores per chunk of sources, so a bulk merge stays within MERGE_CHUNK floats
        chunk = max(1, MERGE_CHUNK // (len(rows) * heads * width))
        best, nearest = [], []
        for first in range(0, sources, chunk):
            scores = []  # the resident keys times the unit source keys, per contiguous run of stack rows
            start = 0
            while start < len(rows):
                stop = start + 1
                while stop < len(rows) and rows[stop] == rows[stop - 1] + 1:
                    stop += 1
                keys = stack.mirror_keys[rows[start] : rows[stop - 1] + 1, :, :width]
                keys = keys if keys.dtype == torch.float32 else keys.float()
                scores.append(torch.matmul(keys, source_unit[start:stop, :, :, first : first + chunk]))
                start = stop
            scores = scores[0] if len(scores) == 1 else torch.cat(scores)
            scores.mul_(inverse_norms)  # cosine: times 1 / |target|
            scores[excluded] = float("-inf")
            for i, count in enumerate(resident.tolist()):  # nor a slot past a layer's resident tokens
                if count < width:
                    scores[i, :, count:] = float("-inf")
            chunk_best, chunk_nearest = scores.max(dim=2)  # [G, kv_heads, chunk]
            best.append(chunk_best)
            nearest.append(chunk_nearest)
        best = best[0] if len(best) == 1 else torch.cat(best, dim=-1)
        nearest = nearest[0] if len(nearest) == 1 else torch.cat(nearest, dim=-1)
        folded = source_valid.to(device)[:, None, :].expand_as(best)
        if min_similarity is not None:
            folded = folded & (best >= min_similarity)
        # per pair: tokens folded (over heads) and the best similarity reached
        per_column = torch.zeros(len(layers), columns, dtype=torch.int64).scatter_add_(
            1, source_column, folded.sum(dim=1).cpu())
        best_column = torch.full((len(layers), columns), float("-inf")).scatter_reduce_(
            1, source_column, best.amax(dim=1).cpu().masked_fill(~source_valid, float("-inf")), "amax")
        per_column, best_column = per_column.tolist(), best_column.tolist()
        per_pair = {(layer, block): (per_column[i][c], best_column[i][c])
                    for i, layer in enumerate(layers) for c, block in enumerate(by_layer[layer])}
        return dict(stack=stack, layers=layers, line=line.to(device), resident=resident, is_source=is_source,
                    source_rows=source_rows, nearest=nearest, folded=folded, per_pair=per_pair, by_layer=by_layer)

    def _apply_merge(self, plan: dict) -> None:
        stack, layers = plan["stack"], plan["layers"]
        heads, capacity, bs, dim = stack.kv_heads, stack.capacity, self.block_size, stack.head_dim
        folded = plan["folded"]
        source_rows = plan["source_rows"][folded]
        target_rows, inverse = torch.unique((plan["line"] + plan["nearest"])[folded], return_inverse=True)
        log_weights = stack.mirror_log_weights.view(-1)
        source_weight = log_weights.index_select(0, source_rows).exp()
        target_weight = log_weights.index_select(0, target_rows).exp()
        new_weight = target_weight.index_put((inverse,), source_weight, accumulate=True)
        # the pool slot of each touched (layer, KV head, token), from the mirror slot's token position
        target_cpu = target_rows.cpu()
        row, head, slot = target_cpu // (heads * capacity), (target_cpu // capacity) % heads, target_cpu % capacity
        layer_of = stack.layer_of_row[row]
        position = stack.mirror_positions[row, slot]
        logical = position // bs
        physical = self.tables.physical[layer_of, logical]
        pool_rows = (((row * stack.num_blocks + physical) * bs + position % bs) * heads + head).to(stack.device)
        for mirror, pool in ((stack.mirror_keys, stack.pool_keys), (stack.mirror_values, stack.pool_values)):
            flat = mirror.view(-1, dim)
            total = (flat.index_select(0, target_rows).float() * target_weight[:, None]).index_put_(
                (inverse,), flat.index_select(0, source_rows).float() * source_weight[:, None], accumulate=True)
            merged = (total / new_weight[:, None]).to(mirror.dtype)
            flat.index_copy_(0, target_rows, merged)
            pool.view(-1, dim).index_copy_(0, pool_rows, merged)
            if mirror is stack.mirror_keys:
                stack.mirror_norms.view(-1).index_copy_(0, target_rows, _inverse_norm(merged))
        log_weights.index_copy_(0, target_rows, new_weight.log())
        stack.pool_log_weights.view(-1).index_copy_(0, pool_rows, new_weight.log())
        # the sources leave the tables, the allocators and the mirrors
        by_layer = plan["by_layer"]
        merged_layers = [layer for layer in layers for _ in by_layer[layer]]
        merged_blocks = [block for layer in layers for block in by_layer[layer]]
        physical_blocks = self.tables.physical[merged_layers, merged_blocks].tolist()
        for layer, physical_block in zip(merged_layers, physical_blocks, strict=True):
            self.device_pool(layer).allocator.free(physical_block)
        self.tables.drop(merged_layers, merged_blocks)
        for layer in layers:
            self.device_pool(layer).has_merged = True
        self._fill_holes(stack, layers, plan["is_source"], plan["resident"])
        self._summarize_heads(stack, layer_of, logical, head)

    def _summarize_heads(self, stack: _DeviceStack, layers: torch.Tensor, blocks: torch.Tensor,
                         heads: torch.Tensor) -> None:
        """Recompute the key summaries (sum, min, max) of the (layer, block, KV head) triples whose keys a merge
        changed, from the pool (only that head's keys: the block's other heads did not change)."""
        stats = self.stats
        if stats.key_sum is None:  # nothing summarised yet: the per-block path creates the tensors
            for layer in layers.unique().tolist():
                self.summarize_keys(layer, blocks[layers == layer].unique())
            return
        kv, bs = stack.kv_heads, self.block_size
        key = torch.unique((layers * self.max_blocks + blocks) * kv + heads)
        head, block_id = key % kv, key // kv
        layer, block = block_id // self.max_blocks, block_id % self.max_blocks
        row = stack.row_of_layer[layer]
        offsets = torch.arange(bs)
        valid = offsets[None, :] < self.tables.num_tokens[layer, block][:, None]  # [Q, block_size]
        first = (row * stack.num_blocks + self.tables.physical[layer, block]) * bs
        # an empty slot of a partial block reads the block's first token instead: min and max ignore duplicates
        pool_rows = ((first[:, None] + offsets * valid) * kv + head[:, None]).to(stack.device)
        keys = stack.pool_keys.view(-1, stack.head_dim).index_select(0, pool_rows.flatten())
        keys = keys.view(*pool_rows.shape, -1).float().cpu()  # [Q, block_size, dim]
        index = (layer, block, head)
        stats.key_min[index] = keys.amin(dim=1)
        stats.key_max[index] = keys.amax(dim=1)
        sums = keys.sum(dim=1)
        partial = (~valid[:, -1]).nonzero().flatten()  # at most each layer's newest block
        if partial.numel():
            sums[partial] = (keys[partial] * valid[partial, :, None]).sum(dim=1)
        stats.key_sum[index] = sums

    # ----------------------------------------------------------------- mirror maintenance
    def _leave_mirror(self, layer: int, block: int) -> None:
        """``layer``'s ``block`` left the device: remove its tokens from the mirror at the next sync."""
        state = self.layers[layer]
        if not state.mirror_stale:
            state.pending_removals.append(layer * self.max_blocks + block)

    def _sync_mirrors(self) -> None:
        """Bring every layer's mirror up to date with its table: rebuild the stale ones, and remove pending
        blocks from the others in one batched compaction per stack."""
        groups: dict[int, tuple[_DeviceStack, list[int]]] = {}
        for state in self.layers:
            if state.mirror_stale:
                state._rebuild_mirror()
            elif state.pending_removals:
                stack = self._stack_of[state.layer_idx]
                groups.setdefault(id(stack), (stack, []))[1].append(state.layer_idx)
        for stack, layers in groups.values():
            for layer in layers:
                self.layers[layer]._sync_positions()
            resident = torch.tensor([self.layers[layer].resident for layer in layers])
            width = int(resident.max())
            removed = torch.zeros(len(layers), self.max_blocks, dtype=torch.bool)
            for i, layer in enumerate(layers):
                removed[i, torch.tensor(self.layers[layer].pending_removals) - layer * self.max_blocks] = True
                self.layers[layer].pending_removals = []
            rows = [stack.row[layer] for layer in layers]
            live = torch.arange(width)[None, :] < resident[:, None]
            holes = removed.gather(1, self._local_blocks(stack, layers, rows, width)) & live
            self._fill_holes(stack, layers, holes, resident)

    def _mirror_block_sums(self, layers: list[int], values: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum per-slot rows over each block of the ``layers``' mirrors: ``values[i]`` ``[K, R_i]`` covers the
        first ``R_i`` slots of ``layers[i]``'s mirror (its resident tokens). Returns the flat block ids ``[B]``
        (``layer * max_blocks + block``) and the sums ``[K, B]``. Relies on the mirror being block-aligned
        (``_fill_holes``): slots ``[g * block_size, (g + 1) * block_size)`` belong to one block."""
        bs = self.block_size
        groups = [-(-v.shape[-1] // bs) for v in values]
        padded = values[0].new_zeros(values[0].shape[0], sum(groups) * bs)
        ids, start = [], 0
        for layer, value, count in zip(layers, values, groups, strict=True):
            padded[:, start : start + value.shape[-1]] = value
            ids.append(self.layers[layer].mirror_blocks[: count * bs : bs])
            start += count * bs
        return torch.cat(ids), padded.view(padded.shape[0], -1, bs).sum(dim=-1)

    def _local_blocks(self, stack: _DeviceStack, layers: list[int], rows: list[int], width: int) -> torch.Tensor:
        """``[G, width]`` the logical block of each of the first ``width`` mirror slots of ``layers`` (slots past
        a layer's resident tokens hold any block id; the caller masks them)."""
        flat = _row_block(stack.mirror_blocks, rows, width)
        return (flat - torch.tensor(layers)[:, None] * self.max_blocks).clamp_(0, self.max_blocks - 1)

    def _fill_holes(self, stack: _DeviceStack, layers: list[int], holes: torch.Tensor, resident: torch.Tensor) -> None:
        """Remove the slots ``holes`` ``[G, width]`` (bool, CPU; whole blocks) from the mirrors of ``layers``,
        keeping the mirror *block-aligned*: slots ``[b * block_size, (b + 1) * block_size)`` hold one full block
        each, and the newest (maybe partial) block comes last. The full blocks past each layer's new block count
        move into the holes below it, then the newest block moves down to the end (keys, values, log weights,
        norms, block ids, positions). Positions must be synced; norms stay valid where they were. The
        attention statistics rely on the alignment (``_mirror_block_sums``)."""
        bs = self.block_size
        groups = -(-holes.shape[1] // bs)
        group_hole = torch.nn.functional.pad(holes, (0, groups * bs - holes.shape[1])).view(len(layers), groups, bs)[..., 0]
        count = (resident + bs - 1) // bs  # blocks in the mirror; the last is the newest, never removed
        last = count - 1
        new_last = last - group_hole.sum(dim=1)
        new_resident = resident - bs * (last - new_last)
        group = torch.arange(groups)[None, :]
        dest_row, dest_group = (group_hole & (group < new_last[:, None])).nonzero(as_tuple=True)
        move_row, move_group = (~group_hole & (group >= new_last[:, None]) & (group < last[:, None])).nonzero(
            as_tuple=True)  # row-major like the destinations: the pairs line up
        offset = torch.arange(bs)
        # the newest block of each layer that lost blocks: its tokens move down to the new end
        moved = (new_last < last).nonzero().flatten()
        newest = offset[None, :] < (resident - bs * last)[moved][:, None]
        dest_row = torch.cat([dest_row.repeat_interleave(bs), moved[:, None].expand(-1, bs)[newest]])
        dest_slot = torch.cat([(dest_group[:, None] * bs + offset).flatten(), (new_last[moved, None] * bs + offset)[newest]])
        move_slot = torch.cat([(move_group[:, None] * bs + offset).flatten(), (last[moved, None] * bs + offset)[newest]])
        row = stack.row_of_layer[torch.tensor(layers)][dest_row]
        for tensor in (stack.mirror_blocks, stack.mirror_positions):
            tensor[row, dest_slot] = tensor[row, move_slot]
        # flat rows of (row, head, slot) in the [G * kv_heads * capacity] views
        line = (row[:, None] * stack.kv_heads + torch.arange(stack.kv_heads)[None, :]) * stack.capacity
        dest_rows = (line + dest_slot[:, None]).flatten().to(stack.device)
        move_rows = (line + move_slot[:, None]).flatten().to(stack.device)
        for tensor in (stack.mirror_keys, stack.mirror_values):
            flat = tensor.view(-1, stack.head_dim)
            flat.index_copy_(0, dest_rows, flat.index_select(0, move_rows))
        for tensor in (stack.mirror_log_weights, stack.mirror_norms):
            flat = tensor.view(-1)
            flat.index_copy_(0, dest_rows, flat.index_select(0, move_rows))
        # a norm moved from at or past norms_synced is not valid in its new slot
        synced = torch.tensor([self.layers[layer].norms_synced for layer in layers])
        invalid = move_slot >= synced[dest_row]
        synced = torch.minimum(synced, new_resident).scatter_reduce_(0, dest_row[invalid], dest_slot[invalid], "amin")
        for layer, count, norms in zip(layers, new_resident.tolist(), synced.tolist(), strict=True):
            state = self.layers[layer]
            state.resident = state.positions_synced = count
            state.norms_synced = norms
        self.mirror_bytes_copied += dest_slot.numel() * self.bytes_per_token

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
        small process-wide pool that the next cache of the same shape reuses (see ``_DeviceStack``): tensors
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
