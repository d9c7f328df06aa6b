"""Gymnasium environments over the paged KV cache."""
