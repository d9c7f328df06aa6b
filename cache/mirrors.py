"""Upkeep of the resident mirrors for ``PagedKVCache`` (a mixin): removals of blocks that left the device, in one
batched compaction per stacked storage, keeping every mirror block-aligned (see ``cache.paged_cache``)."""

from __future__ import annotations

import torch

from cache.device_stack import DeviceStack, row_block


class MirrorMixin:
    """The mirror maintenance of ``PagedKVCache``: pending removals, syncs, block sums, hole filling."""

    def _leave_mirror(self, layer: int, block: int) -> None:
        """``layer``'s ``block`` left the device: remove its tokens from the mirror at the next sync."""
        state = self.layers[layer]
        if not state.mirror_stale:
            state.pending_removals.append(layer * self.max_blocks + block)

    def _sync_mirrors(self) -> None:
        """Bring every layer's mirror up to date with its table: rebuild the stale ones, and remove pending
        blocks from the others in one batched compaction per stack."""
        groups: dict[int, tuple[DeviceStack, list[int]]] = {}
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

    def _local_blocks(self, stack: DeviceStack, layers: list[int], rows: list[int], width: int) -> torch.Tensor:
        """``[G, width]`` the logical block of each of the first ``width`` mirror slots of ``layers`` (slots past
        a layer's resident tokens hold any block id; the caller masks them)."""
        flat = row_block(stack.mirror_blocks, rows, width)
        return (flat - torch.tensor(layers)[:, None] * self.max_blocks).clamp_(0, self.max_blocks - 1)

    def _fill_holes(self, stack: DeviceStack, layers: list[int], holes: torch.Tensor, resident: torch.Tensor) -> None:
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
