"""The pack file format: byte layouts of records, batch heads, tables, tails, ``.idx`` rows and
tombstones, and the readers that check them (the start-up scan's batch walk).

For: :mod:`replaykv.cache.pack_store` (which owns the files, the index and every policy) and tests
or tools that look inside a pack. Not for: writing packs, choosing what to keep, or the
file-per-entry layout (``cache/file_store.py``). See ``pack_store``'s module docstring for the layout
of a store directory.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import xxhash

from replaykv.cache.fileio import crc_sealed, pread_exact, seal_crc
from replaykv.cache.keys import KEY_BYTES

__all__ = [
    "PACK_BATCH",
    "PACK_FORMAT_VERSION",
    "PACK_INDEX_ROW",
    "PACK_RECORD",
    "PACK_TABLE_ROW",
    "PACK_TAIL",
    "PackRecord",
    "PackTable",
    "batch_overhead",
    "read_pack_table",
]

PACK_FORMAT_VERSION = 2
_RECORD_MAGIC = b"RKVPKREC"
_TAIL_MAGIC = b"RKVPKEND"

PACK_RECORD = struct.Struct("<8sHHIdQ32s32sQI")
"""Header of one record in a pack, 108 bytes, little-endian, followed by the payload.

====== ===== ================================================================
offset bytes field
====== ===== ================================================================
0      8     magic ``b"RKVPKREC"``
8      2     u16 pack format version (``PACK_FORMAT_VERSION``)
10     2     u16 kv layout version of the payload (from :class:`EntryMeta`)
12     4     u32 flags (0; reserved)
16     8     f64 created_at, seconds on the store's clock
24     8     u64 payload length in bytes
32     32    namespace digest (``KeyNamespace.seed()``, or zeros)
64     32    key
96     8     u64 XXH3-64 of the payload (the table's copy is checked on every read: about
             two thirds of XXH3-128's time, which is a third of a page-cache read of a chunk)
104    4     u32 CRC-32 of bytes [0, 104) of the header
====== ===== ================================================================
"""

PACK_TABLE_ROW = struct.Struct("<32sQQQ")
"""One row of a pack's table, 56 bytes: key, offset of its record header in the pack, payload
length, XXH3-64 of the payload (the record header's digest again). Rows are in record order.
The index keeps the row, so a read is one ``pread`` of the payload checked against the row's
digest; ``verify`` also checks every record header against its row."""

PACK_BATCH = struct.Struct("<8sHHIQ16sI")
"""The first 44 bytes of every batch in a pack: magic ``b"RKVPKBAT"``, u16 format version, u16
reserved (0), u32 row count, u64 the batch's length in bytes (this head, its records, its table
and its tail), the 16-byte pack id (the file's name: a pack copied under another name does not
check out), u32 CRC-32 of bytes [0, 40). A pack is one or more batches back to back (a new
batch is appended while the pack is under ``pack_bytes``); the start-up scan walks them from the
front and, past a batch that does not check out, searches on for the next batch head that does
(see :func:`read_pack_table`)."""

PACK_INDEX_ROW = struct.Struct("<Q")
"""One row of a pack's ``.idx`` file, 8 bytes: the offset of a batch, appended once the batch is
durable (not fsynced itself: a row lost in a crash only makes that batch unlisted, and a listed
batch is always one whose bytes were durable). A listed batch that does not check out is damage;
an unlisted one past the last listed batch is a crash's torn tail."""

PACK_TAIL = struct.Struct("<8sHHIdII")
"""The last 32 bytes of a pack: magic ``b"RKVPKEND"``, u16 format version, u16 reserved (0),
u32 row count, f64 created_at (the pack's publish time: between two packs holding the same key
the later one wins), u32 CRC-32 of the table, u32 CRC-32 of the tail's bytes [0, 28)."""

_BATCH_MAGIC = b"RKVPKBAT"
_ZERO_DIGEST = bytes(KEY_BYTES)  # also the key of a tombstone that names a quarantined batch
_TOMBSTONE = struct.Struct("<32sQ")  # a dropped record in a pack's .dead file: key, record offset


class PackRecord(NamedTuple):
    """A parsed :data:`PACK_RECORD` header."""

    format_version: int
    kv_layout_version: int
    flags: int
    created_at: float
    payload_len: int
    namespace_digest: bytes
    key: bytes
    payload_xxh3: int

    def pack(self) -> bytes:
        head = PACK_RECORD.pack(
            _RECORD_MAGIC,
            self.format_version,
            self.kv_layout_version,
            self.flags,
            self.created_at,
            self.payload_len,
            self.namespace_digest,
            self.key,
            self.payload_xxh3,
            0,
        )
        return seal_crc(head)

    @classmethod
    def unpack(cls, raw: bytes) -> PackRecord | str:
        """The header, or the reason (a short string) it cannot be trusted."""
        if len(raw) < PACK_RECORD.size:
            return "truncated"
        magic, version, layout, flags, created, length, ns, key, digest, crc = PACK_RECORD.unpack_from(raw)
        if magic != _RECORD_MAGIC:
            return "bad_magic"
        if version != PACK_FORMAT_VERSION:
            return "wrong_version"
        if not crc_sealed(raw[: PACK_RECORD.size], crc):
            return "bad_header_crc"
        return cls(version, layout, flags, created, length, ns, key, digest)


def _digest(payload: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload)


Row = tuple[bytes, int, int, int]  # key, record offset, payload length, payload XXH3-64


def _pack_id_bytes(pack_id: str) -> bytes:
    try:
        raw = bytes.fromhex(pack_id)
    except ValueError:
        return b""
    return raw if len(raw) == 16 else b""


def _batch_head(count: int, length: int, pack_id: str = "") -> bytes:
    head = PACK_BATCH.pack(
        _BATCH_MAGIC, PACK_FORMAT_VERSION, 0, count, length, _pack_id_bytes(pack_id) or bytes(16), 0
    )
    return seal_crc(head)


def _table_bytes(rows: Sequence[Row], created_at: float) -> bytes:
    table = b"".join(PACK_TABLE_ROW.pack(*row) for row in rows)
    tail = PACK_TAIL.pack(_TAIL_MAGIC, PACK_FORMAT_VERSION, 0, len(rows), created_at, zlib.crc32(table), 0)
    return table + seal_crc(tail)


def batch_overhead(count: int) -> int:
    """Bytes of a batch of ``count`` records besides the records themselves."""
    return PACK_BATCH.size + count * PACK_TABLE_ROW.size + PACK_TAIL.size


@dataclass
class PackTable:
    """What a pack's batches say: rows (absolute offsets) with their batch's publish time, the
    bytes of heads, tables and tails, where the last batch that checks out ends, the damaged
    batches (offset, length, reason) and whether the pack ends in a batch a crash cut short."""

    rows: list[Row] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # per row: its batch's created_at
    overhead: int = 0
    end: int = 0
    created_at: float = 0.0  # of the last good batch
    corrupt: list[tuple[int, int, str]] = field(default_factory=list)
    cut: bool = False


def _read_batch(
    fd: int, at: int, file_size: int, pack_id: bytes | None = None
) -> tuple[float, list[Row], int] | str:
    """The batch at ``at``: (created_at, rows, its length), or why it does not check out."""
    if file_size - at < PACK_BATCH.size + PACK_TAIL.size:
        return "truncated"
    head = pread_exact(fd, PACK_BATCH.size, at)
    if head is None:
        return "truncated"
    magic, version, _, count, length, owner, crc = PACK_BATCH.unpack(head)
    if magic != _BATCH_MAGIC:
        return "bad_batch"
    if version != PACK_FORMAT_VERSION:
        return "wrong_version"
    if not crc_sealed(head, crc):
        return "bad_batch_crc"
    if pack_id is not None and owner != pack_id:
        return "wrong_pack"
    end = at + length
    if length < batch_overhead(count) or end > file_size:
        return "truncated"
    raw = pread_exact(fd, PACK_TAIL.size, end - PACK_TAIL.size)
    if raw is None:
        return "truncated"
    magic, version, _, tail_count, created, table_crc, crc = PACK_TAIL.unpack(raw)
    if magic != _TAIL_MAGIC:
        return "bad_tail"
    if not crc_sealed(raw, crc) or tail_count != count:
        return "bad_tail_crc"
    table_size = count * PACK_TABLE_ROW.size
    table_at = end - PACK_TAIL.size - table_size
    table = pread_exact(fd, table_size, table_at) if table_size else b""
    if table is None or zlib.crc32(table) != table_crc:
        return "bad_table"
    rows = [PACK_TABLE_ROW.unpack_from(table, i * PACK_TABLE_ROW.size) for i in range(count)]
    pos = at + PACK_BATCH.size
    for _, offset, size, _ in rows:
        if offset < pos or offset + PACK_RECORD.size + size > table_at:
            return "bad_table"
        pos = offset + PACK_RECORD.size + size
    return created, rows, length


_SEARCH_CHUNK = 1 << 20


def _next_batch(fd: int, start: int, file_size: int, pack_id: bytes | None) -> int | None:
    """The offset of the first batch at or after ``start`` that checks out, or None."""
    at = start
    while at < file_size:
        raw = os.pread(fd, _SEARCH_CHUNK + len(_BATCH_MAGIC) - 1, at)
        if not raw:
            return None
        hit = raw.find(_BATCH_MAGIC)
        while hit >= 0:
            if not isinstance(_read_batch(fd, at + hit, file_size, pack_id), str):
                return at + hit
            hit = raw.find(_BATCH_MAGIC, hit + 1)
        at += _SEARCH_CHUNK
    return None


def read_pack_table(
    fd: int,
    file_size: int,
    pack_id: bytes | None = None,
    listed: Iterable[int] = (),
    skipped: Iterable[int] = (),
) -> PackTable | str:
    """Walk a pack's batches from the front; past one that does not check out, search on for the
    next batch head that does, so that damage costs only the damaged batch.

    ``pack_id``: the id every batch head must carry (None: not checked). ``listed``: offsets of
    batches known durable (the ``.idx`` file). ``skipped``: offsets of batches already
    quarantined (not reported again). A bad stretch followed by a good batch, or one where a
    listed batch should be, is damage (``corrupt``); a bad stretch at the end past every listed
    batch is what a crash mid-append leaves (``cut``). The reason, when no batch checks out."""
    table = PackTable()
    known = sorted(set(listed))
    ignored = set(skipped)
    pos = 0
    while pos < file_size:
        batch = _read_batch(fd, pos, file_size, pack_id)
        if not isinstance(batch, str):
            created, rows, length = batch
            table.rows += rows
            table.times += [created] * len(rows)
            table.overhead += batch_overhead(len(rows))
            pos = table.end = pos + length
            table.created_at = created
            continue
        found = _next_batch(fd, pos + 1, file_size, pack_id)
        if found is None and not table.rows:
            return batch
        stop = file_size if found is None else found
        if found is None and not any(o >= pos for o in known):
            table.cut = True
        elif pos not in ignored:
            table.corrupt.append((pos, stop - pos, batch))
        pos = stop
    if not table.rows:
        return "truncated"
    lost = [o for o in known if o >= file_size]
    if lost and lost[0] not in ignored:
        table.corrupt.append((lost[0], 0, "truncated"))
    return table


def _read_index(path: str) -> list[int]:
    try:
        raw = Path(path).read_bytes()
    except OSError:
        return []
    usable = len(raw) - len(raw) % PACK_INDEX_ROW.size  # a torn last row is ignored
    return [PACK_INDEX_ROW.unpack_from(raw, i)[0] for i in range(0, usable, PACK_INDEX_ROW.size)]


def _read_tombstones(path: str) -> set[tuple[bytes, int]]:
    try:
        raw = Path(path).read_bytes()
    except OSError:
        return set()
    usable = len(raw) - len(raw) % _TOMBSTONE.size  # a torn last one is ignored
    return {_TOMBSTONE.unpack_from(raw, i) for i in range(0, usable, _TOMBSTONE.size)}
