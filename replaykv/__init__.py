"""replaykv: DeepSeek-V4.1's KV-cache system in Python.

Three ledgers of attention state (global KV on device and in a persistent store, SWA window
snapshots in a short-lived host pool) and SWA bounded replay, on a faithful DeepSeek-V4 / V4.1
model. Not for: training large models or serving the released checkpoints at speed.
"""

from __future__ import annotations

__version__ = "0.1.0"
