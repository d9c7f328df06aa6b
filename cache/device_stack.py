"""The device pools and resident mirrors of a paged cache's layers, stacked in single tensors so that a batched
operation (a merge, a mirror compaction) indexes every layer in one gather / scatter (``cache.paged_cache``)."""

from __future__ import annotations

import torch


class DeviceStack:
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
    released: list[DeviceStack] = []
    RELEASED_MAX = 2

    @classmethod
    def take(cls, layers: list[int], num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
             dtype: torch.dtype, device) -> DeviceStack:
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
            DeviceStack.released = ([self] + DeviceStack.released)[: DeviceStack.RELEASED_MAX]

    @property
    def geometry(self) -> tuple:
        return (self.layers, self.num_blocks, self.capacity, self.kv_heads, self.head_dim, self.dtype, self.device)

    def fits(self, layer: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device) -> bool:
        return (layer in self.row and (kv_heads, head_dim, dtype) == (self.kv_heads, self.head_dim, self.dtype)
                and torch.device(device) == self.device)

    def pool_storage(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        row = self.row[layer]
        return self.pool_keys[row], self.pool_values[row], self.pool_log_weights[row]


def inverse_norm(keys: torch.Tensor) -> torch.Tensor:
    """1 / the L2 norm over the last dim, in fp32 (a zero key gets 1e12: its cosine with anything is 0)."""
    return torch.linalg.vector_norm(keys.float(), dim=-1).clamp_(min=1e-12).reciprocal_()


def row_block(tensor: torch.Tensor, rows: list[int], end: int) -> torch.Tensor:
    """``tensor[rows, ..., :end]`` along dim 1 (2-D) or 2 (4-D): a view when ``rows`` is a contiguous range."""
    if rows == list(range(rows[0], rows[-1] + 1)):
        picked = tensor[rows[0] : rows[-1] + 1]
    else:
        picked = tensor[torch.tensor(rows, device=tensor.device)]
    return picked[:, :end] if tensor.dim() == 2 else picked[:, :, :end]
