"""The DeepSeek-V4 family text model: configs, layers, cache views and checkpoints.

The model owns no cache state: every forward receives a :class:`CacheView` that the caller
allocated. Not for: pages, tiers, hashes or TTLs (see :mod:`replaykv.cache`).
"""
