"""Ledger 3: the persistent global-KV store (compressed KV + index-key chunks, opaque bytes).

For: keeping chunk payloads across engine restarts behind the small :class:`GlobalKVStore`
contract; the entry header every layout writes (:data:`STORE_HEADER`, defined once here);
:class:`LocalStore`, what the two on-disk layouts share. The layouts: a file per entry
(``cache/file_store.py``) and a file per written batch (``cache/pack_store.py``).

Not for: serialising tensors (the caller hands in bytes), choosing keys (``cache/keys.py``),
SWA window snapshots (they never touch disk: ``cache/swa_pool.py``), or deciding what to
write (``cache/manager.py``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, NamedTuple, Protocol, TypeVar

from replaykv.cache.faultlog import FaultLog
from replaykv.cache.fileio import (
    crc_sealed,
    is_orphan_temp,
    seal_crc,
)
from replaykv.cache.keys import KEY_BYTES, KeyNamespace
from replaykv.cache.metrics import LabeledCounter, TierMetrics

_log = logging.getLogger(__name__)

__all__ = [
    "STORE_FORMAT_VERSION",
    "STORE_HEADER",
    "STORE_MAGIC",
    "EntryHeader",
    "EntryMeta",
    "GcReport",
    "GlobalKVStore",
    "VerifyReport",
]

Payload = bytes | bytearray | memoryview

STORE_MAGIC = b"RKVCHUNK"
STORE_FORMAT_VERSION = 3

STORE_HEADER = struct.Struct("<8sHHIdQ32s32s32sQI")
"""Header of one store entry file, 140 bytes, little-endian, followed by the payload.

