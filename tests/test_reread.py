"""The question's re-read (``cache.copies.reread_tokens``, the runner's ``question_reread``): a question streamed
while part of the context was offloaded is encoded again over every live block, its keys and values written back
where they lie. Reference: a dense forward of the same tokens (nothing offloaded), whose question keys and values the
re-read must reproduce; negative control: the streamed question before the re-read."""

import torch

from agents.registry import make_controller
from cache.controller import CacheView, Decision, Op, apply_decisions
from cache.copies import reread_tokens
from cache.paged_cache import CacheConfig, PagedKVCache
from cache.runner import Prompt, Runner
from cache.tiers import Tier

BLOCK = 8
CONTEXT, QUESTION = 48, 13  # blocks 0..5 of context; the question fills blocks 6 and 7 in part


def ids_of(n, seed=0):
    return torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def question_kv(cache, layer):
    """The question's keys and values ``[QUESTION, kv_heads, dim]`` read from the pools where they lie."""
    view = CacheView.from_cache(cache, [4] * cache.num_layers)
    keys, values, _ = view.block_tensors(layer, torch.arange(CONTEXT // BLOCK, view.num_blocks))
    return keys.flatten(0, 1)[:QUESTION], values.flatten(0, 1)[:QUESTION]


@torch.no_grad()
def streamed_with_offload(model):
    """The context prefilled densely, blocks 1..4 of both layers sent to the host, then the question fed."""
    ids = ids_of(CONTEXT + QUESTION)
    cache = PagedKVCache(model.config, CacheConfig(block_size=BLOCK, host_blocks=16, max_tokens=96))
    model(input_ids=torch.tensor([ids[:CONTEXT]]), cache=cache, use_cache=True)
    apply_decisions(cache, [Decision(layer, block, Op.EVICT) for layer in range(2) for block in (1, 2, 3, 4)])
    model(input_ids=torch.tensor([ids[CONTEXT:]]), cache=cache, use_cache=True)
    return cache, ids


@torch.no_grad()
def test_the_reread_question_has_the_keys_and_values_of_a_question_that_saw_every_block(tiny_model):
    reference = PagedKVCache(tiny_model.config, CacheConfig(block_size=BLOCK, max_tokens=96))
    cache, ids = streamed_with_offload(tiny_model)
    tiny_model(input_ids=torch.tensor([ids]), cache=reference, use_cache=True)
    expected = question_kv(reference, 1)
    before = question_kv(cache, 1)
    assert not torch.allclose(before[0], expected[0], atol=1e-3)  # negative control: streamed without blocks 1..4
    view = CacheView.from_cache(cache, [4, 4], phase="question", model=tiny_model, token_ids=torch.tensor(ids))
    assert reread_tokens(view, CONTEXT) == QUESTION
    # both layers' four offloaded blocks, read once
    assert cache.bytes_moved[("host", "host-attention")] == 2 * 4 * cache.device_pool(0).bytes_per_block
    for layer in range(2):
        after = question_kv(cache, layer)
        want = question_kv(reference, layer)
        assert torch.allclose(after[0], want[0], atol=1e-5) and torch.allclose(after[1], want[1], atol=1e-5), layer
    # the attended mirror follows the pools, and the window queries are the re-encoded question's
    keys, _ = cache.resident_keys_values(1)
    assert torch.allclose(keys[0, :, -QUESTION:].transpose(0, 1), expected[0], atol=1e-5)
    assert cache.window_queries[1].shape[1] == QUESTION
    assert (CacheView.from_cache(cache, [4, 4]).tier[:, 1:5] == Tier.HOST).all()  # nothing moved


def test_runs_reread_the_question_of_every_turn_only_when_the_controller_asks(tiny_model):
    ids, turns = ids_of(70), [ids_of(6, seed=5), ids_of(9, seed=6)]
    prompt = Prompt(ids, context_end=60, turns=turns)
    results = {}
    for reread in (False, True):
        controller = make_controller(f"lookahead:snapkv,tokens=2,question_reread={str(reread).lower()}")
        runner = Runner(tiny_model, cache_config=CacheConfig(block_size=BLOCK, host_blocks=32), controller=controller,
                        budget=0.25, prefill_chunk=16, protocol="multiturn")
        results[reread] = runner.run(prompt, max_new_tokens=4, stop_at_eos=False, keep_logits=True)
    assert results[True].operations["reread"] == 3 and "reread" not in results[False].operations
    assert results[True].bytes_moved["host->host-attention"] > 0 and "host->host-attention" not in results[False].bytes_moved
    # the first answer token already reads the re-encoded question: its logits change
    assert not torch.allclose(results[True].logits[0], results[False].logits[0], atol=1e-4)


@torch.no_grad()
def test_a_question_partly_dropped_is_reread_from_the_block_after_the_drop(tiny_model):
    """Without a host tier an offloaded block is dropped: its tokens cannot be rewritten, so the re-read starts at
    the next block and leaves the dropped one alone; a range that is only the newest block's still re-reads."""
    ids = ids_of(CONTEXT + QUESTION)
    cache = PagedKVCache(tiny_model.config, CacheConfig(block_size=BLOCK, max_tokens=96))  # drop-only
    tiny_model(input_ids=torch.tensor([ids[:CONTEXT]]), cache=cache, use_cache=True)
    apply_decisions(cache, [Decision(layer, block, Op.EVICT) for layer in range(2) for block in (1, 2)])
    tiny_model(input_ids=torch.tensor([ids[CONTEXT:]]), cache=cache, use_cache=True)
    apply_decisions(cache, [Decision(1, CONTEXT // BLOCK, Op.EVICT)])  # the question's first block, in layer 1
    view = CacheView.from_cache(cache, [4, 4], phase="question", model=tiny_model, token_ids=torch.tensor(ids))
    assert reread_tokens(view, CONTEXT) == QUESTION - BLOCK  # re-read from the block after the dropped one
    assert cache.window_queries[1].shape[1] == QUESTION - BLOCK
    assert cache.bytes_moved[("host", "host-attention")] == 0  # nothing off the device is live: nothing read
    view = CacheView.from_cache(cache, [4, 4], phase="question", model=tiny_model, token_ids=torch.tensor(ids))
    assert reread_tokens(view, view.seen - 2) == 2 and cache.window_queries[1].shape[1] == 2
    assert cache.bytes_moved[("host", "host-attention")] == 0


@torch.no_grad()
def test_the_reread_attention_is_a_dense_questions_attention_to_every_block(tiny_model):
    """``attention=True``: the latest-forward statistics become those of the question read over every block, as a
    dense forward's question gives them (reference); negative control: the streamed question gave the offloaded
    blocks nothing, and a re-read without ``attention`` leaves that so."""
    reference = PagedKVCache(tiny_model.config, CacheConfig(block_size=BLOCK, max_tokens=96))
    cache, ids = streamed_with_offload(tiny_model)
    tiny_model(input_ids=torch.tensor([ids[:CONTEXT]]), cache=reference, use_cache=True)
    tiny_model(input_ids=torch.tensor([ids[CONTEXT:]]), cache=reference, use_cache=True)
    n = CacheView.from_cache(cache, [4, 4]).num_blocks
    want = {name: getattr(reference.stats, name)[..., :n] for name in ("last_mass_heads", "last_query_heads")}
    assert (want["last_mass_heads"][:, :, 1:5] > 0).all()
    for attention in (False, True):
        view = CacheView.from_cache(cache, [4, 4], phase="question", model=tiny_model, token_ids=torch.tensor(ids))
        reread_tokens(view, CONTEXT, attention=attention)
        got = cache.stats.last_mass_heads[..., :n]
        assert (got[:, :, 1:5] > 0).all() == attention  # offloaded blocks: attended only by the re-read's stats
    for name, expected in want.items():
        assert torch.allclose(getattr(cache.stats, name)[..., :n], expected, atol=1e-5), name
    assert torch.allclose(cache.stats.last_mass[:, :n], reference.stats.last_mass[:, :n], atol=1e-5)


@torch.no_grad()
def test_the_reread_attention_lands_on_the_blocks_it_belongs_to_after_a_drop(tiny_model):
    """Dropped blocks shift the copy's packing: with blocks 1 and 2 dropped before the question, the streamed
    question already attended exactly the live blocks, so the re-read's attention must equal the streamed one's,
    block for block (a shifted mapping would move the mass onto the wrong blocks and the dropped ones)."""
    ids = ids_of(CONTEXT + QUESTION)
    cache = PagedKVCache(tiny_model.config, CacheConfig(block_size=BLOCK, max_tokens=96))  # drop-only
    tiny_model(input_ids=torch.tensor([ids[:CONTEXT]]), cache=cache, use_cache=True)
    apply_decisions(cache, [Decision(layer, block, Op.EVICT) for layer in range(2) for block in (1, 2)])
    tiny_model(input_ids=torch.tensor([ids[CONTEXT:]]), cache=cache, use_cache=True)
    n = CacheView.from_cache(cache, [4, 4]).num_blocks
    streamed = cache.stats.last_mass_heads[..., :n].clone()
    view = CacheView.from_cache(cache, [4, 4], phase="question", model=tiny_model, token_ids=torch.tensor(ids))
    reread_tokens(view, CONTEXT, attention=True)
    assert (streamed[:, :, 1:3] == 0).all() and (streamed[:, :, 3:] > 0).all()
    assert torch.allclose(cache.stats.last_mass_heads[..., :n], streamed, atol=1e-5)


def test_reread_attention_without_the_reread_is_refused():
    for spec in ("lookahead:snapkv,reread_attention=true", "ranker:policies/ranker_smollm2.pt,reread_attention=true"):
        try:
            make_controller(spec)
        except ValueError as error:
            assert "question_reread=true" in str(error)
        else:
            raise AssertionError(f"{spec} was accepted")
    assert make_controller("lookahead:snapkv,question_reread=true,reread_attention=true").reread_attention
