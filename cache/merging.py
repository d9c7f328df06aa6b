"""Merges of device blocks for ``PagedKVCache`` (a mixin): the batched nearest-key fold of D2O / ToMe, planned over
every layer of a stacked storage at once, then applied to the pools, the mirrors and the key summaries."""

from __future__ import annotations

import torch

from cache.device_stack import DeviceStack, inverse_norm, row_block
from cache.errors import CacheOperationError
from cache.tiers import Tier

MERGE_CHUNK = 1 << 24  # most similarity scores (floats) a merge holds at once; larger batches go in chunks


class MergeMixin:
    """``merge`` / ``merge_blocks`` of ``PagedKVCache`` (its tables, pools, mirrors and statistics)."""

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
        groups: dict[int, tuple[DeviceStack, list[int]]] = {}
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

    def _plan_merge(self, stack: DeviceStack, layers: list[int], by_layer: dict[int, list[int]],
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
        inverse_norms = row_block(stack.mirror_norms, rows, width)[..., None]
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
                stack.mirror_norms.view(-1).index_copy_(0, target_rows, inverse_norm(merged))
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

    def _summarize_heads(self, stack: DeviceStack, layers: torch.Tensor, blocks: torch.Tensor,
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