====== ===== ================================================================
offset bytes field
====== ===== ================================================================
0      8     magic ``b"RKVCHUNK"``
8      2     u16 format version (``STORE_FORMAT_VERSION``; anything else is quarantined)
10     2     u16 kv layout version of the payload (from :class:`EntryMeta`)
12     4     u32 flags (0; reserved)
16     8     f64 created_at, seconds on the store's clock
24     8     u64 payload length in bytes (file size = 140 + this)
32     32    namespace digest (``KeyNamespace.seed()``, or zeros)
64     32    key (must equal the file name's key)
96     32    SHA-256 of the payload (checked by ``verify``)
128    8     u64 XXH3-64 of the payload (checked on every read: ~20 GiB/s, so a read costs
             little more than the copy)
136    4     u32 CRC-32 of bytes [0, 136) of the header
====== ===== ================================================================

Versions: 1 had no read-path checksum (132-byte header, SHA-256 checked on every read); 2 used a
CRC-32 of the payload (136 bytes), which cost more than the read itself. Magic and
version sit at the same offsets in every version; a file of another version is a miss and is
quarantined as ``wrong_version`` (entries are a cache: they are recomputed, not migrated).
"""
_CRC_OFFSET = STORE_HEADER.size - 4
_VERSION_PREFIX = struct.Struct("<8sH")  # magic + version, readable whatever the version
_ZERO_DIGEST = bytes(KEY_BYTES)


@dataclass(frozen=True)
class EntryMeta:
    """What the caller records with an entry besides the payload (goes into the header)."""

    namespace_digest: bytes = _ZERO_DIGEST
    kv_layout_version: int = 0

    def __post_init__(self) -> None:
        if len(self.namespace_digest) != KEY_BYTES:
            raise ValueError(f"EntryMeta.namespace_digest must be {KEY_BYTES} bytes (KeyNamespace.seed())")
        if not 0 <= self.kv_layout_version <= 0xFFFF:
            raise ValueError(f"EntryMeta.kv_layout_version must fit in u16; got {self.kv_layout_version}")

    @classmethod
    def for_namespace(cls, namespace: KeyNamespace) -> EntryMeta:
        return cls(namespace_digest=namespace.seed(), kv_layout_version=namespace.kv_layout_version)


class EntryHeader(NamedTuple):
    """A parsed :data:`STORE_HEADER` (a named tuple: immutable and cheap to build on every read)."""

    format_version: int
    kv_layout_version: int
    flags: int
    created_at: float
    payload_len: int
    namespace_digest: bytes
    key: bytes
    payload_sha256: bytes
    payload_xxh3: int

    def pack(self) -> bytes:
        head = STORE_HEADER.pack(
            STORE_MAGIC,
            self.format_version,
            self.kv_layout_version,
            self.flags,
            self.created_at,
            self.payload_len,
            self.namespace_digest,
            self.key,
            self.payload_sha256,
            self.payload_xxh3,
            0,
        )
        return seal_crc(head)

    @classmethod
    def unpack(cls, raw: bytes) -> EntryHeader | str:
        """The header, or the reason (a short string) it cannot be trusted."""
        if len(raw) < _VERSION_PREFIX.size:
            return "truncated"
        whole = len(raw) >= STORE_HEADER.size  # one unpack of everything in the common case
        fields = STORE_HEADER.unpack_from(raw) if whole else _VERSION_PREFIX.unpack_from(raw)
        magic, version = fields[0], fields[1]
        if magic != STORE_MAGIC:
            return "bad_magic"
        if version != STORE_FORMAT_VERSION:
            return "wrong_version"
        if not whole:
            return "truncated"
        _, _, layout, flags, created, length, ns, key, digest, payload_xxh3, crc = fields
        if not crc_sealed(raw[: STORE_HEADER.size], crc):
            return "bad_header_crc"
        return cls(version, layout, flags, created, length, ns, key, digest, payload_xxh3)


@dataclass
class GcReport:
    expired: int = 0
    evicted: int = 0
    bytes_freed: int = 0
    quarantine_purged: int = 0


@dataclass
class VerifyReport:
    checked: int = 0
    ok: int = 0
    bytes_checked: int = 0
    bad: list[tuple[str, str]] = field(default_factory=list)  # (file name, reason)
    quarantined: int = 0


class GlobalKVStore(ABC):
    """Contract of a persistent global-KV tier. Keys are 32-byte digests, payloads opaque bytes.

    * ``get`` returns the exact bytes last published under the key, or ``None`` on a miss. A
      missing, expired, unreadable or corrupt entry is a miss: the store quarantines what fails
      verification and never raises for a bad entry. A partially written entry is never visible.
    * ``put`` is synchronous: when it returns ``True`` the entry is durable and visible; on
      ``False`` (I/O error, too large, read-only) nothing is visible and the failure is counted.
      It may evict other entries to stay within capacity. Re-putting a key replaces it.
    * ``put_many`` is ``put`` for several entries at once, one result per entry: each entry is
      all-or-nothing on its own (a failure of one publishes nothing of it and never a
      non-durable entry); implementations may share the fsyncs of a batch.
    * ``prefetch`` is a hint that the keys will be read soon: it may start reading them in and
      changes nothing else (contents, recency, counters); a missing key is ignored.
    * ``contains`` is a cheap predicate with no side effect on recency; a later ``get`` can still
      miss (eviction, expiry, corruption), so callers must handle that.
    * All methods are safe to call concurrently from several threads. The store owns its files;
      returned ``bytes`` are the caller's.
    * ``stats()`` returns counters with their denominators; ``check_integrity()`` raises
      ``AssertionError`` if an internal conservation law is broken (tests call it after each step).
    """

    @abstractmethod
    def get(self, key: bytes) -> bytes | None: ...

    @abstractmethod
    def put(self, key: bytes, payload: Payload, meta: EntryMeta | None = None) -> bool: ...

    def put_many(self, items: Sequence[tuple[bytes, Payload]], meta: EntryMeta | None = None) -> list[bool]:
        """Publish several entries (distinct keys) under one ``meta``; ``put``'s result for each."""
        return [self.put(key, payload, meta) for key, payload in items]

    def prefetch(self, keys: Sequence[bytes]) -> None:
        """Hint that `keys` will be read soon (default: ignored, which the contract allows)."""
        del keys

    @abstractmethod
    def contains(self, key: bytes) -> bool: ...

    @abstractmethod
    def delete(self, key: bytes) -> bool:
        """Remove the entry; ``True`` if it existed."""

    @abstractmethod
    def stats(self) -> dict[str, object]: ...

    @abstractmethod
    def check_integrity(self) -> None: ...


class _Accessed(Protocol):
    last_access: float


_E = TypeVar("_E", bound=_Accessed)


class LocalStore(GlobalKVStore, Generic[_E]):
    """What the two on-disk layouts (:class:`DirectoryStore`, ``PackStore``) share: the
    constructor's common arguments and checks, the in-memory index of entries with a last access
    (oldest first), retention, key checks, batch checks, the quarantine folder and the counters
    of the start-up scan. Subclasses own the files under ``root/<data_dir>``."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity_bytes: int,
        retention_s: float | None,
        clock: Callable[[], float],
        read_only: bool,
        orphan_grace_s: float,
        data_dir: str,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0; got {capacity_bytes}")
        if retention_s is not None and retention_s <= 0:
            raise ValueError(f"retention_s must be > 0 or None (no expiry); got {retention_s}")
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self.retention_s = retention_s
        self.read_only = read_only
        self.orphan_grace_s = orphan_grace_s
        self._clock = clock
        self._data_dir = self.root / data_dir
        self._quarantine_dir = self.root / "quarantine"
        self.metrics = TierMetrics("global_kv_store")
        self.quarantine_reasons = LabeledCounter()
        self.orphans_swept = 0
        self.temp_files_seen = 0
        self.unknown_files = 0
        self.write_failures = FaultLog(_log, "store write")
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, _E] = OrderedDict()  # oldest access first
        if not read_only:
            self._quarantine_dir.mkdir(parents=True, exist_ok=True)
            self._data_dir.mkdir(parents=True, exist_ok=True)
        elif not self.root.is_dir():
            raise FileNotFoundError(f"no store at {self.root}")

    @staticmethod
    def _check_key(key: bytes) -> None:
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise ValueError(
                f"store keys are {KEY_BYTES}-byte digests (see replaykv.cache.keys); got {key!r:.80}"
            )

    def _check_batch(self, keys: list[bytes]) -> None:
        for key in keys:
            self._check_key(key)
        if len(set(keys)) != len(keys):
            raise ValueError("put_many: a key appears more than once in the batch")

    def _refuse_read_only(self, n: int) -> list[bool]:
        for _ in range(n):
            self.metrics.record_put(False, error="read_only")
        return [False] * n

    def _expired(self, entry: _E, now: float) -> bool:
        return self.retention_s is not None and now - entry.last_access > self.retention_s

    def _sweep_temp(self, item: os.DirEntry[str], st: os.stat_result) -> None:
        """Count a temp file found by the start-up scan; remove it if its writer is gone."""
        self.temp_files_seen += 1
        if not self.read_only and is_orphan_temp(item.name, st.st_ctime, self.orphan_grace_s):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(item.path)
                self.orphans_swept += 1

    def _purge_quarantine(self, now: float) -> int:
        """Delete quarantined files older than the retention; how many."""
        purged = 0
        if self.retention_s is not None and self._quarantine_dir.is_dir():
            for item in os.scandir(self._quarantine_dir):
                try:
                    if now - item.stat(follow_symlinks=False).st_mtime > self.retention_s:
                        os.unlink(item.path)
                        purged += 1
                except OSError:
                    continue
        return purged

    def _scan_stats(self) -> dict[str, object]:
        quarantine_files = (
            sum(1 for _ in os.scandir(self._quarantine_dir)) if self._quarantine_dir.is_dir() else 0
        )
        return {
            "quarantine_reasons": self.quarantine_reasons.as_dict(),
            "quarantine_files": quarantine_files,
            "orphans_swept": self.orphans_swept,
            "temp_files_seen": self.temp_files_seen,
            "unknown_files": self.unknown_files,
        }

    def contains(self, key: bytes) -> bool:
        self._check_key(key)
        now = self._clock()
        with self._lock:
            entry = self._index.get(key)
            return entry is not None and not self._expired(entry, now)

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def indexed_keys(self) -> list[bytes]:
        """Indexed keys, least recently accessed first (a snapshot)."""
        with self._lock:
            return list(self._index)
