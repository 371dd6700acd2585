"""Ledger 3 in pack files: the persistent global-KV store that writes each batch in one piece.

For: the same :class:`~replaykv.cache.store.GlobalKVStore` contract as
:class:`~replaykv.cache.file_store.DirectoryStore`, for stores that hold many small chunks. A
``put_many`` batch (a request's new chunks) is written in one piece, with one ``fsync``: appended
to the newest *pack* while that stays under ``pack_bytes`` (64 MiB by default, at most 1/16 of
the capacity), else as a new pack (temp file, ``fsync``, rename, directory ``fsync``). A file per
entry costs an ``fsync`` and a name per chunk instead. Reads are a ``pread`` at the entry's
offset through a descriptor that stays open. A million 256-token chunks of V4.1-Flash (228 KB
each) are about 3,500 packs instead of a million files, and a prefix's chunks written one
request after another lie in order in one file.

Not for: serialising tensors, choosing keys, SWA snapshots (never on disk), or deciding what to
write (``cache/manager.py``); a directory written by :class:`DirectoryStore` (``entries/``) is
not read here (``replaykv store`` tells the two apart).

On-disk layout under ``root``::

    packs/ab/<32-hex pack id>.pack             published packs (ab: the id's first byte)
    packs/ab/<32-hex pack id>.dead             records dropped from that pack (key, offset)
    packs/ab/<32-hex pack id>.idx              offsets of that pack's durable batches
    packs/ab/.<id>.<pid>.<rand>.tmp            a pack being written (or an orphan after a crash)
    quarantine/<key hex>.<reason>.<ns>.kv      a bad entry's bytes, never read again
    quarantine/<pack id>.<reason>.<ns>.pack    a pack none of whose batches could be trusted
    quarantine/<pack id>.<offset>.<reason>.<ns>.batch   a damaged batch's bytes
    quarantine/<pack id>.missing.<ns>.idx      the index of a pack that was gone

A pack is one or more batches back to back. A batch is a head (:data:`PACK_BATCH`: its length
and the pack's id), its records (:data:`PACK_RECORD` header + payload each), its table
(:data:`PACK_TABLE_ROW`: key, offset, length and XXH3-64 of each payload) and a tail
(:data:`PACK_TAIL`) that covers the table with a CRC. The start-up scan walks the batches from
the front, reading heads, tables and tails only. Past a batch that does not check out it
searches on for the next batch head that does, so damage costs only the damaged batch: its bytes
are copied to ``quarantine/`` and tombstoned, the batches around it are served, and
``stats()["corrupt_batches"]`` counts it (an error is logged). A crash can only cut the last
batch, before the batch was listed in the pack's ``.idx``: a bad stretch at the end past every
listed batch is that (``cut_batches``; its bytes stay dead, the pack takes no more batches);
a listed batch that is damaged or gone (a truncated pack) is damage. A pack with no batch that
checks out (garbage, or a copy under another name: the heads carry the pack's id) is quarantined
whole (``corrupt_packs``); an ``.idx`` without its pack is a missing pack (``missing_packs``).
A read checks the payload against the table's digest (a damaged payload is a miss and is
quarantined; the record header is not needed to serve it); ``verify`` checks headers and
payloads against the tables, and reports damaged batches and missing packs too.

Publishing: an entry is indexed, and reported published, only once its batch and the pack's
name are durable. A new pack: temp file → ``fsync`` → rename → ``fsync`` of the fan-out
directory (and of ``packs/`` and the root the first time). An append: ``write`` at the end →
``fsync``; on an error the file is cut back to where it was and the pack takes no more batches.
A batch is written in one piece, so an I/O error fails every entry of that batch (each
``False``, none visible); entries that do not fit the capacity are left out and reported
``False`` alone. One batch is written at a time.

Dropping an entry (delete, replacement by a newer put, expiry, quarantine) removes it from the
index and appends (key, offset) to the pack's ``.dead`` file; a pack whose entries are all
dropped is unlinked. Tombstones are not fsynced: one lost in a crash can only bring back a
complete entry whose bytes verify (a replaced key resolves to its latest batch). Capacity counts
pack files whole, dead records included; eviction removes whole packs, the pack of the entry
accessed longest ago first; :meth:`PackStore.gc` also rewrites packs that are mostly dead.

Several processes on one directory: no lock is taken, and none is needed for the files' safety.
Each writer names its packs with random ids and appends only to packs it created itself, so no
two writers ever write one pack; publication is a rename (atomic); tombstones are 40-byte
``O_APPEND`` writes (atomic on local file systems). What is not shared is the index: a writer
does not see another's new packs until it reopens, and a pack one process evicts (``store gc``,
or another writer's capacity) is a miss for the others (its descriptor may keep serving the
verified bytes until closed; a tombstone written after the pack is gone is removed again, and
an orphaned ``.dead`` is swept at start-up). Capacity is per process, so writers sharing a
directory should split it.

Recency across restarts: a pack's mtime is the last write or access of any of its entries
(accesses written at most once a minute per pack); at start-up every entry of a pack gets that
time, so an entry that shares a pack with newer ones is kept longer, never shorter.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from replaykv.cache.faultlog import FaultLog
from replaykv.cache.fileio import errname, fsync_dir, pread_exact, write_all
from replaykv.cache.keys import key_hex
from replaykv.cache.pack_format import (
    _TOMBSTONE,
    _ZERO_DIGEST,
    PACK_BATCH,
    PACK_FORMAT_VERSION,
    PACK_INDEX_ROW,
    PACK_RECORD,
    PACK_TABLE_ROW,
    PACK_TAIL,
    PackRecord,
    PackTable,
    Row,
    _batch_head,
    _digest,
    _pack_id_bytes,
    _read_index,
    _read_tombstones,
    _table_bytes,
    batch_overhead,
    read_pack_table,
)
from replaykv.cache.store import EntryMeta, GcReport, LocalStore, Payload, VerifyReport

__all__ = [
    "PACK_BATCH",
    "PACK_FORMAT_VERSION",
    "PACK_INDEX_ROW",
    "PACK_RECORD",
    "PACK_TABLE_ROW",
    "PACK_TAIL",
    "PackRecord",
    "PackStore",
    "PackTable",
    "batch_overhead",
    "read_pack_table",
]

_log = logging.getLogger(__name__)

_ACCESS_PERSIST_S = 60.0  # a pack's mtime (recency across restarts) is refreshed at most this often
DEFAULT_OPEN_PACKS = 256  # descriptors kept open for reads; least recently used closed first
DEFAULT_PACK_BYTES = 64 << 20  # batches appended to a pack until it reaches this size
_COMPACT_BELOW = 0.5  # gc rewrites a pack whose live records fill less than this share of it


@dataclass(eq=False)
class _Pack:
    """A published pack: its file, what the index still points into it, and its read descriptor."""

    pack_id: str
    path: str
    size: int  # bytes of the file (records, dead ones too, + table + tail)
    created_at: float
    table_bytes: int  # the batches' heads, tables and tails (and a cut-short batch's bytes)
    keys: set[bytes] = field(default_factory=set)  # the indexed entries in this pack
    live_bytes: int = 0  # their record bytes (header + payload)
    disk_access: float = 0.0  # the mtime last written (or read at start-up)
    fd: int | None = None
    readers: int = 0  # reads in flight on ``fd``
    removed: bool = False  # unlinked / quarantined: close ``fd`` when the last reader leaves

    def add(self, key: bytes, size: int) -> None:
        self.keys.add(key)
        self.live_bytes += size

    def discard(self, key: bytes, size: int) -> None:
        self.keys.discard(key)
        self.live_bytes -= size


@dataclass(eq=False)
class _Entry:
    pack: _Pack
    offset: int  # of the record header
    payload_len: int
    digest: int  # XXH3-64 of the payload, from the pack's table
    last_access: float

    @property
    def size(self) -> int:
        return PACK_RECORD.size + self.payload_len


@dataclass(eq=False)
class _Staged:
    """One entry of a batch on its way into a pack."""

    index: int  # position in the caller's batch
    key: bytes
    view: memoryview
    size: int  # record bytes
    header: bytes = b""  # the packed PACK_RECORD
    digest: int = 0  # XXH3-64 of the payload
    offset: int = 0


@dataclass
class _Scanned:
    """What the start-up scan found in one pack file."""

    path: str
    pack_id: str
    size: int
    mtime: float
    table: PackTable


class PackStore(LocalStore[_Entry]):
    """Entries in pack files under ``root`` (see the module docstring for the layout).

    Args:
        root: directory (created if missing).
        capacity_bytes: bound on the bytes of published pack files; whole packs are evicted,
            the one holding the entry accessed longest ago first, to make room for a put.
        retention_s: an entry not read or written for this long is expired (never served);
            ``None`` keeps entries until evicted.
        clock: seconds; drives last access, retention and the ``created_at`` fields. Pack mtimes
            are set from it so recency survives a restart.
        read_only: inspect only: no orphan sweep, no puts, no tombstones, no quarantine moves.
        orphan_grace_s: a temp file whose writer pid is alive is swept only when older than this.
        open_packs: read descriptors kept open (least recently used closed first).
        pack_bytes: a batch is appended to the newest pack while the pack stays at most this
            large; None: 64 MiB or 1/16 of the capacity, whichever is smaller (eviction takes
            whole packs); 0: a new pack for every batch.

    Start-up walks every pack's batches to rebuild the index, quarantines packs whose first
    batch cannot be trusted, applies tombstones, and sweeps orphaned temp files. It appends to
    no pack written before it; it does not evict: call :meth:`gc` to apply a lowered capacity
    or the retention.
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
        open_packs: int = DEFAULT_OPEN_PACKS,
        pack_bytes: int | None = None,
    ) -> None:
        super().__init__(root, capacity_bytes, retention_s, clock, read_only, orphan_grace_s, "packs")
        self.open_packs = max(1, open_packs)
        # Batches are appended to the newest pack while it stays under this size; eviction takes
        # packs whole, so they stay small next to the capacity. 0: a pack per batch.
        self.pack_bytes = (
            min(DEFAULT_PACK_BYTES, capacity_bytes // 16) if pack_bytes is None else max(0, pack_bytes)
        )
        self._append_to: _Pack | None = None  # the pack the next batch may be appended to
        self.cut_batches = 0  # packs the start-up scan found ending in a batch cut short
        self.corrupt_batches = 0  # damaged batches found (start-up scan, verify) before later good ones
        self.corrupt_packs = 0  # packs the start-up scan found with no batch that checks out
        self.missing_packs = 0  # packs an .idx lists that are not there
        self.write_failures = FaultLog(_log, "store write")
        self._write_lock = threading.Lock()  # one batch written at a time
        self._packs_dir = self._data_dir
        self._packs_str = str(self._packs_dir)
        self._packs: dict[str, _Pack] = {}  # guarded by _lock, as everything below
        self._open: OrderedDict[str, _Pack] = OrderedDict()  # packs with an open fd, LRU first
        self._reserved = 0  # bytes of packs between make-room and publish
        self._publishing: set[str] = set()  # pack ids being published
        self._known_dirs: set[str] = set()  # fan-out dirs whose own name is known to be durable
        self._scan()

    # ---------------------------------------------------------------- paths
    def _dir_for(self, pack_id: str) -> str:
        return f"{self._packs_str}/{pack_id[0:2]}"

    # ---------------------------------------------------------------- start-up
    def _iter_pack_dir(self) -> Iterator[os.DirEntry[str]]:
        if not self._packs_dir.is_dir():
            return
        for top in os.scandir(self._packs_dir):
            if top.is_dir(follow_symlinks=False):
                yield from os.scandir(top.path)

    def _sidecars(self) -> tuple[list[os.DirEntry[str]], dict[str, str], dict[str, str]]:
        """The pack directory's files other than packs' ``.dead``/``.idx`` sidecars, and those
        sidecars' paths by pack id."""
        files: list[os.DirEntry[str]] = []
        dead: dict[str, str] = {}
        index: dict[str, str] = {}
        for item in self._iter_pack_dir():
            if item.name.endswith(".dead"):
                dead[item.name[:-5]] = item.path
            elif item.name.endswith(".idx"):
                index[item.name[:-4]] = item.path
            else:
                files.append(item)
        return files, dead, index

    def _open_table(
        self, path: str, pack_id: str, size: int, dead: set[tuple[bytes, int]]
    ) -> PackTable | str:
        """Read a pack's table, checking its batches against its name, directory and ``.idx``."""
        expected = _pack_id_bytes(pack_id) if os.path.basename(os.path.dirname(path)) == pack_id[:2] else b""
        listed = _read_index(path[:-5] + ".idx")
        skipped = [offset for key, offset in dead if key == _ZERO_DIGEST]
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return read_pack_table(fd, size, expected or bytes(17), listed, skipped)
        finally:
            os.close(fd)

    def _missing_pack(self, pack_id: str, index_path: str) -> None:
        """An ``.idx`` whose pack is gone: count and log it; a writable open moves it aside."""
        self.missing_packs += 1
        _log.error("store: pack %s.pack is missing (its index %s lists batches)", pack_id, index_path)
        if not self.read_only:
            self._move_to_quarantine(index_path, f"{pack_id}.missing.{time.time_ns()}.idx", "missing_pack")

    def _corrupt_batch(self, path: str, pack_id: str, offset: int, length: int, reason: str) -> None:
        """A damaged batch inside a pack whose other batches are served: count and log it; a
        writable open copies its bytes to ``quarantine/`` and tombstones it (not reported again)."""
        self.corrupt_batches += 1
        _log.error("store: damaged batch in %s at offset %d (%d bytes): %s", path, offset, length, reason)
        if self.read_only:
            return
        target = self._quarantine_dir / f"{pack_id}.{offset}.{reason}.{time.time_ns()}.batch"
        try:
            with open(path, "rb", buffering=0) as src:
                raw = os.pread(src.fileno(), length, offset)
            target.write_bytes(raw)
        except OSError as exc:
            self.metrics.errors.inc(f"quarantine:{errname(exc)}")
        self._append_tombstone_at(path, _ZERO_DIGEST, offset)
        self.metrics.quarantined.inc()
        self.quarantine_reasons.inc(reason)

    def _move_to_quarantine(self, path: str, name: str, reason: str) -> None:
        try:
            os.rename(path, self._quarantine_dir / name)
        except OSError as exc:
            self.metrics.errors.inc(f"quarantine:{errname(exc)}")
            return
        self.metrics.quarantined.inc()
        self.quarantine_reasons.inc(reason)

    def _scan(self) -> None:
        scanned: list[_Scanned] = []
        tombstones: dict[str, set[tuple[bytes, int]]] = {}
        files, dead_files, index_files = self._sidecars()
        pack_ids = {item.name[:-5] for item in files if item.name.endswith(".pack")}
        for pack_id, path in dead_files.items():
            if pack_id in pack_ids:
                tombstones[pack_id] = _read_tombstones(path)
            elif not self.read_only:  # its pack was removed by another process
                with contextlib.suppress(OSError):
                    os.unlink(path)
                    self.orphans_swept += 1
        for pack_id, path in sorted(index_files.items()):
            if pack_id not in pack_ids:
                self._missing_pack(pack_id, path)
        for item in files:
            name = item.name
            try:
                st = item.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if name.startswith(".") and name.endswith(".tmp"):
                self._sweep_temp(item, st)
                continue
            if not name.endswith(".pack"):
                self.unknown_files += 1
                continue
            pack_id = name[:-5]
            try:
                table = self._open_table(item.path, pack_id, st.st_size, tombstones.get(pack_id, set()))
            except OSError as exc:
                self.metrics.errors.inc(f"scan:{errname(exc)}")
                continue
            if isinstance(table, str):
                self.corrupt_packs += 1
                _log.error("store: pack %s cannot be trusted (%s)", item.path, table)
                if not self.read_only:
                    self._quarantine_pack_file(item.path, pack_id, table)
                continue
            if table.cut:
                self.cut_batches += 1  # a batch a crash cut short mid-append: dead bytes
            for offset, length, reason in table.corrupt:
                self._corrupt_batch(item.path, pack_id, offset, length, reason)
            scanned.append(_Scanned(item.path, pack_id, st.st_size, st.st_mtime, table))
        # The latest batch wins a key; entries get their pack's mtime; oldest access first.
        owner: dict[bytes, tuple[tuple[float, str, int], _Pack, int, int, int]] = {}
        packs: list[_Pack] = []
        for s in scanned:
            t = s.table
            pack = _Pack(s.pack_id, s.path, s.size, t.created_at, t.overhead, disk_access=s.mtime)
            packs.append(pack)
            dead = tombstones.get(s.pack_id, set())
            for (key, offset, length, digest), when in zip(t.rows, t.times, strict=True):
                order = (when, s.pack_id, offset)
                if (key, offset) not in dead and (key not in owner or owner[key][0] < order):
                    owner[key] = (order, pack, offset, length, digest)
        entries: list[tuple[float, bytes, _Entry]] = []
        for key, (_, pack, offset, length, digest) in owner.items():
            pack.add(key, PACK_RECORD.size + length)
            entries.append((pack.disk_access, key, _Entry(pack, offset, length, digest, pack.disk_access)))
        entries.sort(key=lambda e: (e[0], e[2].pack.pack_id, e[2].offset))
        with self._lock:
            for pack in packs:
                if not pack.keys:  # everything in it was dropped before the restart
                    if not self.read_only:
                        self._unlink_pack(pack)
                    continue
                self._packs[pack.pack_id] = pack
                self.metrics.bytes_resident.inc(pack.size)
            for _, key, entry in entries:
                self._index[key] = entry
                self.metrics.entries.inc()
            self._opened_over_capacity = self.metrics.bytes_resident.value > self.capacity_bytes

    # ---------------------------------------------------------------- helpers under _lock
    def _drop_locked(self, key: bytes, tombstone: bool = True) -> _Entry | None:
        """Remove ``key`` from the index; its pack goes when nothing in it is left, otherwise the
        key is recorded in the pack's tombstones (``tombstone=False``: the caller removes the
        whole pack anyway)."""
        entry = self._index.pop(key, None)
        if entry is None:
            return None
        self.metrics.entries.dec()
        pack = entry.pack
        pack.discard(key, entry.size)
        if not pack.keys and pack.pack_id not in self._publishing:  # (a batch is being appended)
            self._remove_pack_locked(pack)
        elif tombstone and not self.read_only:
            self._append_tombstone(pack, key, entry.offset)
        return entry

    def _remove_pack_locked(self, pack: _Pack) -> None:
        if self._append_to is pack:
            self._append_to = None
        if self._packs.pop(pack.pack_id, None) is None:
            return
        self.metrics.bytes_resident.dec(pack.size)
        if not self.read_only:
            self._unlink_pack(pack)
        self._retire_fd_locked(pack)

    def _retire_fd_locked(self, pack: _Pack) -> None:
        pack.removed = True
        self._open.pop(pack.pack_id, None)
        if pack.fd is not None and pack.readers == 0:
            with contextlib.suppress(OSError):
                os.close(pack.fd)
            pack.fd = None

    def _append_index_row(self, pack_path: str, offset: int) -> None:
        """List a durable batch in the pack's ``.idx`` (see :data:`PACK_INDEX_ROW`)."""
        try:
            fd = os.open(
                pack_path[:-5] + ".idx", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644
            )
            try:
                write_all(fd, PACK_INDEX_ROW.pack(offset))
            finally:
                os.close(fd)
        except OSError as exc:  # an unlisted batch is still read; only its damage reads as a cut
            self.metrics.errors.inc(f"index:{errname(exc)}")

    def _unlink_pack(self, pack: _Pack) -> None:
        # The .idx goes first: a crash part way leaves a pack without one (read as usual), never
        # an .idx that reports a pack missing.
        for path in (pack.path[:-5] + ".idx", pack.path, pack.path[:-5] + ".dead"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                self.metrics.errors.inc(f"unlink:{errname(exc)}")

    def _append_tombstone(self, pack: _Pack, key: bytes, offset: int) -> None:
        """Record that the record of ``key`` at ``offset`` is dropped (the key may come back in a
        later batch of the same pack, so a tombstone names the record, not the key)."""
        self._append_tombstone_at(pack.path, key, offset)

    def _append_tombstone_at(self, pack_path: str, key: bytes, offset: int) -> None:
        dead = pack_path[:-5] + ".dead"
        try:
            fd = os.open(dead, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
            try:
                write_all(fd, _TOMBSTONE.pack(key, offset))
            finally:
                os.close(fd)
        except OSError as exc:  # a lost tombstone only brings back a complete, verified entry
            self.metrics.errors.inc(f"tombstone:{errname(exc)}")
            return
        if not os.path.exists(pack_path):  # another process removed the pack meanwhile
            with contextlib.suppress(OSError):
                os.unlink(dead)

    def _count_drop(self, entry: _Entry, now: float) -> None:
        if self._expired(entry, now):
            self.metrics.expirations.inc()
        else:
            self.metrics.evictions.inc()

    def _make_room_locked(self, size: int, now: float) -> bool:
        """Evict whole packs, the one with the longest-unused entry first, until ``size`` more
        bytes fit beside what is resident and reserved."""
        need = self.metrics.bytes_resident.value + self._reserved + size - self.capacity_bytes
        if need <= 0:
            return True
        victims: dict[str, _Pack] = {}
        for entry in self._index.values():
            if need <= 0:
                break
            pack = entry.pack
            if pack.pack_id in victims or pack.pack_id in self._publishing:
                continue
            victims[pack.pack_id] = pack
            need -= pack.size
        if need > 0:
            return False
        for pack in victims.values():
            for key in list(pack.keys):
                dropped = self._drop_locked(key, tombstone=False)
                assert dropped is not None
                self._count_drop(dropped, now)
        return True

    def _evict_for_disk(self, size: int, now: float) -> bool:
        """The file system is full (ENOSPC) although the capacity is not: evict whole packs, the
        one with the longest-unused entry first, until ``size`` bytes are freed, and reserve
        ``size`` again for one more try of the write. False (nothing reserved) if nothing could
        be evicted."""
        with self._lock:
            freed = 0
            for entry in list(self._index.values()):
                if freed >= size:
                    break
                pack = entry.pack
                if pack.pack_id in self._publishing or pack.removed:
                    continue
                freed += pack.size
                for key in list(pack.keys):
                    dropped = self._drop_locked(key, tombstone=False)
                    if dropped is not None:
                        self.metrics.evictions.inc()
            if freed == 0:
                return False
            self._reserved += size
        _log.warning(
            "store: %s is full (ENOSPC); evicted %d bytes of packs to retry a write", self.root, freed
        )
        return True

    # ---------------------------------------------------------------- descriptors
    def _acquire(self, pack: _Pack) -> int:
        """An open read descriptor of ``pack`` (call with _lock held; pair with :meth:`_release`)."""
        if pack.fd is None:
            pack.fd = os.open(pack.path, os.O_RDONLY | os.O_CLOEXEC)
            while len(self._open) >= self.open_packs:
                idle = next((p for p in self._open.values() if p.readers == 0), None)
                if idle is None:
                    break
                del self._open[idle.pack_id]
                assert idle.fd is not None
                with contextlib.suppress(OSError):
                    os.close(idle.fd)
                idle.fd = None
        if not pack.removed:
            self._open[pack.pack_id] = pack
            self._open.move_to_end(pack.pack_id)
        pack.readers += 1
        return pack.fd

    def _release(self, pack: _Pack) -> None:
        with self._lock:
            pack.readers -= 1
            if pack.readers or pack.fd is None:
                return
            if pack.removed or pack.pack_id not in self._open or len(self._open) > self.open_packs:
                self._open.pop(pack.pack_id, None)
                with contextlib.suppress(OSError):
                    os.close(pack.fd)
                pack.fd = None

    def close(self) -> None:
        """Close the read descriptors not in use (idempotent; the store stays usable)."""
        with self._lock:
            for pack in list(self._open.values()):
                if pack.readers == 0 and pack.fd is not None:
                    with contextlib.suppress(OSError):
                        os.close(pack.fd)
                    pack.fd = None
                    del self._open[pack.pack_id]

    # ---------------------------------------------------------------- contract
    def put(
        self, key: bytes, payload: Payload, meta: EntryMeta | None = None, *, raise_on_error: bool = False
    ) -> bool:
        """Publish ``payload`` under ``key`` (a batch of one entry). ``False`` and the error counted
        on any ``OSError``, when the entry alone exceeds the capacity, or in read-only mode;
        ``raise_on_error=True`` re-raises the ``OSError`` instead."""
        return self.put_many([(key, payload)], meta, raise_on_error=raise_on_error)[0]

    def put_many(
        self,
        items: Iterable[tuple[bytes, Payload]],
        meta: EntryMeta | None = None,
        *,
        raise_on_error: bool = False,
    ) -> list[bool]:
        """Publish a batch in one piece; ``put``'s result for each entry, in order.

        The entries that fit the capacity (in batch order; others ``False`` with
        ``capacity:ENOSPC`` or ``too_large``) are written as one batch with its table and tail:
        appended to the newest pack and fsynced, or as a new pack (temp file, fsync, rename,
        directory fsync); only then are they indexed and counted as published, and the versions
        they replace dropped. An I/O error at any stage publishes none of the batch. Keys must be
        distinct within a batch (``ValueError``).
        ``raise_on_error=True`` raises the ``OSError`` after the batch was settled and counted.
        """
        batch = list(items)
        self._check_batch([key for key, _ in batch])
        if self.read_only:
            return self._refuse_read_only(len(batch))
        results = [False] * len(batch)
        if not batch:
            return results
        meta = meta or EntryMeta()
        now = self._clock()
        overhead = batch_overhead(0)  # the batch's head and tail
        staged: list[_Staged] = []
        refused: dict[int, str] = {}
        for i, (key, payload) in enumerate(batch):
            view = memoryview(payload) if isinstance(payload, bytes) else memoryview(payload).cast("B")
            size = PACK_RECORD.size + view.nbytes
            if size + PACK_TABLE_ROW.size + overhead > self.capacity_bytes:
                refused[i] = "too_large"
                continue
            staged.append(_Staged(i, key, view, size))
        with self._lock:
            fitted: list[_Staged] = []
            reserved = 0
            for s in staged:
                extra = s.size + PACK_TABLE_ROW.size + (overhead if not fitted else 0)
                if self._make_room_locked(reserved + extra, now):
                    fitted.append(s)
                    reserved += extra
                else:
                    refused[s.index] = "capacity:ENOSPC"
            self._reserved += reserved
        error: OSError | None = None
        stage = "write"
        published = False
        try:
            if fitted:
                for s in fitted:
                    s.digest = _digest(s.view)
                    s.header = PackRecord(
                        PACK_FORMAT_VERSION,
                        meta.kv_layout_version,
                        0,
                        now,
                        s.view.nbytes,
                        meta.namespace_digest,
                        s.key,
                        s.digest,
                    ).pack()
                with self._write_lock:
                    size, reserved = reserved, 0  # _write_batch releases the reservation
                    stage, error, published = self._write_batch(fitted, size, now)
                    if error is not None and error.errno == errno.ENOSPC and self._evict_for_disk(size, now):
                        stage, error, published = self._write_batch(fitted, size, now)
        finally:
            if reserved:
                with self._lock:
                    self._reserved -= reserved
        if fitted and published:
            self.write_failures.recovered()
        elif fitted:
            kind = f"{stage}:{errname(error or OSError(errno.EIO, ''))}"
            self.write_failures.failed(kind, f"failed ({kind}): {len(fitted)} entries under {self.root}")
        for s in fitted:
            if published:
                results[s.index] = True
                self.metrics.record_put(True, s.view.nbytes)
            else:
                self.metrics.record_put(False, error=f"{stage}:{errname(error or OSError(errno.EIO, ''))}")
        for i in sorted(refused):
            self.metrics.record_put(False, error=refused[i])
        if raise_on_error:
            if error is not None:
                raise error
            if any(reason.startswith("capacity") for reason in refused.values()):
                raise OSError(errno.ENOSPC, "store capacity taken by entries being published")
        return results

    def _write_batch(self, staged: list[_Staged], size: int, now: float) -> tuple[str, OSError | None, bool]:
        """Append the batch (``size`` bytes, reserved) to the newest pack while it stays under
        ``pack_bytes``, else start a new pack with it; index it once durable and release the
        reservation. (stage reached, error, published)."""
        with self._lock:
            target = self._append_to
            if target is not None and (target.removed or target.size + size > self.pack_bytes):
                target = self._append_to = None
            if target is not None:
                self._publishing.add(target.pack_id)  # neither evicted nor removed meanwhile
        if target is not None:
            stage, error = self._append(target, staged, now)
            with self._lock:
                self._reserved -= size
                if error is None:  # still publishing: replacing a key of this very pack must
                    self._install_locked(target, staged, now, size)  # not remove the pack
                self._publishing.discard(target.pack_id)
                if error is not None and not target.keys:
                    self._remove_pack_locked(target)
            return stage, error, error is None
        pack_id = secrets.token_hex(16)
        stage, error, pack = self._write_pack(pack_id, self._dir_for(pack_id), staged, now)
        with self._lock:
            self._reserved -= size
            if pack is not None:
                self._install_locked(pack, staged, now, size)
                if pack.size < self.pack_bytes:
                    self._append_to = pack
        return stage, error, pack is not None

    def _append(self, pack: _Pack, staged: list[_Staged], now: float) -> tuple[str, OSError | None]:
        """Append a batch to a published pack and fsync it (the pack's name is durable already).
        On an error the file is cut back to where it was, and the pack takes no more batches."""
        start = pack.size
        stage = "write"
        try:
            fd = os.open(pack.path, os.O_WRONLY | os.O_CLOEXEC)
        except OSError as exc:
            with self._lock:
                self._append_to = None
            return stage, exc
        try:
            os.lseek(fd, start, os.SEEK_SET)
            _write_batch_bytes(fd, start, staged, now, pack.pack_id)
            os.utime(fd, (now, now))  # mtime carries last access across restarts
            stage = "fsync"
            os.fsync(fd)
        except OSError as exc:
            with self._lock:
                self._append_to = None
            try:
                os.ftruncate(fd, start)
                os.fsync(fd)
            except OSError:  # what is left past `start` is a batch that does not check out
                with contextlib.suppress(OSError), self._lock:
                    extra = os.fstat(fd).st_size - start
                    if extra > 0 and not pack.removed:
                        pack.size += extra
                        self.metrics.bytes_resident.inc(extra)
            return stage, exc
        finally:
            os.close(fd)
        self._append_index_row(pack.path, start)
        return stage, None

    def _write_pack(
        self, pack_id: str, directory: str, staged: list[_Staged], now: float
    ) -> tuple[str, OSError | None, _Pack | None]:
        """Write ``staged`` (headers packed, digests set) as a new pack of one batch: temp file,
        fsync, rename, directory fsync. (stage reached, error, the published pack or None)."""
        final = f"{directory}/{pack_id}.pack"
        tmp = f"{directory}/.{pack_id}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
        stage = "mkdir"
        renamed = False
        try:
            syncs = self._make_dirs(directory)
            stage = "write"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                length = _write_batch_bytes(fd, 0, staged, now, pack_id)
                os.utime(fd, (now, now))  # mtime carries last access across restarts
                stage = "fsync"
                os.fsync(fd)
            finally:
                os.close(fd)
            stage = "rename"
            os.rename(tmp, final)
            renamed = True
            stage = "fsync_dir"
            for d in syncs:
                fsync_dir(d)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(final if renamed else tmp)  # visible but not durable: take it back
            return stage, exc, None
        self._known_dirs.update((directory, self._packs_str))
        self._append_index_row(final, 0)
        table = batch_overhead(len(staged))
        return stage, None, _Pack(pack_id, final, length, now, table, disk_access=now)

    def _make_dirs(self, leaf: str) -> tuple[str, ...]:
        """Create the fan-out directory if missing; the directories whose fsync makes a new name
        in it durable (its parent too while the directory itself is not known durable)."""
        if leaf in self._known_dirs:
            return (leaf,)
        with contextlib.suppress(FileExistsError):
            os.mkdir(leaf)
        if self._packs_str in self._known_dirs:
            return (leaf, self._packs_str)
        return (leaf, self._packs_str, str(self.root))

    def _install_locked(self, pack: _Pack, fitted: list[_Staged], now: float, grown: int) -> None:
        """Index a written batch: a new pack, or ``grown`` bytes appended to a published one."""
        if pack.pack_id in self._packs:
            pack.size += grown
            pack.table_bytes += batch_overhead(len(fitted))
            pack.created_at = now
            self.metrics.bytes_resident.inc(grown)
        else:
            self._packs[pack.pack_id] = pack
            self.metrics.bytes_resident.inc(pack.size)
        for s in fitted:
            self._drop_locked(s.key)  # the replaced version, if any
            self._index[s.key] = _Entry(pack, s.offset, s.view.nbytes, s.digest, now)
            pack.add(s.key, s.size)
            self.metrics.entries.inc()

    def get(self, key: bytes) -> bytes | None:
        """The verified payload, or ``None`` (miss, expired, unreadable, or corrupt → quarantined).

        One ``pread`` of the payload, checked against the digest the pack's table gave the index
        (the record header is ``verify``'s business). The hit's age is counted from the pack's
        publish time (for an entry moved by compaction, from the compaction)."""
        self._check_key(key)
        now = self._clock()
        with self._lock:
            entry = self._index.get(key)
            if entry is not None and self._expired(entry, now):
                self._drop_locked(key)
                self.metrics.expirations.inc()
                entry = None
            if entry is None:
                self.metrics.record_miss()
                return None
            entry.last_access = now  # the access counts now; a failed read drops the entry anyway
            self._index.move_to_end(key)
            pack = entry.pack
            try:
                fd = self._acquire(pack)
            except OSError as exc:
                failure: OSError | None = exc
            else:
                failure = None
        if failure is not None:
            self._read_failed(key, entry, failure)
            return None
        try:
            result = _read_payload(fd, entry.offset, entry.payload_len, entry.digest)
            if (
                not self.read_only
                and not isinstance(result, str)
                and now - pack.disk_access > _ACCESS_PERSIST_S
            ):
                with contextlib.suppress(OSError):
                    os.utime(fd, (now, now))  # recency survives a restart
                pack.disk_access = now
        except OSError as exc:
            self._release(pack)
            self._read_failed(key, entry, exc)
            return None
        self._release(pack)
        if isinstance(result, str):
            self._quarantine_entry(key, entry, result)
            self.metrics.record_miss()
            return None
        self.metrics.record_hit(len(result), age_s=now - pack.created_at)
        return result

    def _read_failed(self, key: bytes, entry: _Entry, exc: OSError) -> None:
        if isinstance(exc, FileNotFoundError):  # the pack vanished under us: a plain miss
            with self._lock:
                if self._index.get(key) is entry:
                    self._drop_locked(key)
            self.metrics.errors.inc("read:vanished")
        else:
            self.metrics.errors.inc(f"read:{errname(exc)}")
        self.metrics.record_miss()

    def prefetch(self, keys: Sequence[bytes]) -> None:
        """A hint this store does not act on (the contract allows it): a request's chunks lie
        next to each other in one pack, read in order through one descriptor, which the kernel's
        own sequential read-ahead already covers. Measured on the bench's disk, a
        ``POSIX_FADV_WILLNEED`` per run of records made cold reads slower (0.40 of one sequential
        file read against 0.51 without it) and page-cache reads too (0.66 against 0.77)."""
        for key in keys:
            self._check_key(key)

    def delete(self, key: bytes) -> bool:
        self._check_key(key)
        if self.read_only:
            return False
        with self._lock:
            entry = self._drop_locked(key)
        if entry is not None:
            self.metrics.deletes.inc()
        return entry is not None

    def pack_of(self, key: bytes) -> tuple[str, int] | None:
        """(pack file path, record offset) of an indexed key: for operators and tests."""
        with self._lock:
            entry = self._index.get(key)
            return None if entry is None else (entry.pack.path, entry.offset)

    # ---------------------------------------------------------------- quarantine
    def _quarantine_entry(self, key: bytes, entry: _Entry, reason: str) -> None:
        """Copy a bad record's bytes to ``quarantine/`` and drop it (unless a newer version of the
        key was published meanwhile, which stays)."""
        with self._lock:
            if self._index.get(key) is not entry:
                return
            if not self.read_only:
                self._copy_to_quarantine(entry, key, reason)
            self._drop_locked(key)
        _log.error(
            "store: quarantined entry %s at offset %d of %s (%s)",
            key_hex(key),
            entry.offset,
            entry.pack.path,
            reason,
        )
        self.metrics.quarantined.inc()
        self.quarantine_reasons.inc(reason)

    def _copy_to_quarantine(self, entry: _Entry, key: bytes, reason: str) -> None:
        target = self._quarantine_dir / f"{key_hex(key)}.{reason}.{time.time_ns()}.kv"
        try:
            self._quarantine_dir.mkdir(parents=True, exist_ok=True)
            with open(entry.pack.path, "rb", buffering=0) as src:
                raw = pread_exact(src.fileno(), entry.size, entry.offset) or b""
            target.write_bytes(raw)
        except OSError as exc:
            self.metrics.errors.inc(f"quarantine:{errname(exc)}")

    def _quarantine_pack_file(self, path: str, pack_id: str, reason: str) -> None:
        target = self._quarantine_dir / f"{pack_id}.{reason}.{time.time_ns()}.pack"
        try:
            self._quarantine_dir.mkdir(parents=True, exist_ok=True)
            os.rename(path, target)
        except FileNotFoundError:
            return
        except OSError as exc:
            self.metrics.errors.inc(f"quarantine:{errname(exc)}")
            try:
                os.unlink(path)
            except OSError:
                return
        for sidecar in (".idx", ".dead"):
            with contextlib.suppress(OSError):
                os.unlink(path[:-5] + sidecar)
        _log.error("store: quarantined pack %s (%s)", path, reason)
        self.metrics.quarantined.inc()
        self.quarantine_reasons.inc(reason)

    # ---------------------------------------------------------------- maintenance
    def gc(self, compact: bool = True) -> GcReport:
        """Expire entries idle longer than the retention, evict whole packs down to the capacity,
        rewrite packs whose live records fill less than half of them (``compact``), and delete
        quarantined files older than the retention."""
        report = GcReport()
        if self.read_only:
            return report
        now = self._clock()
        with self._lock:
            before = self.metrics.bytes_resident.value
            for key in [k for k, e in self._index.items() if self._expired(e, now)]:
                self._drop_locked(key)
                report.expired += 1
                self.metrics.expirations.inc()
            while self.metrics.bytes_resident.value + self._reserved > self.capacity_bytes:
                entry = next(
                    (e for e in self._index.values() if e.pack.pack_id not in self._publishing), None
                )
                if entry is None:
                    break
                for key in list(entry.pack.keys):
                    self._drop_locked(key, tombstone=False)
                    report.evicted += 1
                    self.metrics.evictions.inc()
            report.bytes_freed += before - self.metrics.bytes_resident.value
            sparse = [
                p for p in self._packs.values() if p.live_bytes < _COMPACT_BELOW * (p.size - p.table_bytes)
            ]
        if compact:
            for pack in sparse:
                report.bytes_freed += self._compact(pack, now)
        report.quarantine_purged = self._purge_quarantine(now)
        return report

    def _compact(self, old: _Pack, now: float) -> int:
        """Rewrite ``old``'s live records into a new pack; the bytes freed (0 if nothing moved)."""
        with self._lock:
            live = [(k, self._index[k]) for k in old.keys]
            if not live:
                return 0
            try:
                fd = self._acquire(old)
            except OSError:
                return 0
        moved: list[tuple[_Entry, _Staged]] = []
        try:
            for key, entry in live:
                try:
                    result = _read_record(fd, entry, key)
                except OSError:
                    continue
                if isinstance(result, str):
                    self._quarantine_entry(key, entry, result)
                    continue
                record, payload = result
                staged = _Staged(
                    len(moved), key, memoryview(payload), entry.size, record.pack(), entry.digest
                )
                moved.append((entry, staged))
        finally:
            self._release(old)
        if not moved:
            return 0
        pack_id = secrets.token_hex(16)
        _, error, new = self._write_pack(pack_id, self._dir_for(pack_id), [s for _, s in moved], now)
        if new is None:
            self.metrics.errors.inc(f"compact:{errname(error or OSError(errno.EIO, ''))}")
            return 0
        with self._lock:
            before = self.metrics.bytes_resident.value
            self._packs[new.pack_id] = new
            self.metrics.bytes_resident.inc(new.size)
            for entry, s in moved:
                if self._index.get(s.key) is not entry:  # replaced or dropped meanwhile
                    self._append_tombstone(new, s.key, s.offset)
                    continue
                self._index[s.key] = _Entry(new, s.offset, entry.payload_len, entry.digest, entry.last_access)
                new.add(s.key, s.size)
                old.discard(s.key, s.size)
            if not new.keys:
                self._remove_pack_locked(new)
            if not old.keys:
                self._remove_pack_locked(old)
            return max(0, before - self.metrics.bytes_resident.value)

    def verify(self, quarantine: bool = False) -> VerifyReport:
        """Read every pack on disk and check its table and every live record (header, key,
        length, XXH3-64). Bad entries are reported as ``("<pack id>.pack:<key hex>", reason)``
        (a bad table as ``("<pack id>.pack", reason)``); with ``quarantine=True`` (and not
        read-only) they are also moved to ``quarantine/`` and dropped from the index."""
        report = VerifyReport()
        files, _, index_files = self._sidecars()
        pack_ids = {item.name[:-5] for item in files if item.name.endswith(".pack")}
        for pack_id, path in sorted(index_files.items()):
            if pack_id not in pack_ids:
                report.bad.append((f"{pack_id}.pack", "missing"))
                if quarantine and not self.read_only:
                    self._missing_pack(pack_id, path)
                    report.quarantined += 1
        for item in files:
            if not item.name.endswith(".pack"):
                continue
            pack_id = item.name[:-5]
            dead = _read_tombstones(item.path[:-5] + ".dead")
            try:
                with open(item.path, "rb", buffering=0) as f:
                    fd = f.fileno()
                    table = self._open_table(item.path, pack_id, os.fstat(fd).st_size, dead)
                    if isinstance(table, str):
                        report.checked += 1
                        report.bad.append((item.name, table))
                        if quarantine and not self.read_only:
                            self._quarantine_known_pack(pack_id, item.path, table)
                            report.quarantined += 1
                        continue
                    for offset, length, reason in table.corrupt:
                        report.checked += 1
                        report.bad.append((f"{item.name}@{offset}", reason))
                        if quarantine and not self.read_only:
                            self._corrupt_batch(item.path, pack_id, offset, length, reason)
                            report.quarantined += 1
                    for row in table.rows:
                        key = row[0]
                        if (key, row[1]) in dead:
                            continue
                        report.checked += 1
                        result = _read_record(fd, row, key)
                        if not isinstance(result, str):
                            report.ok += 1
                            report.bytes_checked += PACK_RECORD.size + row[2]
                            continue
                        report.bad.append((f"{item.name}:{key_hex(key)}", result))
                        if quarantine and not self.read_only:
                            with self._lock:
                                entry = self._index.get(key)
                                ours = entry is not None and entry.pack.path == item.path
                            if ours:
                                assert entry is not None
                                self._quarantine_entry(key, entry, result)
                                report.quarantined += 1
            except FileNotFoundError:
                continue
            except OSError as exc:
                report.bad.append((item.name, f"read_error:{errname(exc)}"))
        return report

    def _quarantine_known_pack(self, pack_id: str, path: str, reason: str) -> None:
        """Move a pack to ``quarantine/``, then drop its entries (removing the pack from the
        index, as for any pack left empty; its file is already gone)."""
        self._quarantine_pack_file(path, pack_id, reason)
        with self._lock:
            pack = self._packs.get(pack_id)
            if pack is not None:
                for key in list(pack.keys):
                    self._drop_locked(key, tombstone=False)
                self._remove_pack_locked(pack)  # (a no-op unless a batch was being appended)

    def stats(self) -> dict[str, object]:
        out = self.metrics.as_dict()
        with self._lock:
            live = sum(p.live_bytes + p.table_bytes for p in self._packs.values())
            out.update(
                root=str(self.root),
                format="pack",
                capacity_bytes=self.capacity_bytes,
                retention_s=self.retention_s,
                reserved_bytes=self._reserved,
                fill_ratio=self.metrics.bytes_resident.value / self.capacity_bytes,
                packs=len(self._packs),
                cut_batches=self.cut_batches,
                corrupt_batches=self.corrupt_batches,
                corrupt_packs=self.corrupt_packs,
                missing_packs=self.missing_packs,
                live_bytes=live,
                dead_bytes=self.metrics.bytes_resident.value - live,
                open_packs=len(self._open),
                oldest_access=min((e.last_access for e in self._index.values()), default=None),
                newest_access=max((e.last_access for e in self._index.values()), default=None),
            )
        out.update(self._scan_stats())
        return out

    def check_integrity(self, check_files: bool = True) -> None:
        """Index vs packs vs gauges vs capacity; with ``check_files``, every pack file exists with
        its size. Call when no put is in flight (tests do, after each step)."""
        self.metrics.check()
        with self._lock:
            total = sum(p.size for p in self._packs.values())
            if total != self.metrics.bytes_resident.value:
                raise AssertionError(
                    f"packs hold {total} B but bytes_resident = {self.metrics.bytes_resident.value}"
                )
            if len(self._index) != self.metrics.entries.value:
                raise AssertionError(
                    f"index has {len(self._index)} entries but gauge = {self.metrics.entries.value}"
                )
            live: dict[str, tuple[int, int]] = {}
            for key, entry in self._index.items():
                pack = entry.pack
                if self._packs.get(pack.pack_id) is not pack:
                    raise AssertionError(f"entry {key_hex(key)} points into unpublished pack {pack.pack_id}")
                n, b = live.get(pack.pack_id, (0, 0))
                live[pack.pack_id] = (n + 1, b + entry.size)
                if entry.offset + entry.size > pack.size:
                    raise AssertionError(f"entry {key_hex(key)} runs past the end of pack {pack.pack_id}")
            for pack in self._packs.values():
                if live.get(pack.pack_id) != (len(pack.keys), pack.live_bytes) or not pack.keys:
                    raise AssertionError(
                        f"pack {pack.pack_id}: {len(pack.keys)} keys / {pack.live_bytes} B, index {live.get(pack.pack_id)}"
                    )
                if any(self._index.get(k) is None or self._index[k].pack is not pack for k in pack.keys):
                    raise AssertionError(f"pack {pack.pack_id} lists a key the index does not place there")
            if self._reserved < 0:
                raise AssertionError(f"negative reservation {self._reserved}")
            if len(self._open) > self.open_packs:
                raise AssertionError(f"{len(self._open)} open packs > {self.open_packs}")
            if total <= self.capacity_bytes:
                self._opened_over_capacity = False
            elif not self._publishing and not self._opened_over_capacity:
                raise AssertionError(f"{total} B resident exceeds capacity {self.capacity_bytes}")
            packs = [(p.path, p.size) for p in self._packs.values()]
        if check_files:
            for path, size in packs:
                try:
                    on_disk = os.stat(path).st_size
                except FileNotFoundError:
                    raise AssertionError(f"published pack {path} has no file") from None
                if on_disk != size:
                    raise AssertionError(f"pack {path}: file {on_disk} B, index {size} B")


def _write_batch_bytes(fd: int, start: int, staged: list[_Staged], now: float, pack_id: str) -> int:
    """Write one batch (head, records, table, tail) at the descriptor's position, which is
    ``start`` in the pack; set each record's offset; the batch's length."""
    length = batch_overhead(len(staged)) + sum(s.size for s in staged)
    write_all(fd, _batch_head(len(staged), length, pack_id))
    offset = start + PACK_BATCH.size
    rows: list[Row] = []
    for s in staged:
        s.offset = offset
        write_all(fd, s.header)
        write_all(fd, s.view)
        rows.append((s.key, offset, s.view.nbytes, s.digest))
        offset += s.size
    write_all(fd, _table_bytes(rows, now))
    return length


def _read_payload(fd: int, offset: int, payload_len: int, digest: int) -> bytes | str:
    """The payload of the record at ``offset`` (one ``pread`` straight into the returned bytes),
    checked against its table digest, or the reason it cannot be served."""
    payload = pread_exact(fd, payload_len, offset + PACK_RECORD.size)
    if payload is None:
        return "truncated"
    if _digest(payload) != digest:
        return "bad_digest"
    return payload


def _read_record(fd: int, row: Row | _Entry, key: bytes) -> tuple[PackRecord, bytes] | str:
    """Read and check one whole record against its table row (``verify``, compaction): the
    payload and its digest, then the header (magic, version, CRC, key, length, digest)."""
    if isinstance(row, _Entry):
        offset, payload_len, digest = row.offset, row.payload_len, row.digest
    else:
        _, offset, payload_len, digest = row
    payload = _read_payload(fd, offset, payload_len, digest)
    raw = pread_exact(fd, PACK_RECORD.size, offset)
    if raw is None:
        return "truncated"
    record = PackRecord.unpack(raw)
    if isinstance(record, str):
        return record
    if record.key != key:
        return "wrong_key"
    if record.payload_len != payload_len or record.payload_xxh3 != digest:
        return "header_mismatch"
    if isinstance(payload, str):
        return payload
    return record, payload
