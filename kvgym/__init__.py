"""kvgym: Gymnasium environments over a live, paged KV cache. ``import kvgym`` registers them."""

from gymnasium.envs.registration import register

register(
    id="kvgym/KVCache-v1",  # the live cache on the ranking action (kvgym.envs.kvcache)
    entry_point="kvgym.envs.kvcache:KVCacheEnv",
    vector_entry_point="kvgym.envs.kvcache:KVCacheVectorEnv",  # gym.make_vec(..., vectorization_mode="vector_entry_point")
    max_episode_steps=4096,
)

register(
    id="kvgym/KVCacheReplay-v1",  # its replay twin over recorded full-cache runs (kvgym.envs.kvcache_replay)
    entry_point="kvgym.envs.kvcache_replay:KVCacheReplayEnv",
    max_episode_steps=4096,
)
