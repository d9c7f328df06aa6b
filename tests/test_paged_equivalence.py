"""The paged cache decodes exactly like transformers' DynamicCache (tiny random Llama, 2 layers, GQA)."""

import pytest
import torch
from transformers import DynamicCache

from cache.paged_cache import CacheConfig, PagedKVCache, PagedLayer

PROMPT_LEN, DECODE_STEPS = 40, 50  # 40 tokens: the newest block is partially filled


class PhysicalLengthLayer(PagedLayer):
    """Negative control: reports the slots reserved in the pool (whole blocks), not the tokens seen."""

    def get_seq_length(self) -> int:
        return self.cache.tables.num_logical(self.layer_idx) * self.cache.block_size


class PhysicalLengthCache(PagedKVCache):
    layer_class = PhysicalLengthLayer


class ResidentLengthLayer(PagedLayer):
    """Negative control: reports the resident (attended) token count as the sequence length."""

    def get_seq_length(self) -> int:
        return self.cache.tables.resident_tokens(self.layer_idx)


class ResidentLengthCache(PagedKVCache):
    layer_class = ResidentLengthLayer


def prompt_ids(length=PROMPT_LEN, seed=1, vocab=256):
    return torch.randint(2, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def greedy_loop(model, cache, ids, steps=DECODE_STEPS, chunk=None):
    """Prefill (in chunks if given), then greedy decode; returns (tokens, stacked next-token logits)."""
    chunk = chunk or ids.shape[1]
    for start in range(0, ids.shape[1], chunk):
        out = model(input_ids=ids[:, start : start + chunk], cache=cache, use_cache=True)
    logits = [out.logits[0, -1]]
    tokens = [int(logits[-1].argmax())]
    for _ in range(steps - 1):
        out = model(input_ids=torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
        logits.append(out.logits[0, -1])
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)


def matches(tokens, logits, ref_tokens, ref_logits, tolerance=1e-4) -> bool:
    """The equivalence criterion every test here uses: identical greedy tokens and logits within tolerance."""
    return tokens == ref_tokens and (logits - ref_logits).abs().max().item() < tolerance


def test_manual_loop_matches_dynamic_cache(tiny_model):
    ids = prompt_ids()
    ref_tokens, ref_logits = greedy_loop(tiny_model, DynamicCache(config=tiny_model.config), ids)
    tokens, logits = greedy_loop(tiny_model, PagedKVCache(tiny_model.config), ids)
    assert tokens == ref_tokens
    assert (logits - ref_logits).abs().max().item() < 1e-4


@pytest.mark.parametrize("chunk", [16, 7])
def test_chunked_prefill_matches_dynamic_cache(tiny_model, chunk):
    ids = prompt_ids()
    ref_tokens, ref_logits = greedy_loop(tiny_model, DynamicCache(config=tiny_model.config), ids)
    tokens, logits = greedy_loop(tiny_model, PagedKVCache(tiny_model.config), ids, chunk=chunk)
    assert tokens == ref_tokens
    assert (logits - ref_logits).abs().max().item() < 1e-4


def test_generate_matches_dynamic_cache(tiny_model):
    ids = prompt_ids()
    kwargs = dict(max_new_tokens=DECODE_STEPS, do_sample=False, output_scores=True, return_dict_in_generate=True,
                  pad_token_id=1, eos_token_id=None)
    ref = tiny_model.generate(ids, cache=DynamicCache(config=tiny_model.config), **kwargs)
    cache = PagedKVCache(tiny_model.config)
    out = tiny_model.generate(ids, cache=cache, **kwargs)
    assert out.sequences.tolist() == ref.sequences.tolist()
    assert (torch.stack(out.scores) - torch.stack(ref.scores)).abs().max().item() < 1e-4
    assert cache.seen == PROMPT_LEN + DECODE_STEPS - 1  # the last token is sampled, never fed back


def test_negative_control_physical_length_fails(tiny_model):
    """Reporting the pool's reserved length instead of tokens seen shifts positions: the test must fail."""
    ids = prompt_ids()
    ref_tokens, ref_logits = greedy_loop(tiny_model, DynamicCache(config=tiny_model.config), ids)
    tokens, logits = greedy_loop(tiny_model, PhysicalLengthCache(tiny_model.config), ids)
    assert not matches(tokens, logits, ref_tokens, ref_logits)


def dynamic_cache_holding(model, ids, keep_per_layer):
    """A DynamicCache that holds exactly the token indices ``keep_per_layer[layer]`` of a full prefill."""
    full = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, cache=full, use_cache=True)
    for layer, keep in enumerate(keep_per_layer):
        index = torch.tensor(keep)
        full.layers[layer].keys = full.layers[layer].keys[:, :, index].contiguous()
        full.layers[layer].values = full.layers[layer].values[:, :, index].contiguous()
    return full


