"""Ledger 3: the persistent global-KV store (compressed KV + index-key chunks, opaque bytes).

For: keeping chunk payloads across engine restarts behind the small :class:`GlobalKVStore`
contract, and :class:`DirectoryStore`, its one-file-per-entry implementation on a local or
shared file system: atomic publish, a checksummed header, quarantine of bad files, capacity
and retention, metrics.

Not for: serialising tensors (the caller hands in bytes), choosing keys (``cache/keys.py``),
SWA window snapshots (they never touch disk: ``cache/swa_pool.py``), or deciding what to
write (``cache/manager.py``).

On-disk layout under ``root``::

    entries/ab/cd/<64-hex key>.kv           published entries (ab, cd = first two key bytes)
    entries/ab/cd/.<hex>.<pid>.<rand>.tmp    a write in progress (or an orphan after a crash)
    quarantine/<hex>.<reason>.<ns>.kv        entries that failed verification; never read again

An entry file is ``STORE_HEADER`` followed by the payload. One process owns a directory for
writing (its in-memory index is authoritative for ``get``/``contains``); ``replaykv store``
may inspect it alongside.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import struct
import threading
import time
import zlib
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from replaykv.cache.keys import KEY_BYTES, KeyNamespace, key_from_hex, key_hex
from replaykv.cache.metrics import LabeledCounter, TierMetrics

__all__ = [
    "STORE_FORMAT_VERSION",
    "STORE_HEADER",
    "STORE_MAGIC",
    "DirectoryStore",
    "EntryHeader",
    "EntryMeta",
    "GcReport",
    "GlobalKVStore",
    "VerifyReport",
]

Payload = bytes | bytearray | memoryview

STORE_MAGIC = b"RKVCHUNK"
STORE_FORMAT_VERSION = 1

STORE_HEADER = struct.Struct("<8sHHIdQ32s32s32sI")
"""Header of one store entry file, 132 bytes, little-endian, followed by the payload.

