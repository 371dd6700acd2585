"""The one-file-per-entry layout of the persistent global-KV store (``--store-format file``).

For: :class:`DirectoryStore`, the :class:`~replaykv.cache.store.GlobalKVStore` contract on a
local or shared file system: atomic publish (one entry, or a batch in one group commit), the
checksummed header of ``cache/store.py``, quarantine of bad files, capacity and retention,
metrics. The other layout, a file per written batch, is ``cache/pack_store.py``.

Not for: serialising tensors, choosing keys (``cache/keys.py``) or deciding what to write
(``cache/manager.py``).

On-disk layout under ``root``::

    entries/ab/cd/<64-hex key>.kv           published entries (ab, cd = first two key bytes)
    entries/ab/cd/.<hex>.<pid>.<rand>.tmp    a write in progress (or an orphan after a crash)
    quarantine/<hex>.<reason>.<ns>.kv        entries that failed verification; never read again

An entry file is ``STORE_HEADER`` followed by the payload. By default one process writes a
directory (its in-memory index is authoritative for ``get``/``contains``) and ``replaykv store``
may inspect it alongside; with ``shared=True`` several processes write it (see the class).

Publishing (``put`` is ``put_many`` of one entry): every entry's temp file is written and
fsynced (on a small thread pool, so the fsyncs of a batch overlap), then renamed to its final
name, then every directory the batch touched is fsynced once (group commit). A name therefore
never points at data that is not durable, an entry is reported published only once its name is
durable too, and a crash at any point leaves complete entries or temp files (swept at start-up).

Integrity: every read checks the header's CRC-32 and the payload's XXH3-64 (fast, catches
bit rot, torn/zeroed/stale sectors, truncation); ``verify`` also checks the SHA-256 digest.
Neither is a defence against someone who can write the directory (they could rewrite both).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import xxhash

from replaykv.cache.fileio import (
    errname,
    fsync_dir,
    pread_exact,
    write_all,
)
from replaykv.cache.keys import key_from_hex, key_hex
from replaykv.cache.store import (
    STORE_FORMAT_VERSION,
    STORE_HEADER,
    EntryHeader,
    EntryMeta,
    GcReport,
    LocalStore,
    Payload,
    VerifyReport,
)

_log = logging.getLogger(__name__)

__all__ = ["DEFAULT_IO_THREADS", "DirectoryStore"]


@dataclass
class _Entry:
    size: int  # bytes on disk, header included
    last_access: float
    disk_access: float = 0.0  # the access time last written to the file (recency across restarts)


# A read refreshes the file's access time at most this often: recency across a restart needs
# minutes, not every read (the in-memory index always has the exact last access).
_ACCESS_PERSIST_S = 60.0


@dataclass(eq=False)
class _Write:
    """One entry of a publish batch, through its stages."""

    index: int  # position in the caller's batch
    key: bytes
    view: memoryview
    size: int  # header + payload
    directory: str
    final: str
    tmp: str
    syncs: tuple[str, ...] = ()  # directories whose fsync makes the final name durable
    stage: str = "mkdir"
    error: OSError | None = None
    reserved: bool = False
    renamed: bool = False
    durable: bool = False

    def again(self) -> _Write:
        """A fresh try of this write, under a new temp name."""
        head, _, _ = self.tmp.rpartition(".")  # .<hex>.<pid>.<rand> . tmp
        base = head.rpartition(".")[0]
        return _Write(self.index, self.key, self.view, self.size, self.directory, self.final,
                      f"{base}.{secrets.token_hex(6)}.tmp")  # fmt: skip


def _disk_full(w: _Write) -> bool:
    return not w.durable and w.stage != "capacity" and w.error is not None and w.error.errno == errno.ENOSPC


_T = TypeVar("_T")


DEFAULT_IO_THREADS = 16
"""Threads per store that write and fsync a ``put_many`` batch: a batch of up to this many entries
waits for one round of overlapping fsyncs. They mostly sleep in ``fsync``; CPU use is the hashing."""

_SIZE_CHANGED = "size_changed"  # _read_verified: the file is not the size the index expected
_PAYLOAD_FIRST_MAX = 256 << 20  # read payloads up to this size before their header (see _read_verified)


class DirectoryStore(LocalStore[_Entry]):
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
        io_threads: threads that write and fsync the entries of one ``put_many`` batch (and fsync
            its directories) concurrently; 1 does everything on the calling thread. Started on
            the first batch of two or more entries; :meth:`close` stops them.

        shared: other processes (replicas on one shared file system) write this directory too.
            A key missing from the index is then looked up on disk (one ``stat``) and adopted
            when another process has published it since, and an entry is expired only when its
            file's mtime, which every process refreshes on access, is past the retention too.

    Start-up scans ``entries/`` to rebuild the index (size and last access from ``stat``),
    quarantines files shorter than a header and sweeps orphaned temp files. It does not evict;
    call :meth:`gc` to apply a lowered capacity or the retention.

    Several processes on one directory (``shared``): publication is a rename, so a reader sees
    an entry whole or not at all, and two writers of one key each rename a complete file (the
    content of a key is the same whoever computes it; the last rename wins). A reader that has
    opened a file keeps reading it when another process evicts, replaces or quarantines it
    (POSIX unlink / rename semantics; NFS keeps an open file with its "silly rename"); one that
    has not yet opened it gets a miss, counted ``read:vanished``. Quarantine moves the file out
    of ``entries/``, so every process stops serving it at its next read. A crashed writer
    leaves at most temp files, swept by any process once their writer is gone (same host) or
    older than ``orphan_grace_s``. Capacity is counted per process over the entries it indexed
    (its own and those it adopted): give each process its share.
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
        io_threads: int = DEFAULT_IO_THREADS,
        shared: bool = False,
    ) -> None:
        super().__init__(root, capacity_bytes, retention_s, clock, read_only, orphan_grace_s, "entries")
        self.io_threads = max(1, io_threads)
        self.shared = shared
        self.adopted = 0  # entries another process published, found on disk at a lookup
        self._entries_dir = self._data_dir
        self._entries_str = str(self._entries_dir)
        # Lock order: a key stripe, then _lock. _lock guards the index, gauges and reservations.
        self._stripes = [threading.Lock() for _ in range(64)]
        self._reserved = 0  # bytes of puts between make-room and index update
        self._publishing: set[bytes] = set()
        self._known_dirs: set[str] = set()  # fan-out dirs whose own name is known to be durable
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._scan()

    # ---------------------------------------------------------------- paths
    def _dir_for(self, hexkey: str) -> str:
        return f"{self._entries_str}/{hexkey[0:2]}/{hexkey[2:4]}"

    def _path_for(self, key: bytes) -> str:
        hexkey = key.hex()  # every caller has checked the key (``_check_key``)
        return f"{self._entries_str}/{hexkey[0:2]}/{hexkey[2:4]}/{hexkey}.kv"

    def _stripe(self, key: bytes) -> threading.Lock:
        return self._stripes[key[0] % len(self._stripes)]

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="replaykv-store-io")
            return self._pool

    def _parallel(self, fn: Callable[[_T], None], items: list[_T]) -> None:
        """``fn`` on every item, on the I/O threads when there are several (``fn`` must not raise
        for an I/O error: it records it on the item)."""
        if len(items) < 2 or self.io_threads < 2:
            for item in items:
                fn(item)
            return
        pool = self._executor()
        futures = [pool.submit(fn, item) for item in items]
        wait(futures)  # all of them, even when one raised: the caller cleans up after the batch
        for future in futures:
            future.result()

    def close(self) -> None:
        """Stop the I/O threads (idempotent; call it with no batch in flight). The store stays
        usable: a later batch starts them again."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

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

    def _scan(self) -> None:
        found: list[tuple[float, bytes, int]] = []
        for item in self._iter_entry_files():
            try:
                st = item.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            name = item.name
            if name.startswith(".") and name.endswith(".tmp"):
                self._sweep_temp(item, st)
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
    def _drop_locked(self, key: bytes) -> _Entry | None:
        entry = self._index.pop(key, None)
        if entry is not None:
            self.metrics.bytes_resident.dec(entry.size)
            self.metrics.entries.dec()
        return entry

    def _adopt(self, key: bytes) -> bool:
        """Index ``key`` if another process has published its file since (``shared`` only);
        whether the index holds it now."""
        try:
            st = os.stat(self._path_for(key))
        except OSError:
            return False
        if st.st_size < STORE_HEADER.size:
            return False  # a get would quarantine it; it is no entry to adopt
        now = self._clock()
        with self._lock:
            if key in self._index:
                return True
            if key in self._publishing:  # this process's own put of it is in flight
                return False
            entry = _Entry(size=st.st_size, last_access=now, disk_access=st.st_mtime)
            if self._expired(_Entry(size=st.st_size, last_access=st.st_mtime), now):
                return False
            self._index[key] = entry
            self.metrics.bytes_resident.inc(st.st_size)
            self.metrics.entries.inc()
            self.adopted += 1
        return True

    def _expired_on_disk(self, key: bytes, now: float) -> bool:
        """For a shared directory: whether the file's mtime (refreshed by any process's access)
        is past the retention too; a file already gone counts as expired."""
        if not self.shared or self.retention_s is None:
            return True
        try:
            return now - os.stat(self._path_for(key)).st_mtime > self.retention_s
        except OSError:
            return True

    def contains(self, key: bytes) -> bool:
        return super().contains(key) or (self.shared and self._adopt(key))

    def _remove_file(self, key: bytes) -> None:
        try:
            os.unlink(self._path_for(key))
        except FileNotFoundError:
            pass
        except OSError as exc:
            self.metrics.errors.inc(f"unlink:{errname(exc)}")

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
        return self.put_many([(key, payload)], meta, raise_on_error=raise_on_error)[0]

    def put_many(
        self,
        items: Iterable[tuple[bytes, Payload]],
        meta: EntryMeta | None = None,
        *,
        raise_on_error: bool = False,
    ) -> list[bool]:
        """Publish several entries in one group commit; ``put``'s result for each, in order.

        All temp files are written and fsynced (overlapping, on the I/O threads), then renamed,
        then each directory the batch touched is fsynced once. An entry is indexed (and counted
        as published) only when its data and its name are durable; an entry whose write, fsync,
        rename or directory fsync fails is removed again and reported ``False`` while the others
        go ahead, so a failure halfway publishes nothing of the failed entries and never a
        non-durable one. A crash leaves complete entries and temp files (swept at start-up).
        Keys must be distinct within a batch (``ValueError``). ``raise_on_error=True`` raises the
        first ``OSError`` after the whole batch was settled and counted.
        """
        batch = list(items)
        self._check_batch([key for key, _ in batch])
        if self.read_only:
            return self._refuse_read_only(len(batch))
        meta = meta or EntryMeta()
        results = [False] * len(batch)
        now = self._clock()
        writes: list[_Write] = []
        for i, (key, payload) in enumerate(batch):
            view = memoryview(payload) if isinstance(payload, bytes) else memoryview(payload).cast("B")
            size = STORE_HEADER.size + view.nbytes
            if size > self.capacity_bytes:
                self.metrics.record_put(False, error="too_large")
                continue
            hexkey = key_hex(key)
            directory = self._dir_for(hexkey)
            tmp = f"{directory}/.{hexkey}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
            writes.append(_Write(i, key, view, size, directory, f"{directory}/{hexkey}.kv", tmp))
        self._write_round(writes, meta, now)
        full = [w for w in writes if _disk_full(w)]
        if full and self._evict_for_disk(sum(w.size for w in full), {w.key for w in writes}, now):
            retries = [w.again() for w in full]
            self._write_round(retries, meta, now)
            by_index = {w.index: w for w in retries}
            writes = [by_index.get(w.index, w) for w in writes]
        if any(w.durable for w in writes):
            self.write_failures.recovered()
        failed = [w for w in writes if not w.durable]
        if failed:
            error = failed[0].error or OSError(errno.EIO, "entry not published")
            kind = f"{failed[0].stage}:{errname(error)}"
            self.write_failures.failed(kind, f"failed ({kind}): {len(failed)} entries under {self.root}")
        first_error: OSError | None = None
        for w in writes:
            if w.durable:
                results[w.index] = True
                self.metrics.record_put(True, w.view.nbytes)
                continue
            error = w.error or OSError(errno.EIO, "entry not published")
            self.metrics.record_put(False, error=f"{w.stage}:{errname(error)}")
            first_error = first_error or error
        if raise_on_error and first_error is not None:
            raise first_error
        return results

    def _write_round(self, writes: list[_Write], meta: EntryMeta, now: float) -> None:
        try:
            self._make_dirs(writes)
            self._parallel(lambda w: self._write_temp(w, meta, now), [w for w in writes if w.error is None])
            ready = [w for w in writes if w.error is None]
            if ready:
                self._publish(ready, now)
        finally:
            for w in writes:
                if not w.renamed:
                    with contextlib.suppress(OSError):
                        os.unlink(w.tmp)

    def _evict_for_disk(self, size: int, keep: set[bytes], now: float) -> bool:
        """The file system is full (ENOSPC) although the capacity is not: evict the entries used
        longest ago until ``size`` bytes are freed, for one more try of the failed writes. False
        if nothing could be evicted."""
        with self._lock:
            victims: list[bytes] = []
            freed = 0
            for key, entry in self._index.items():
                if freed >= size:
                    break
                if key in keep or key in self._publishing:
                    continue
                victims.append(key)
                freed += entry.size
            for key in victims:
                if self._drop_locked(key) is not None:
                    self.metrics.evictions.inc()
                    self._remove_file(key)
        if victims:
            _log.warning("store: %s is full (ENOSPC); evicted %d bytes to retry a write", self.root, freed)
        return bool(victims)

    def _make_dirs(self, writes: list[_Write]) -> None:
        """Create missing fan-out directories; record which directory fsyncs each entry needs.

        A directory not yet known to be durable also needs its parent fsynced (and the parent's
        parent, ``entries/``, when that one is new too); those fsyncs join the batch's directory
        fsyncs after the renames.
        """
        done: dict[str, tuple[str, ...] | OSError] = {}
        for w in writes:
            leaf = w.directory
            if leaf not in done:
                if leaf in self._known_dirs:
                    done[leaf] = (leaf,)
                else:
                    top = os.path.dirname(leaf)
                    try:
                        for d in (top, leaf):
                            with contextlib.suppress(FileExistsError):
                                os.mkdir(d)
                        done[leaf] = (
                            (leaf, top) if top in self._known_dirs else (leaf, top, self._entries_str)
                        )
                    except OSError as exc:
                        done[leaf] = exc
            result = done[leaf]
            if isinstance(result, OSError):
                w.stage, w.error = "mkdir", result
            else:
                w.syncs = result

    @staticmethod
    def _write_temp(w: _Write, meta: EntryMeta, now: float) -> None:
        """Write and fsync one entry's temp file (on an I/O thread); an OSError lands on ``w``."""
        w.stage = "write"
        header = EntryHeader(
            format_version=STORE_FORMAT_VERSION,
            kv_layout_version=meta.kv_layout_version,
            flags=0,
            created_at=now,
            payload_len=w.view.nbytes,
            namespace_digest=meta.namespace_digest,
            key=w.key,
            payload_sha256=hashlib.sha256(w.view).digest(),
            payload_xxh3=xxhash.xxh3_64_intdigest(w.view),
        ).pack()
        try:
            fd = os.open(w.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                write_all(fd, header)
                write_all(fd, w.view)
                os.utime(fd, (now, now))  # mtime carries last access across restarts
                w.stage = "fsync"
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            w.error = exc

    def _fsync_dirs(self, dirs: list[str]) -> dict[str, OSError]:
        """fsync each directory once (concurrently); the ones that failed, with their error."""
        failed: dict[str, OSError] = {}

        def sync(path: str) -> None:
            try:
                fsync_dir(path)
            except OSError as exc:
                failed[path] = exc

        self._parallel(sync, dirs)
        return failed

    def _publish(self, ready: list[_Write], now: float) -> None:
        """Reserve room, rename every durable temp file, fsync the touched directories, index."""
        stripes = sorted({w.key[0] % len(self._stripes) for w in ready})
        with contextlib.ExitStack() as held:
            for i in stripes:  # one publish per key at a time; quarantine/delete take them too
                held.enter_context(self._stripes[i])
            with self._lock:
                for w in ready:
                    if self._make_room_locked(w.size, now, replacing=w.key):
                        self._reserved += w.size
                        self._publishing.add(w.key)
                        w.reserved = True
                    else:
                        w.stage = "capacity"
                        w.error = OSError(errno.ENOSPC, "store capacity taken by entries being published")
            live = [w for w in ready if w.reserved]
            try:
                for w in live:
                    w.stage = "rename"
                    try:
                        os.rename(w.tmp, w.final)
                        w.renamed = True
                    except OSError as exc:
                        w.error = exc
                renamed = [w for w in live if w.renamed]
                failed = self._fsync_dirs(list(dict.fromkeys(d for w in renamed for d in w.syncs)))
                for w in renamed:
                    error = next((failed[d] for d in w.syncs if d in failed), None)
                    if error is None:
                        w.durable = True
                    else:
                        w.stage, w.error = "fsync_dir", error
            finally:
                with self._lock:
                    for w in live:
                        self._reserved -= w.size
                        self._publishing.discard(w.key)
                        if w.renamed:  # the old version (if any) is gone either way
                            self._drop_locked(w.key)
                        if w.durable:
                            self._index[w.key] = _Entry(size=w.size, last_access=now)
                            self.metrics.bytes_resident.inc(w.size)
                            self.metrics.entries.inc()
                for w in live:
                    if w.renamed and not w.durable:  # visible but not durable: take it back
                        with contextlib.suppress(OSError):
                            os.unlink(w.final)
        for w in ready:
            if w.durable:
                self._known_dirs.update((w.directory, os.path.dirname(w.directory)))

    def get(self, key: bytes) -> bytes | None:
        """The verified payload, or ``None`` (miss, expired, unreadable, or corrupt → quarantined)."""
        self._check_key(key)
        if self.shared and key not in self._index:
            self._adopt(key)
        now = self._clock()
        with self._lock:
            entry = self._index.get(key)
            if entry is not None and self._expired(entry, now) and not self._expired_on_disk(key, now):
                entry.last_access = now  # another process used it within the retention
                self._index.move_to_end(key)
            if entry is not None:
                if self._expired(entry, now):
                    self._drop_locked(key)
                    self.metrics.expirations.inc()
                    if not self.read_only and key not in self._publishing:
                        self._remove_file(key)
                    entry = None
                else:  # the access counts now; a read that fails below drops the entry anyway
                    entry.last_access = now
                    self._index.move_to_end(key)
        if entry is None:
            self.metrics.record_miss()
            return None
        path = self._path_for(key)
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                # The index knows the file's size, and the read itself shows whether the file
                # still has it; only then (a new version replaced it since, or it was damaged)
                # does the read pay for an fstat and a second try at the size the file has.
                st: os.stat_result | None = None
                result = self._read_verified(fd, entry.size, key, size_unconfirmed=True)
                if isinstance(result, str):
                    st = os.fstat(fd)
                    if result == _SIZE_CHANGED:
                        result = self._read_verified(fd, st.st_size, key)
                if (
                    not self.read_only
                    and not isinstance(result, str)
                    and now - entry.disk_access > _ACCESS_PERSIST_S
                ):
                    with contextlib.suppress(OSError):
                        os.utime(fd, (now, now))  # recency survives a restart; no second path walk
                    entry.disk_access = now
            finally:
                os.close(fd)
        except FileNotFoundError:
            # Evicted, deleted or replaced under us: a plain miss.
            with self._lock:
                if self._index.get(key) is entry:
                    self._drop_locked(key)
            self.metrics.errors.inc("read:vanished")
            self.metrics.record_miss()
            return None
        except OSError as exc:
            self.metrics.errors.inc(f"read:{errname(exc)}")
            self.metrics.record_miss()
            return None
        if isinstance(result, str):
            assert st is not None  # a failed read fstat-ed its file
            self._quarantine_if_same(key, path, st, result)
            self.metrics.record_miss()
            return None
        header, payload = result
        self.metrics.record_hit(len(payload), age_s=now - header.created_at)
        return payload

    def prefetch(self, keys: Sequence[bytes]) -> None:
        """Ask the kernel to read the indexed keys' files in (``POSIX_FADV_WILLNEED``): on a cold
        cache the disk then works on all of them at once while ``get`` reads them one by one.
        Not read here, and not into buffers: holding several payloads at once costs page-cache
        hits fresh memory for each, which is more than the read itself."""
        for key in keys:
            self._check_key(key)
        if not hasattr(os, "posix_fadvise"):
            return
        for key in keys:
            with self._lock:
                if key not in self._index:
                    continue
            try:
                fd = os.open(self._path_for(key), os.O_RDONLY)
            except OSError:
                continue  # a later get sees it (and counts it)
            try:
                with contextlib.suppress(OSError):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)

    @staticmethod
    def _read_verified(
        fd: int, file_size: int, key: bytes | None, *, sha256: bool = False, size_unconfirmed: bool = False
    ) -> tuple[EntryHeader, bytes] | str:
        """Parse and check one entry file; the header and payload, or the reason it is bad.

        The payload is read first, in one ``pread`` of everything after the header straight into
        the ``bytes`` returned (no second copy), and the header after it: on a cold cache that is
        one I/O round trip instead of two (the header's page is read with the payload's first).
        The payload's XXH3-64 is checked always, its SHA-256 digest too with ``sha256=True``.
        With ``size_unconfirmed=True`` (``file_size`` is what the index expects, not an fstat) the
        read asks for one byte more, and a file of any other size gives :data:`_SIZE_CHANGED`,
        which is no verdict on the file: the caller reads it again at its real size.
        """
        payload_size = file_size - STORE_HEADER.size
        payload: bytes | None = None
        if size_unconfirmed:
            payload = os.pread(fd, payload_size + 1, STORE_HEADER.size) if payload_size >= 0 else b""
            if len(payload) != payload_size:  # a short pread of a regular file is its end
                return _SIZE_CHANGED
        elif 0 <= payload_size <= _PAYLOAD_FIRST_MAX:
            payload = pread_exact(fd, payload_size, STORE_HEADER.size)
        parsed = EntryHeader.unpack(os.pread(fd, STORE_HEADER.size, 0))
        if isinstance(parsed, str):
            return parsed
        if key is not None and parsed.key != key:
            return "wrong_key"
        if payload_size < parsed.payload_len:
            return "truncated"
        if payload_size > parsed.payload_len:
            return "size_mismatch"
        if payload is None:  # a huge file: its header was checked before reading it
            payload = pread_exact(fd, parsed.payload_len, STORE_HEADER.size)
        if payload is None or len(payload) != parsed.payload_len:
            return "truncated"  # shrank under us
        if xxhash.xxh3_64_intdigest(payload) != parsed.payload_xxh3:
            return "bad_digest"
        if sha256 and hashlib.sha256(payload).digest() != parsed.payload_sha256:
            return "bad_digest"
        return parsed, payload

    def _quarantine_path(self, path: str | Path, key: bytes, reason: str) -> bool:
        self._quarantine_dir.mkdir(parents=True, exist_ok=True)
        target = self._quarantine_dir / f"{key_hex(key)}.{reason}.{time.time_ns()}.kv"
        try:
            os.rename(path, target)
        except FileNotFoundError:
            return False
        except OSError as exc:
            self.metrics.errors.inc(f"quarantine:{errname(exc)}")
            try:
                os.unlink(path)
            except OSError:
                return False
        self.metrics.quarantined.inc()
        self.quarantine_reasons.inc(reason)
        _log.error("store: quarantined entry %s (%s) to %s", path, reason, target)
        return True

    def _quarantine_if_same(self, key: bytes, path: str | Path, st: os.stat_result, reason: str) -> None:
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
                k
                for k, e in self._index.items()
                if k not in self._publishing and self._expired(e, now) and self._expired_on_disk(k, now)
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
        report.quarantine_purged = self._purge_quarantine(now)
        return report

    def verify(self, quarantine: bool = False) -> VerifyReport:
        """Read every entry file on disk and check header, size, key, payload CRC-32 and SHA-256.

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
                    result = self._read_verified(f.fileno(), st.st_size, key, sha256=True)
            except FileNotFoundError:
                report.checked -= 1
                continue
            except OSError as exc:
                report.bad.append((name, f"read_error:{errname(exc)}"))
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
                shared=self.shared,
                adopted=self.adopted,
                capacity_bytes=self.capacity_bytes,
                retention_s=self.retention_s,
                reserved_bytes=self._reserved,
                fill_ratio=self.metrics.bytes_resident.value / self.capacity_bytes,
                oldest_access=min((e.last_access for e in self._index.values()), default=None),
                newest_access=max((e.last_access for e in self._index.values()), default=None),
            )
        out.update(self._scan_stats())
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
