"""kvgym: Gymnasium environments over a live, paged KV cache. ``import kvgym`` registers them."""

from gymnasium.envs.registration import register

register(
    id="kvgym/KVCache-v1",  # the live cache on the ranking action (kvgym.envs.kvcache)
    entry_point="kvgym.envs.kvcache:KVCacheEnv",
    max_episode_steps=4096,
)

register(
    id="kvgym/PagedKVCache-v0",
    entry_point="kvgym.envs.paged_kv:PagedKVCacheEnv",
    vector_entry_point="kvgym.envs.vector:PagedKVCacheVectorEnv",  # one model, batched forwards
    max_episode_steps=4096,
)

register(
    id="kvgym/PagedKVCacheReplay-v0",
    entry_point="kvgym.envs.replay:PagedKVCacheReplayEnv",
    max_episode_steps=4096,
)