====== ===== ================================================================
offset bytes field
====== ===== ================================================================
0      8     magic ``b"RKVCHUNK"``
8      2     u16 format version (``STORE_FORMAT_VERSION``; anything else is quarantined)
10     2     u16 kv layout version of the payload (from :class:`EntryMeta`)
12     4     u32 flags (0; reserved)
16     8     f64 created_at, seconds on the store's clock
24     8     u64 payload length in bytes (file size = 132 + this)
32     32    namespace digest (``KeyNamespace.seed()``, or zeros)
64     32    key (must equal the file name's key)
96     32    SHA-256 of the payload
128    4     u32 CRC-32 of bytes [0, 128) of the header
====== ===== ================================================================
"""
_CRC_OFFSET = STORE_HEADER.size - 4
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


@dataclass(frozen=True)
class EntryHeader:
    """A parsed :data:`STORE_HEADER`."""

    format_version: int
    kv_layout_version: int
    flags: int
    created_at: float
    payload_len: int
    namespace_digest: bytes
    key: bytes
    payload_sha256: bytes

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
            0,
        )
        return head[:_CRC_OFFSET] + struct.pack("<I", zlib.crc32(head[:_CRC_OFFSET]))

    @classmethod
    def unpack(cls, raw: bytes) -> EntryHeader | str:
        """The header, or the reason (a short string) it cannot be trusted."""
        if len(raw) < STORE_HEADER.size:
            return "truncated"
        magic, version, layout, flags, created, length, ns, key, digest, crc = STORE_HEADER.unpack_from(raw)
        if magic != STORE_MAGIC:
            return "bad_magic"
        if version != STORE_FORMAT_VERSION:
            return "wrong_version"
        if zlib.crc32(raw[:_CRC_OFFSET]) != crc:
            return "bad_header_crc"
        return cls(version, layout, flags, created, length, ns, key, digest)


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

    @abstractmethod
    def contains(self, key: bytes) -> bool: ...

    @abstractmethod
    def delete(self, key: bytes) -> bool:
        """Remove the entry; ``True`` if it existed."""

    @abstractmethod
    def stats(self) -> dict[str, object]: ...

    @abstractmethod
    def check_integrity(self) -> None: ...


@dataclass
class _Entry:
    size: int  # bytes on disk, header included
    last_access: float


def _errname(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno, "OSError") if exc.errno is not None else type(exc).__name__


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:
            raise OSError(errno.EIO, "short write")
        view = view[written:]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


class DirectoryStore(GlobalKVStore):
    """One file per entry under ``root`` (see the module docstring for the layout).

    Args:
        root: directory (created if missing).
        capacity_bytes: bound on the bytes of published files (headers included); the entries
            accessed longest ago are evicted to make room for a put.
        retention_s: an entry not read or written for this long is expired (never served);
            ``None`` keeps entries until evicted.
        clock: seconds; drives last-access, retention and the ``created_at`` header field.
            File mtimes are set from it so recency survives a restart.
        read_only: inspect only: no orphan sweep, no puts, no quarantine moves, no mtime updates.
        orphan_grace_s: a temp file whose writer pid is alive is swept only when older than this.

    Start-up scans ``entries/`` to rebuild the index (size and last access from ``stat``),
    quarantines files shorter than a header and sweeps orphaned temp files. It does not evict;
    call :meth:`gc` to apply a lowered capacity or the retention.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity_bytes: int,
        retention_s: float | None = 72 * 3600,
        clock: Callable[[], float] = time.time,
        *,
        read_only: bool = False,
        orphan_grace_s: float = 3600.0,
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
        self._entries_dir = self.root / "entries"
        self._quarantine_dir = self.root / "quarantine"
        self.metrics = TierMetrics("global_kv_store")
        self.quarantine_reasons = LabeledCounter()
        self.orphans_swept = 0
        self.temp_files_seen = 0
        self.unknown_files = 0
        # Lock order: a key stripe, then _lock. _lock guards the index, gauges and reservations.
        self._lock = threading.Lock()
        self._stripes = [threading.Lock() for _ in range(64)]
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()  # oldest access first
        self._reserved = 0  # bytes of puts between make-room and index update
        self._publishing: set[bytes] = set()
        self._known_dirs: set[Path] = set()
        if not read_only:
            self._quarantine_dir.mkdir(parents=True, exist_ok=True)
            self._entries_dir.mkdir(parents=True, exist_ok=True)
        elif not self.root.is_dir():
            raise FileNotFoundError(f"no store at {self.root}")
        self._scan()

    # ---------------------------------------------------------------- paths
    def _dir_for(self, hexkey: str) -> Path:
        return self._entries_dir / hexkey[0:2] / hexkey[2:4]

    def _path_for(self, key: bytes) -> Path:
        hexkey = key_hex(key)
        return self._dir_for(hexkey) / f"{hexkey}.kv"

    def _stripe(self, key: bytes) -> threading.Lock:
        return self._stripes[key[0] % len(self._stripes)]

    @staticmethod
    def _check_key(key: bytes) -> None:
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise ValueError(
                f"store keys are {KEY_BYTES}-byte digests (see replaykv.cache.keys); got {key!r:.80}"
            )

    def _fsync_dir(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _ensure_dir(self, path: Path) -> None:
        if path in self._known_dirs:
            return
        for d in (path.parent, path):
            if not d.is_dir():
                d.mkdir(exist_ok=True)
                self._fsync_dir(d.parent)
        self._known_dirs.add(path)

    # ---------------------------------------------------------------- start-up
    def _iter_entry_files(self) -> Iterator[os.DirEntry[str]]:
        if not self._entries_dir.is_dir():
            return
        for top in os.scandir(self._entries_dir):
            if not top.is_dir(follow_symlinks=False):
                continue
            for mid in os.scandir(top.path):
                if not mid.is_dir(follow_symlinks=False):
                    continue
                yield from os.scandir(mid.path)

    def _is_orphan(self, name: str, ctime: float) -> bool:
        parts = name.split(".")  # ["", hex, pid, rand, "tmp"]
        try:
            pid = int(parts[2])
        except (IndexError, ValueError):
            return True
        if time.time() - ctime > self.orphan_grace_s:  # ctime: wall clock, utime cannot move it
            return True
        return pid != os.getpid() and not _pid_alive(pid)

    def _scan(self) -> None:
        found: list[tuple[float, bytes, int]] = []
        for item in self._iter_entry_files():
            try:
                st = item.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            name = item.name
            if name.startswith(".") and name.endswith(".tmp"):
                self.temp_files_seen += 1
                if not self.read_only and self._is_orphan(name, st.st_ctime):
                    try:
                        os.unlink(item.path)
                        self.orphans_swept += 1
                    except FileNotFoundError:
                        pass
                continue
            if not name.endswith(".kv"):
                self.unknown_files += 1
                continue
            try:
                key = key_from_hex(name[:-3])
            except ValueError:
                self.unknown_files += 1
                continue
            if st.st_size < STORE_HEADER.size:
                if not self.read_only:
                    self._quarantine_path(Path(item.path), key, "truncated")
                continue
            found.append((st.st_mtime, key, st.st_size))
        found.sort()
        with self._lock:
            for mtime, key, size in found:
                self._index[key] = _Entry(size=size, last_access=mtime)
                self.metrics.bytes_resident.inc(size)
                self.metrics.entries.inc()
            # A lowered capacity is applied by gc() or by puts, not at open.
            self._opened_over_capacity = self.metrics.bytes_resident.value > self.capacity_bytes

    # ---------------------------------------------------------------- helpers under _lock
    def _expired(self, entry: _Entry, now: float) -> bool:
        return self.retention_s is not None and now - entry.last_access > self.retention_s

    def _drop_locked(self, key: bytes) -> _Entry | None:
        entry = self._index.pop(key, None)
        if entry is not None:
            self.metrics.bytes_resident.dec(entry.size)
            self.metrics.entries.dec()
        return entry

    def _remove_file(self, key: bytes) -> None:
        try:
            os.unlink(self._path_for(key))
        except FileNotFoundError:
            pass
        except OSError as exc:
            self.metrics.errors.inc(f"unlink:{_errname(exc)}")

    def _make_room_locked(self, size: int, now: float, replacing: bytes) -> bool:
        old = self._index.get(replacing)
        freed_by_replace = old.size if old is not None else 0
        need = (
            self.metrics.bytes_resident.value - freed_by_replace + self._reserved + size - self.capacity_bytes
        )
        if need <= 0:
            return True
        victims: list[bytes] = []
        for key, entry in self._index.items():
            if need <= 0:
                break
            if key == replacing or key in self._publishing:
                continue
            victims.append(key)
            need -= entry.size
        if need > 0:
            return False
        for key in victims:
            dropped = self._drop_locked(key)
            assert dropped is not None
            if self._expired(dropped, now):
                self.metrics.expirations.inc()
            else:
                self.metrics.evictions.inc()
            self._remove_file(key)
        return True

    # ---------------------------------------------------------------- contract
    def put(
        self, key: bytes, payload: Payload, meta: EntryMeta | None = None, *, raise_on_error: bool = False
    ) -> bool:
        """Publish ``payload`` under ``key`` (write temp → fsync → rename → fsync dir).

        Returns ``False`` and counts the error on any ``OSError`` (ENOSPC, EIO, ...), when the
        entry alone exceeds the capacity, or in read-only mode; nothing is then visible and the
        temp file is removed. ``raise_on_error=True`` re-raises the ``OSError`` instead.
        """
        self._check_key(key)
        meta = meta or EntryMeta()
        view = memoryview(payload).cast("B") if not isinstance(payload, bytes) else memoryview(payload)
        size = STORE_HEADER.size + view.nbytes
        if self.read_only:
            self.metrics.record_put(False, error="read_only")
            return False
        if size > self.capacity_bytes:
            self.metrics.record_put(False, error="too_large")
            return False
        now = self._clock()
        hexkey = key_hex(key)
        header = EntryHeader(
            format_version=STORE_FORMAT_VERSION,
            kv_layout_version=meta.kv_layout_version,
            flags=0,
            created_at=now,
            payload_len=view.nbytes,
            namespace_digest=meta.namespace_digest,
            key=key,
            payload_sha256=hashlib.sha256(view).digest(),
        ).pack()
        directory = self._dir_for(hexkey)
        final = directory / f"{hexkey}.kv"
        tmp = directory / f".{hexkey}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
        stage = "mkdir"
        try:
            self._ensure_dir(directory)
            stage = "write"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                _write_all(fd, header)
                _write_all(fd, view)
                os.utime(fd, (now, now))  # mtime carries last access across restarts
                stage = "fsync"
                os.fsync(fd)
            finally:
                os.close(fd)
            stage = "capacity"
            with self._stripe(key):  # one publish per key at a time; quarantine/delete take it too
                with self._lock:
                    if not self._make_room_locked(size, now, replacing=key):
                        raise OSError(errno.ENOSPC, "store capacity taken by entries being published")
                    self._reserved += size
                    self._publishing.add(key)
                renamed = published = False
                try:
                    stage = "rename"
                    os.rename(tmp, final)
                    renamed = True
                    stage = "fsync_dir"
                    self._fsync_dir(directory)
                    published = True
                finally:
                    with self._lock:
                        self._reserved -= size
                        self._publishing.discard(key)
                        if renamed:  # the old version (if any) is gone either way
                            self._drop_locked(key)
                        if published:
                            self._index[key] = _Entry(size=size, last_access=now)
                            self.metrics.bytes_resident.inc(size)
                            self.metrics.entries.inc()
                    if renamed and not published:  # visible but not durable: take it back
                        with contextlib.suppress(OSError):
                            os.unlink(final)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            self.metrics.record_put(False, error=f"{stage}:{_errname(exc)}")
            if raise_on_error:
                raise
            return False
        self.metrics.record_put(True, view.nbytes)
        return True

    def get(self, key: bytes) -> bytes | None:
        """The verified payload, or ``None`` (miss, expired, unreadable, or corrupt → quarantined)."""
        self._check_key(key)
        now = self._clock()
        with self._lock:
            entry = self._index.get(key)
            if entry is not None and self._expired(entry, now):
                self._drop_locked(key)
                self.metrics.expirations.inc()
                if not self.read_only and key not in self._publishing:
                    self._remove_file(key)
                entry = None
        if entry is None:
            self.metrics.record_miss()
            return None
        path = self._path_for(key)
        try:
            with open(path, "rb", buffering=0) as f:
                st = os.fstat(f.fileno())
                result = self._read_verified(f.read, st.st_size, key)
        except FileNotFoundError:
            # Evicted, deleted or replaced under us: a plain miss.
            with self._lock:
                if self._index.get(key) is entry:
                    self._drop_locked(key)
            self.metrics.errors.inc("read:vanished")
            self.metrics.record_miss()
            return None
        except OSError as exc:
            self.metrics.errors.inc(f"read:{_errname(exc)}")
            self.metrics.record_miss()
            return None
        if isinstance(result, str):
            self._quarantine_if_same(key, path, st, result)
            self.metrics.record_miss()
            return None
        header, payload = result
        with self._lock:
            current = self._index.get(key)
            if current is not None:
                current.last_access = now
                self._index.move_to_end(key)
        if not self.read_only:
            with contextlib.suppress(OSError):
                os.utime(path, (now, now))
        self.metrics.record_hit(len(payload), age_s=now - header.created_at)
        return payload

    @staticmethod
    def _read_verified(
        read: Callable[[int], bytes], file_size: int, key: bytes | None
    ) -> tuple[EntryHeader, bytes] | str:
        """Parse and check one entry file; the header and payload, or the reason it is bad."""
        parsed = EntryHeader.unpack(read(STORE_HEADER.size))
        if isinstance(parsed, str):
            return parsed
        if key is not None and parsed.key != key:
            return "wrong_key"
        actual = file_size - STORE_HEADER.size
        if actual < parsed.payload_len:
            return "truncated"
        if actual > parsed.payload_len:
            return "size_mismatch"
        chunks = [read(parsed.payload_len)]
        got = len(chunks[0])
        while got < parsed.payload_len:
            more = read(parsed.payload_len - got)
            if not more:
                return "truncated"
            chunks.append(more)
            got += len(more)
        payload = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        if hashlib.sha256(payload).digest() != parsed.payload_sha256:
            return "bad_digest"
        return parsed, payload

    def _quarantine_path(self, path: Path, key: bytes, reason: str) -> bool:
        self._quarantine_dir.mkdir(parents=True, exist_ok=True)
        target = self._quarantine_dir / f"{key_hex(key)}.{reason}.{time.time_ns()}.kv"
        try:
            os.rename(path, target)
        except FileNotFoundError:
            return False
        except OSError as exc:
            self.metrics.errors.inc(f"quarantine:{_errname(exc)}")
            try:
                os.unlink(path)
            except OSError:
                return False
        self.metrics.quarantined.inc()
        self.quarantine_reasons.inc(reason)
        return True

    def _quarantine_if_same(self, key: bytes, path: Path, st: os.stat_result, reason: str) -> None:
        """Quarantine the file we read, unless a new version was published meanwhile."""
        with self._stripe(key):
            try:
                now_st = os.stat(path)
            except FileNotFoundError:
                now_st = None
            same = now_st is not None and (now_st.st_ino, now_st.st_dev) == (st.st_ino, st.st_dev)
            if same and not self.read_only:
                self._quarantine_path(path, key, reason)
            if same or now_st is None:
                with self._lock:
                    self._drop_locked(key)

    def contains(self, key: bytes) -> bool:
        self._check_key(key)
        now = self._clock()
        with self._lock:
            entry = self._index.get(key)
            return entry is not None and not self._expired(entry, now)

    def delete(self, key: bytes) -> bool:
        self._check_key(key)
        if self.read_only:
            return False
        with self._stripe(key):
            with self._lock:
                entry = self._drop_locked(key)
            if entry is not None:
                self._remove_file(key)
        if entry is not None:
            self.metrics.deletes.inc()
        return entry is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def indexed_keys(self) -> list[bytes]:
        """Indexed keys, least recently accessed first (a snapshot)."""
        with self._lock:
            return list(self._index)

    # ---------------------------------------------------------------- maintenance
    def gc(self) -> GcReport:
        """Expire entries idle longer than the retention, evict down to the capacity, and
        delete quarantined files older than the retention."""
        report = GcReport()
        if self.read_only:
            return report
        now = self._clock()
        with self._lock:
            expired = [
                k for k, e in self._index.items() if k not in self._publishing and self._expired(e, now)
            ]
            for key in expired:
                entry = self._drop_locked(key)
                assert entry is not None
                report.expired += 1
                report.bytes_freed += entry.size
                self.metrics.expirations.inc()
                self._remove_file(key)
            while self.metrics.bytes_resident.value + self._reserved > self.capacity_bytes:
                victim = next((k for k in self._index if k not in self._publishing), None)
                if victim is None:
                    break
                entry = self._drop_locked(victim)
                assert entry is not None
                report.evicted += 1
                report.bytes_freed += entry.size
                self.metrics.evictions.inc()
                self._remove_file(victim)
        if self.retention_s is not None and self._quarantine_dir.is_dir():
            for item in os.scandir(self._quarantine_dir):
                try:
                    if now - item.stat(follow_symlinks=False).st_mtime > self.retention_s:
                        os.unlink(item.path)
                        report.quarantine_purged += 1
                except OSError:
                    continue
        return report

    def verify(self, quarantine: bool = False) -> VerifyReport:
        """Read every entry file on disk and check header, size, key and payload digest.

        Bad entries are reported; with ``quarantine=True`` (and not read-only) they are also
        moved to ``quarantine/`` and dropped from the index.
        """
        report = VerifyReport()
        for item in self._iter_entry_files():
            name = item.name
            if not name.endswith(".kv"):
                continue
            try:
                key = key_from_hex(name[:-3])
            except ValueError:
                continue
            report.checked += 1
            try:
                with open(item.path, "rb", buffering=0) as f:
                    st = os.fstat(f.fileno())
                    result = self._read_verified(f.read, st.st_size, key)
            except FileNotFoundError:
                report.checked -= 1
                continue
            except OSError as exc:
                report.bad.append((name, f"read_error:{_errname(exc)}"))
                continue
            if not isinstance(result, str):
                report.ok += 1
                report.bytes_checked += st.st_size
                continue
            report.bad.append((name, result))
            if quarantine and not self.read_only:
                before = self.metrics.quarantined.value
                self._quarantine_if_same(key, Path(item.path), st, result)
                report.quarantined += self.metrics.quarantined.value - before
        return report

    def stats(self) -> dict[str, object]:
        out = self.metrics.as_dict()
        with self._lock:
            out.update(
                root=str(self.root),
                capacity_bytes=self.capacity_bytes,
                retention_s=self.retention_s,
                reserved_bytes=self._reserved,
                fill_ratio=self.metrics.bytes_resident.value / self.capacity_bytes,
                oldest_access=min((e.last_access for e in self._index.values()), default=None),
                newest_access=max((e.last_access for e in self._index.values()), default=None),
            )
        quarantine_files = (
            sum(1 for _ in os.scandir(self._quarantine_dir)) if self._quarantine_dir.is_dir() else 0
        )
        out.update(
            quarantine_reasons=self.quarantine_reasons.as_dict(),
            quarantine_files=quarantine_files,
            orphans_swept=self.orphans_swept,
            temp_files_seen=self.temp_files_seen,
            unknown_files=self.unknown_files,
        )
        return out

    def check_integrity(self, check_files: bool = True) -> None:
        """Index vs gauges vs capacity; with ``check_files``, every indexed file exists with its size.

        Call when no put is in flight (tests do, after each step).
        """
        self.metrics.check()
        with self._lock:
            total = sum(e.size for e in self._index.values())
            if total != self.metrics.bytes_resident.value:
                raise AssertionError(
                    f"index holds {total} B but bytes_resident = {self.metrics.bytes_resident.value}"
                )
            if len(self._index) != self.metrics.entries.value:
                raise AssertionError(
                    f"index has {len(self._index)} entries but gauge = {self.metrics.entries.value}"
                )
            if self._reserved < 0:
                raise AssertionError(f"negative reservation {self._reserved}")
            if total <= self.capacity_bytes:
                self._opened_over_capacity = False
            elif not self._publishing and not self._opened_over_capacity:
                raise AssertionError(f"{total} B resident exceeds capacity {self.capacity_bytes}")
            items = list(self._index.items())
        if check_files:
            for key, entry in items:
                try:
                    size = os.stat(self._path_for(key)).st_size
                except FileNotFoundError:
                    raise AssertionError(f"indexed entry {key_hex(key)} has no file") from None
                if size != entry.size:
                    raise AssertionError(f"entry {key_hex(key)}: file {size} B, index {entry.size} B")
