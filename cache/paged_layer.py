"""One decoder layer's view of the paged cache (``cache.paged_cache``): the transformers ``CacheLayerMixin`` whose
``update`` writes new tokens into the block pool and the layer's resident mirror, which attention reads."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import CacheLayerMixin

from cache.device_stack import DeviceStack, inverse_norm

if TYPE_CHECKING:
    from cache.paged_cache import PagedKVCache


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
        # the device pool and the mirror are views of the cache's stacked storage (see DeviceStack)
        self.cache._init_pools(self.layer_idx, kv_heads, head_dim, key_states.dtype, key_states.device)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def attach(self, stack: DeviceStack, row: int) -> None:
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
            self.mirror_norms[:, start:end] = inverse_norm(keys)
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
