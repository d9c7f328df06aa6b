"""StreamingLLM, sliding window and LRU pin down their rules on constructed views."""

import torch

from agents.baselines.lru import LRU
from agents.baselines.streaming_llm import SlidingWindow, StreamingLLM
from cache.controller import CacheView, Op
from cache.paged_cache import CacheConfig, PagedKVCache


@torch.no_grad()
def view_of(model, tokens=160, budget=4):
    cache = PagedKVCache(model.config, CacheConfig())
    model(input_ids=torch.randint(2, 256, (1, tokens), generator=torch.Generator().manual_seed(1)), cache=cache,
          use_cache=True)
    return cache, CacheView.from_cache(cache, [budget, budget])


def evicted(decisions, layer=0):
    return sorted(d.block for d in decisions if d.layer == layer and d.op == Op.EVICT)


def test_streaming_llm_keeps_sinks_and_recent_blocks(tiny_model):
    _, view = view_of(tiny_model)  # blocks 0..9, budget 4: keep sink 0 + 7, 8, 9
    assert evicted(StreamingLLM().decide(view)) == [1, 2, 3, 4, 5, 6]
    # a 20-token sink covers blocks 0 and 1
    assert evicted(StreamingLLM(n_sink=20).decide(view)) == [2, 3, 4, 5, 6, 7]
    assert evicted(SlidingWindow().decide(view)) == [1, 2, 3, 4, 5, 6]


def test_lru_evicts_the_least_recently_used_blocks(tiny_model):
    cache, view = view_of(tiny_model)
    view.last_attended[0] = torch.tensor([-1, 300, 120, -1, 500, 250, -1, 400, 90, -1])
    view.last_attended[1] = -1
    # never attended counts as used when written (block b ends at 16 (b + 1)): last uses are
    # b1 300, b2 120, b3 64, b4 500, b5 250, b6 112, b7 400, b8 max(90, 144) = 144; keep the two most recent
    assert evicted(LRU().decide(view)) == [1, 2, 3, 5, 6, 8]
    assert evicted(LRU().decide(view), layer=1) == [1, 2, 3, 4, 5, 6]  # never attended: written order
