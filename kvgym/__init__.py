"""kvgym: Gymnasium environments over a live, paged KV cache. ``import kvgym`` registers them."""

from gymnasium.envs.registration import register

register(
    id="kvgym/PagedKVCache-v0",
    entry_point="kvgym.envs.paged_kv:PagedKVCacheEnv",
    max_episode_steps=4096,
)
