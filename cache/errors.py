"""The error every refused cache operation raises (``cache.paged_cache``)."""


class CacheOperationError(ValueError):
    """An operation that the cache refuses (pinned block, wrong tier, no room); the cache is unchanged."""
