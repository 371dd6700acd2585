"""The three ledgers: device KV pool, SWA host pool and persistent global-KV store.

Not for: model math (see :mod:`replaykv.model`) or scheduling (see :mod:`replaykv.engine`).
"""
