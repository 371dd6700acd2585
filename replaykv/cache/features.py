"""The image feature cache: span vectors of recently seen images, by content digest.

Replay recomputes prompt rows from layer 0, so a replayed row inside an image span needs that
image's span vectors (the tower's output), never the placeholder token's embedding. A request
carries its images (the OpenAI API resends them every turn), so the vectors can always be
rebuilt by running the tower again; this cache keeps them for a short time so that a follow-up
turn, a replay or a second request with the same image skips the tower. Entries are keyed by
the image's content digest (one model per engine, so the digest names the vectors), bounded in
bytes (least recently used first out) and expire after ``ttl_s`` like the SWA pool's entries.

Not for: anything persistent (vectors are cheap to rebuild from pixels the request carries).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class FeatureStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    expired: int = 0


class FeatureCache:
    """Digest -> span vectors [L, hidden], at most ``capacity_bytes``, each kept ``ttl_s``.

    ``get`` returns None on a miss (absent or expired); ``put`` keeps the tensor as given (the
    caller does not modify it afterwards). A tensor larger than the capacity is not kept.
    Thread-safe.
    """

    def __init__(
        self, capacity_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if capacity_bytes < 0 or ttl_s <= 0:
            raise ValueError("the feature cache needs capacity_bytes >= 0 and ttl_s > 0")
        self.capacity_bytes = capacity_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._items: OrderedDict[bytes, tuple[torch.Tensor, float]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.stats = FeatureStats()

    @staticmethod
    def _size(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def get(self, digest: bytes) -> torch.Tensor | None:
        with self._lock:
            item = self._items.get(digest)
            if item is None:
                self.stats.misses += 1
                return None
            tensor, stored = item
            if self._clock() - stored > self.ttl_s:
                self._drop(digest)
                self.stats.expired += 1
                self.stats.misses += 1
                return None
            self._items.move_to_end(digest)
            self.stats.hits += 1
            return tensor

    def put(self, digest: bytes, tensor: torch.Tensor) -> None:
        size = self._size(tensor)
        with self._lock:
            if digest in self._items:
                self._drop(digest)
            if size > self.capacity_bytes:
                return
            while self._bytes + size > self.capacity_bytes and self._items:
                self._drop(next(iter(self._items)))
                self.stats.evictions += 1
            self._items[digest] = (tensor, self._clock())
            self._bytes += size

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0

    def _drop(self, digest: bytes) -> None:
        tensor, _ = self._items.pop(digest)
        self._bytes -= self._size(tensor)

    def __len__(self) -> int:
        return len(self._items)

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def as_dict(self) -> dict[str, int]:
        s = self.stats
        return {
            "entries": len(self._items),
            "used_bytes": self._bytes,
            "capacity_bytes": self.capacity_bytes,
            "hits": s.hits,
            "misses": s.misses,
            "evictions": s.evictions,
            "expired": s.expired,
        }
