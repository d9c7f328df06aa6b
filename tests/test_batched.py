"""One batched forward over several paged caches equals one forward per cache (tiny model), including after
evictions that leave the rows with different resident blocks; a row wired to the wrong cache is caught."""

import copy

import torch

from cache.batched import batched_forward
from cache.controller import Decision, Op, apply_decisions
from cache.paged_cache import CacheConfig, PagedKVCache
from tests.conftest import make_tiny_llama


def prefilled(model, length: int, seed: int, evict: list[int] = ()) -> PagedKVCache:
    cache = PagedKVCache(model.config, CacheConfig(max_tokens=512, host_blocks=64))
    ids = torch.randint(2, 250, (1, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        for start in range(0, length, 32):
            model(input_ids=ids[:, start : start + 32], cache=cache, use_cache=True)
    apply_decisions(cache, [Decision(layer, block, Op.EVICT) for layer in (0, 1) for block in evict])
    return cache


def single_logits(model, cache, ids):
    with torch.no_grad():
        return model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=ids.shape[1]).logits[0]


def test_batched_decode_and_chunk_equal_per_sequence_forwards():
    model = make_tiny_llama()
    caches = [prefilled(model, 100, 0), prefilled(model, 163, 1, evict=[2, 4]), prefilled(model, 70, 2, evict=[1])]
    copies = [copy.deepcopy(cache) for cache in caches]
    for step in range(3):
        ids = torch.tensor([[5 + step], [9], [100 + step]])
        batched = batched_forward(model, caches, ids)
        for row, cache in enumerate(copies):
            expected = single_logits(model, cache, ids[row : row + 1])
            assert torch.allclose(batched[row], expected, atol=1e-5), (step, row)
    chunk = torch.randint(2, 250, (3, 16), generator=torch.Generator().manual_seed(7))
    batched = batched_forward(model, caches, chunk, logits_to_keep=16)
    for row, cache in enumerate(copies):
        assert torch.allclose(batched[row], single_logits(model, cache, chunk[row : row + 1]), atol=1e-5)
    assert [c.seen for c in caches] == [c.seen for c in copies] == [100 + 19, 163 + 19, 70 + 19]
    # the statistics each row's attention leaves behind are its own
    for cache, reference in zip(caches, copies, strict=True):
        assert torch.allclose(cache.stats.acc_mass, reference.stats.acc_mass, atol=1e-5)


def test_rows_wired_to_the_wrong_caches_are_detected():
    """Negative control: feeding row i through cache i+1 must change the logits."""
    model = make_tiny_llama()
    caches = [prefilled(model, 100, 0), prefilled(model, 130, 1)]
    copies = [copy.deepcopy(cache) for cache in caches]
    ids = torch.tensor([[5], [9]])
    wrong = batched_forward(model, caches[::-1], ids)
    right = torch.stack([single_logits(model, cache, ids[row : row + 1]) for row, cache in enumerate(copies)])
    assert not torch.allclose(wrong, right, atol=1e-3)
