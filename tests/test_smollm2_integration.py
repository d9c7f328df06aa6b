"""Integration tests on the real default model (SmolLM2-135M-Instruct, converted by `kvgym setup`)."""

import pytest
import torch
from transformers import DynamicCache

from cache.paged_cache import PagedKVCache
from cache.runner import Runner
from eval.tasks.passkey import passkey_sample, score_passkey
from tests.test_paged_equivalence import greedy_loop

pytestmark = pytest.mark.integration


def prose_ids(tokenizer, text, length):
    ids = tokenizer(text).input_ids
    return torch.tensor([ids[1000 : 1000 + length]])


def test_1000_token_prompt_and_100_greedy_tokens_match_dynamic_cache(smollm2, alice_text):
    model = smollm2.model
    ids = prose_ids(smollm2.tokenizer, alice_text, 1000)
    ref_tokens, ref_logits = greedy_loop(model, DynamicCache(config=model.config), ids, 100)
    tokens, logits = greedy_loop(model, PagedKVCache(model.config), ids, 100)
    assert tokens == ref_tokens
    assert (logits - ref_logits).abs().max().item() < 1e-3  # fp32; decode attention is computed explicitly


def test_passkey_retrieval_at_2k_with_the_full_paged_cache(smollm2):
    sample = passkey_sample(smollm2.tokenizer, 2000, seed=0, depth=0.4)
    ids = smollm2.tokenizer(sample.prompt).input_ids
    assert 1900 <= len(ids) <= 2100
    result = Runner(smollm2.model, smollm2.tokenizer, prefill_chunk=256).run(ids, max_new_tokens=8)
    assert score_passkey(result.text, sample.answer), result.text


@torch.no_grad()
def test_merge_beats_eviction_of_the_same_blocks_on_natural_text(smollm2, alice_text):
    """Fold half of the middle blocks (every layer) vs evict the same blocks; then teacher-force the next
    64 tokens of the text and compare next-token distributions with the full cache (KL, mean per token)."""
    model = smollm2.model
    ids = prose_ids(smollm2.tokenizer, alice_text, 448)
    context, continuation = ids[:, :384], ids[:, 384:]
    blocks = list(range(2, 22, 2)) + list(range(3, 22, 4))  # 15 of the 24 blocks, none pinned

    def continuation_logprobs(operation):
        cache = PagedKVCache(model.config)
        model(input_ids=context, cache=cache, use_cache=True, logits_to_keep=1)
        for layer in range(cache.num_layers):
            for block in blocks:
                if operation is not None:
                    getattr(cache, operation)(layer, block)
        return torch.log_softmax(model(input_ids=continuation, cache=cache, use_cache=True).logits[0].float(), -1)

    full = continuation_logprobs(None)

    def kl(approx):
        return (full.exp() * (full - approx)).sum(-1).mean().item()

    kl_merge, kl_evict = kl(continuation_logprobs("merge")), kl(continuation_logprobs("evict"))
    print(f"KL vs full cache: merge {kl_merge:.4f}, evict {kl_evict:.4f}")
    assert kl_merge < kl_evict
