"""Tests of the cache tiers (keys, global-KV store, SWA pools, metrics, store CLI)."""