@torch.no_grad()
def decode_with_positions(model, cache, first_token, start_position, steps):
    tokens, logits, token = [], [], first_token
    for step in range(steps):
        out = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True,
                    position_ids=torch.tensor([[start_position + step]]))
        logits.append(out.logits[0, -1])
        token = int(logits[-1].argmax())
        tokens.append(token)
    return tokens, torch.stack(logits)


@torch.no_grad()
def paged_after_eviction(model, cache_class, ids, evictions, steps):
    cache = cache_class(model.config, CacheConfig(block_size=16))
    out = model(input_ids=ids, cache=cache, use_cache=True)
    first = int(out.logits[0, -1].argmax())
    for layer, block in evictions:
        cache.evict(layer, block)
    tokens, logits = [], []
    token = first
    for _ in range(steps):
        out = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True)
        logits.append(out.logits[0, -1])
        token = int(logits[-1].argmax())
        tokens.append(token)
    return first, cache, tokens, torch.stack(logits)


def test_eviction_keeps_positions(tiny_model):
    """Evict middle blocks (different ones per layer): decode equals a DynamicCache holding the same tokens
    with explicit position_ids; kept tokens keep their true positions."""
    ids = prompt_ids(length=90)  # 6 blocks, the last one partial
    evictions = [(0, 1), (0, 2), (1, 3)]
    first, cache, tokens, logits = paged_after_eviction(tiny_model, PagedKVCache, ids, evictions, steps=20)
    keep = [[t for t in range(90) if t // 16 not in (1, 2)], [t for t in range(90) if t // 16 != 3]]
    reference = dynamic_cache_holding(tiny_model, ids, keep)
    ref_tokens, ref_logits = decode_with_positions(tiny_model, reference, first, 90, steps=20)
    assert tokens == ref_tokens
    assert (logits - ref_logits).abs().max().item() < 1e-4
    assert cache.seen == 110
    assert cache.resident_tokens(0) == 110 - 32 and cache.resident_tokens(1) == 110 - 16
    # a negative control that loses the logical length must not match the same reference
    _, _, bad_tokens, bad_logits = paged_after_eviction(tiny_model, ResidentLengthCache, ids, evictions, steps=20)
    assert not matches(bad_tokens, bad_logits, ref_tokens, ref_logits)


def test_offload_then_prefetch_is_bit_exact(tiny_model):
    ids = prompt_ids(length=90)
    ref_tokens, ref_logits = greedy_loop(tiny_model, DynamicCache(config=tiny_model.config), ids, steps=20)
    cache = PagedKVCache(tiny_model.config, CacheConfig(host_blocks=8))
    with torch.no_grad():
        tiny_model(input_ids=ids, cache=cache, use_cache=True)
        for layer in range(2):
            for block in (1, 2, 3):
                cache.evict(layer, block)
        assert cache.blocks_per_tier()["host"] == [3, 3]
        assert cache.resident_tokens(0) == 90 - 48
        for layer in range(2):
            for block in (3, 1, 2):  # prefetch lands on other physical blocks, out of order
                cache.prefetch(layer, block)
    assert cache.blocks_per_tier()["host"] == [0, 0]
    bytes_per_block = 2 * 16 * 2 * 16 * 4  # K+V, block_size 16, 2 KV heads, head_dim 16, fp32
    assert cache.bytes_moved[("device", "host")] == 6 * bytes_per_block
    assert cache.bytes_moved[("host", "device")] == 6 * bytes_per_block
    # continue from the same state as the reference: decode from the prompt's last logits
    tokens, logits = [], []
    with torch.no_grad():
        token = ref_tokens[0]
        for _ in range(19):
            out = tiny_model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True)
            logits.append(out.logits[0, -1])
            token = int(logits[-1].argmax())
            tokens.append(token)
    assert tokens == ref_tokens[1:]
    assert (torch.stack(logits) - ref_logits[1:]).abs().max().item() < 1e-4
