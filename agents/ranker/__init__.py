"""The ranking policy: a per-block scorer that decides every block of every layer (``cache.ranking``)."""
