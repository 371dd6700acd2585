"""Serialisation of cache state, defined once: global-KV chunks and window snapshots.

For: turning the part of a :class:`~replaykv.model.cache_view.CacheView` row that outlives a
request into self-describing, checksummed bytes and back, so the device pool, the SWA pool and
the global-KV store all move the same objects:

* :class:`GlobalChunk` — one chunk of ``chunk_size`` tokens ``[start, start + chunk_size)``: per
  KV source the compressed entries and index keys of the groups inside it. The *tail* variant
  ends at an arbitrary turn boundary H instead: the complete groups in ``[start, H)`` plus the
  compressor carry needed to continue exactly at H (the pending raw projections of the open
  group of every ratio > 1 source, and for overlapping V4 compressors the previous group's rows).
* :class:`WindowSnapshot` — the window entries of every layer for ``[H − W, H)`` in position
  order, the compressor carry of every source, H and the namespace digest.

``extract_*`` copy a row's state out of a view (cheap clones, safe to hand to another thread);
``load_chunk`` / ``load_snapshot`` write it into a row of another view. Loading chunks
``[0, H // C)``, the tail at H and the snapshot at H into a fresh view, then setting the row's
position to H, continues bit-identically to never having stopped. Nothing here reads or changes
``view.positions``: positions belong to the runner.

Not for: choosing keys (``cache/keys.py``), deciding what to write (``cache/manager.py``), paging
(``cache/device_pool.py``) or storing bytes (``cache/store.py``, ``cache/swa_pool.py``).

Encodings. With the model's KV quantisers on (``CacheLayout.kv_quant``) and a DeepSeek-V4.1 spec,
compressed entries use :data:`~replaykv.model.quant.FP4_COMPRESSED_ENTRY`, index keys
:data:`~replaykv.model.quant.MXFP4_INDEX_KEY` and window entries
:data:`~replaykv.model.quant.FP8_WINDOW_ENTRY` (the model's cached values are already on those
grids, so packing is lossless). Every packed section is checked bit for bit after packing; a
section that would not round-trip (the FP4 quantiser is not idempotent for a narrow amax range,
see ``model/quant.py``) is stored raw instead, so a load never changes a value. V4 configs and
quantisers off store raw little-endian bytes of the view's dtype (float32, bfloat16 or float16).
Compressor carry is always raw float32. Each section records its encoding.

Byte format (little-endian), one blob = header, section table, section data::

    CHUNK_HEADER  88 B  magic(8) version u16, flags u16 (bit 0: tail), chunk_size u32,
                        start u64, end u64, data_len u64, created_at f64, namespace digest (32),
                        n_sections u32, crc32 u32 (over header[:84] + table + data)
    SECTION       28 B  layer u16, kind u8, encoding u8, rows u32, dim u32, first i64
                        (group index for entries/index keys, position otherwise), nbytes u64

A snapshot uses the same header with magic ``RKVSNP01`` and ``start == end == H``. The data bytes
of a full chunk equal ``KVLedger.global_bytes(chunk_size)`` of :mod:`replaykv.model.accounting`
(quantised V4.1); a snapshot's window bytes equal ``KVLedger.window_state_bytes()`` once H ≥ W and
its carry bytes never exceed ``KVLedger.compressor_tail_bytes()``.
"""

from __future__ import annotations

import struct
import sys
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from replaykv.cache.keys import KEY_BYTES, KeyNamespace
from replaykv.model.cache_view import CacheView, CompressorCarry
from replaykv.model.quant import FP4_COMPRESSED_ENTRY, FP8_WINDOW_ENTRY, MXFP4_INDEX_KEY, KVEntryLayout
from replaykv.model.spec import ModelSpec

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = [
    "CHUNK_HEADER",
    "CHUNK_MAGIC",
    "LAYOUT_VERSION",
    "SECTION",
    "SNAPSHOT_MAGIC",
    "CacheLayout",
    "CarryRows",
    "GlobalChunk",
    "LayoutError",
    "SourceGroups",
    "WindowSnapshot",
    "extract_chunk",
    "extract_snapshot",
    "extract_tail",
    "load_chunk",
    "load_snapshot",
]

if sys.byteorder != "little":  # raw sections are the host's bytes; every supported host is LE
    raise ImportError("replaykv.cache.layout needs a little-endian host")

LAYOUT_VERSION = 1
"""Version of this byte format; part of every key namespace (``KeyNamespace.kv_layout_version``)."""

CHUNK_MAGIC = b"RKVGKV01"
SNAPSHOT_MAGIC = b"RKVSNP01"
CHUNK_HEADER = struct.Struct("<8sHHIQQQd32sII")
"""Header of a chunk or snapshot blob, 88 bytes (see the module docstring)."""
SECTION = struct.Struct("<HBBIIqQ")
"""One section-table row, 28 bytes: layer, kind, encoding, rows, dim, first, nbytes."""
_CRC_OFFSET = CHUNK_HEADER.size - 4
_FLAG_TAIL = 1

# Section kinds.
ENTRIES, INDEX_KEYS, CARRY_KV, CARRY_GATE, INDEX_CARRY_KV, INDEX_CARRY_GATE, WINDOW = range(7)
_KIND_NAMES = (
    "entries",
    "index_keys",
    "carry_kv",
    "carry_gate",
    "index_carry_kv",
    "index_carry_gate",
    "window",
)

# Section encodings: raw dtypes, then the packed layouts of model/quant.py.
RAW_F32, RAW_BF16, RAW_F16 = 0, 1, 2
FP4_ENTRY, MXFP4_INDEX, FP8_WINDOW = 16, 17, 18
_RAW_DTYPES: dict[int, torch.dtype] = {
    RAW_F32: torch.float32,
    RAW_BF16: torch.bfloat16,
    RAW_F16: torch.float16,
}
_RAW_CODES = {dtype: code for code, dtype in _RAW_DTYPES.items()}
_PACKED: dict[int, KVEntryLayout] = {
    FP4_ENTRY: FP4_COMPRESSED_ENTRY,
    MXFP4_INDEX: MXFP4_INDEX_KEY,
    FP8_WINDOW: FP8_WINDOW_ENTRY,
}
_PACKED_FOR_KIND = {ENTRIES: FP4_ENTRY, INDEX_KEYS: MXFP4_INDEX, WINDOW: FP8_WINDOW}


class LayoutError(ValueError):
    """A blob that must not be loaded: ``reason`` is a short tag (``bad_crc``, ``wrong_namespace``, …)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def _raw_code(dtype: torch.dtype) -> int:
    code = _RAW_CODES.get(dtype)
    if code is None:
        raise TypeError(f"cache tensors must be float32, bfloat16 or float16 to serialise; got {dtype}")
    return code


@dataclass(frozen=True)
class CacheLayout:
    """How one model's cache state is laid out in bytes: the spec, the chunk size, the encodings.

    ``kv_quant``: the model's KV fake quantisers are on (``config.kv_quant``); only DeepSeek-V4.1
    specs are then packed (V4's 584 B record is accounted, never packed). ``dtype``: the dtype of
    the views' window/entry/index tensors (carry is always float32), used for raw sizes.
    ``chunk_size`` must be a multiple of every source's ratio so chunks hold whole groups.
    """

    spec: ModelSpec
    chunk_size: int = 256
    kv_quant: bool = False
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        align = self.spec.group_alignment
        if self.chunk_size <= 0 or self.chunk_size % align:
            raise ValueError(
                f"chunk_size {self.chunk_size} must be a positive multiple of every source's compression "
                f"ratio (lcm {align}) so a chunk holds whole groups; use e.g. {max(align, 256 // align * align)}"
            )
        _raw_code(self.dtype)

    # ---------------------------------------------------------------- identity
    @property
    def packed(self) -> bool:
        """Whether entries / index keys / window entries use the V4.1 block-scaled layouts."""
        return self.kv_quant and self.spec.kind == "v41"

    @property
    def kv_dtypes(self) -> tuple[str, ...]:
        """What changes the bytes: goes into ``KeyNamespace.kv_dtypes``."""
        raw = str(self.dtype).removeprefix("torch.")
        carry = "carry_float32"
        if self.packed:
            return (
                "entry_fp4_e2m1_e4m3",
                "index_mxfp4_e2m1_ue8m0",
                "window_fp8_e4m3_ue8m0",
                f"raw_{raw}",
                carry,
            )
        return (f"raw_{raw}", carry)

    def namespace(
        self, model_config_hash: str, weights_digest: str, tenant_salt: bytes | str = b""
    ) -> KeyNamespace:
        """A :class:`KeyNamespace` with this layout's version, dtypes, schedule and chunk size."""
        return KeyNamespace(
            model_config_hash=model_config_hash,
            weights_digest=weights_digest,
            kv_layout_version=LAYOUT_VERSION,
            kv_dtypes=self.kv_dtypes,
            compress_ratios=self.spec.ratios,
            chunk_size=self.chunk_size,
            tenant_salt=tenant_salt,
        )

    def check_namespace(self, namespace: KeyNamespace) -> None:
        """Raise ``ValueError`` unless the namespace names exactly this layout's bytes."""
        want = {
            "kv_layout_version": LAYOUT_VERSION,
            "kv_dtypes": self.kv_dtypes,
            "compress_ratios": self.spec.ratios,
            "chunk_size": self.chunk_size,
        }
        bad = {k: (getattr(namespace, k), v) for k, v in want.items() if getattr(namespace, k) != v}
        if bad:
            detail = "; ".join(f"{k} is {got!r}, the layout needs {need!r}" for k, (got, need) in bad.items())
            raise ValueError(
                f"the key namespace does not describe this cache layout ({detail}); build it with "
                "CacheLayout.namespace(model_config_hash, weights_digest)"
            )

    # ---------------------------------------------------------------- sizes
    @property
    def _elem(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    def entry_bytes(self, layer: int) -> int:
        """Bytes of one compressed entry of a source layer."""
        d = self.spec.layers[layer].head_dim
        return FP4_COMPRESSED_ENTRY.bytes_per_entry(d) if self.packed else d * self._elem

    def index_key_bytes(self, layer: int) -> int:
        """Bytes of one index key of a source layer (0 without an indexer)."""
        di = self.spec.layers[layer].index_dim
        if not di:
            return 0
        return MXFP4_INDEX_KEY.bytes_per_entry(di) if self.packed else di * self._elem

    def window_entry_bytes(self, layer: int) -> int:
        d = self.spec.layers[layer].head_dim
        return FP8_WINDOW_ENTRY.bytes_per_entry(d) if self.packed else d * self._elem

    def global_bytes(self, tokens: int) -> int:
        """Data bytes of the global KV of a ``tokens``-long prefix: complete groups per source."""
        return sum(
            (tokens // self.spec.layers[s].ratio) * (self.entry_bytes(s) + self.index_key_bytes(s))
            for s in self.spec.sources
        )

    @property
    def page_bytes(self) -> int:
        """Data bytes of one full chunk (a device-pool page): Σ sources (C / r) × (entry + index key)."""
        return self.global_bytes(self.chunk_size)

    @property
    def resident_page_bytes(self) -> int:
        """Memory one device-pool page holds: a full chunk's entries and index keys as tensors of
        ``dtype`` (unpacked, whatever the wire format), plus the largest carry a tail keeps."""
        groups = sum(
            (self.chunk_size // self.spec.layers[s].ratio)
            * (self.spec.layers[s].head_dim + self.spec.layers[s].index_dim)
            * self._elem
            for s in self.spec.sources
        )
        period = 2 * self.spec.group_alignment
        return groups + max(self.carry_bytes(self.chunk_size + k) for k in range(period))

    def _overlapping(self, layer: int, index: bool) -> bool:
        ls = self.spec.layers[layer]
        ring = ls.index_carry_ring if index else ls.carry_ring
        return ring == 2 * ls.ratio

    def carry_rows(self, layer: int, end: int, *, index: bool = False) -> int:
        """Carry rows needed to continue a source at position ``end``.

        The open group's rows ``[end − end % r, end)``; an overlapping (V4 CSA) compressor also
        pools the previous group's first half, so it needs ``r`` more. Never more than ``end``.
        """
        ls = self.spec.layers[layer]
        ring = ls.index_carry_ring if index else ls.carry_ring
        if not ring:
            return 0
        need = end % ls.ratio + (ls.ratio if self._overlapping(layer, index) else 0)
        return min(end, need, ring)

    def carry_bytes(self, end: int) -> int:
        """float32 kv + gate bytes of every source's carry rows at ``end``."""
        total = 0
        for s in self.spec.sources:
            ls = self.spec.layers[s]
            total += 2 * 4 * self.carry_rows(s, end) * ls.carry_width
            total += 2 * 4 * self.carry_rows(s, end, index=True) * ls.index_carry_width
        return total

    def needs_carry(self, end: int) -> bool:
        """Whether continuing at ``end`` needs compressor rows beyond the complete groups."""
        return self.carry_bytes(end) > 0

    def window_bytes(self, end: int) -> int:
        """Window data bytes of a snapshot at ``end``: every layer's last min(end, W) entries."""
        return sum(min(end, ls.window) * self.window_entry_bytes(i) for i, ls in enumerate(self.spec.layers))

    def snapshot_bytes(self, end: int) -> int:
        """Data bytes of a snapshot at ``end`` (window + carry), without header and table."""
        return self.window_bytes(end) + self.carry_bytes(end)

    @property
    def max_snapshot_bytes(self) -> int:
        """Largest snapshot data size over every ``end`` (the per-request window state)."""
        period = self.spec.group_alignment
        w = max((ls.window for ls in self.spec.layers), default=0)
        base = w + 2 * period
        return max(self.snapshot_bytes(base + k) for k in range(period))

    # ---------------------------------------------------------------- sections
    def encoding_for(self, kind: int) -> int | None:
        """The packed encoding a section kind uses under this layout, or None (raw)."""
        return _PACKED_FOR_KIND.get(kind) if self.packed else None

    def _section_bytes(self, encoding: int, rows: int, dim: int) -> int:
        if encoding in _PACKED:
            return rows * _PACKED[encoding].bytes_per_entry(dim)
        if encoding in _RAW_DTYPES:
            return rows * dim * torch.empty(0, dtype=_RAW_DTYPES[encoding]).element_size()
        raise LayoutError("bad_encoding", f"unknown section encoding {encoding}")


# ------------------------------------------------------------------------------------------------
# Objects
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SourceGroups:
    """One KV source's groups ``[first_group, first_group + n)``: entries [n, D], index keys [n, Di]."""

    layer: int
    first_group: int
    entries: torch.Tensor
    index_keys: torch.Tensor | None = None

    @property
    def count(self) -> int:
        return int(self.entries.shape[0])


@dataclass(frozen=True)
class CarryRows:
    """One source's compressor rows for positions ``[first, first + rows)`` in order (float32).

    kv, gate: [rows, carry_width]; index_kv, index_gate: [index rows, index_carry_width] starting
    at ``index_first`` (DeepSeek-V4 indexers own a compressor), else None.
    """

    layer: int
    first: int
    kv: torch.Tensor
    gate: torch.Tensor
    index_first: int = 0
    index_kv: torch.Tensor | None = None
    index_gate: torch.Tensor | None = None


@dataclass(frozen=True)
class GlobalChunk:
    """Global KV of ``[start, end)``: a full chunk (``end − start == chunk_size``) or a tail.

    A tail ends at a turn boundary H inside the chunk that starts at ``start`` (``start`` is a
    multiple of ``chunk_size``, ``start ≤ H``) and carries the compressor rows needed at H.
    """

    start: int
    end: int
    chunk_size: int
    sources: tuple[SourceGroups, ...]
    carry: tuple[CarryRows, ...] = ()
    namespace_digest: bytes = bytes(KEY_BYTES)
    created_at: float = 0.0

    @property
    def is_tail(self) -> bool:
        return self.end - self.start != self.chunk_size

    def verify(self, layout: CacheLayout, *, namespace_digest: bytes, start: int, end: int) -> None:
        """Raise :class:`LayoutError` unless this chunk is the one expected at ``[start, end)``."""
        if self.namespace_digest != namespace_digest:
            raise LayoutError("wrong_namespace")
        if (self.start, self.end, self.chunk_size) != (start, end, layout.chunk_size):
            raise LayoutError(
                "wrong_range",
                f"chunk covers [{self.start}, {self.end}) of size {self.chunk_size}, "
                f"expected [{start}, {end}) of size {layout.chunk_size}",
            )
        _check_chunk_shapes(layout, self)

    def to_bytes(self, layout: CacheLayout) -> bytes:
        sections: list[tuple[int, int, int, torch.Tensor]] = []
        for sg in self.sources:
            sections.append((sg.layer, ENTRIES, sg.first_group, sg.entries))
            if sg.index_keys is not None:
                sections.append((sg.layer, INDEX_KEYS, sg.first_group, sg.index_keys))
        sections += _carry_sections(self.carry)
        flags = _FLAG_TAIL if self.is_tail else 0
        return _encode(
            layout, CHUNK_MAGIC, flags, self.chunk_size, self.start, self.end, self.created_at,
            self.namespace_digest, sections,
        )  # fmt: skip

    @classmethod
    def from_bytes(
        cls,
        layout: CacheLayout,
        data: bytes | bytearray | memoryview,
        *,
        namespace_digest: bytes,
        start: int,
        end: int,
    ) -> GlobalChunk:
        """Parse and verify a chunk blob; raises :class:`LayoutError` for anything unexpected."""
        head, rows = _decode(layout, data, CHUNK_MAGIC)
        if head.namespace_digest != namespace_digest:
            raise LayoutError("wrong_namespace")
        if (head.start, head.end) != (start, end) or head.chunk_size != layout.chunk_size:
            raise LayoutError(
                "wrong_range",
                f"blob covers [{head.start}, {head.end}) of chunk size {head.chunk_size}, "
                f"expected [{start}, {end}) of {layout.chunk_size}",
            )
        if bool(head.flags & _FLAG_TAIL) != (end - start != layout.chunk_size):
            raise LayoutError("bad_flags")
        by_layer: dict[int, dict[int, tuple[int, torch.Tensor]]] = {}
        for layer, kind, first, tensor in rows:
            slot = by_layer.setdefault(layer, {})
            if kind in slot:
                raise LayoutError("duplicate_section", f"layer {layer} {_KIND_NAMES[kind]}")
            slot[kind] = (first, tensor)
        sources = []
        for s in layout.spec.sources:
            got = by_layer.get(s, {})
            if ENTRIES not in got:
                raise LayoutError("missing_section", f"layer {s} entries")
            first, entries = got[ENTRIES]
            index = got.get(INDEX_KEYS)
            if index is not None and index[0] != first:
                raise LayoutError("bad_section", f"layer {s}: index keys start at another group")
            sources.append(SourceGroups(s, first, entries, None if index is None else index[1]))
        chunk = cls(
            start=head.start,
            end=head.end,
            chunk_size=head.chunk_size,
            sources=tuple(sources),
            carry=_carry_from_sections(layout, by_layer),
            namespace_digest=head.namespace_digest,
            created_at=head.created_at,
        )
        unknown = set(by_layer) - set(layout.spec.sources)
        if unknown:
            raise LayoutError("bad_section", f"sections for non-source layers {sorted(unknown)}")
        _check_chunk_shapes(layout, chunk)
        return chunk


@dataclass(frozen=True)
class WindowSnapshot:
    """Everything per-request needed to continue at ``end`` (= H) besides the global KV.

    window: per layer, the entries of positions ``[end − rows, end)`` in order, rows = min(end, W)
    ([rows, D] each, all layers, Reuse/decoder layers included). carry: every source's carry rows.
    """

    end: int
    window: tuple[torch.Tensor, ...]
    carry: tuple[CarryRows, ...]
    namespace_digest: bytes = bytes(KEY_BYTES)
    created_at: float = 0.0

    def verify(self, layout: CacheLayout, *, namespace_digest: bytes, end: int) -> None:
        if self.namespace_digest != namespace_digest:
            raise LayoutError("wrong_namespace")
        if self.end != end:
            raise LayoutError("wrong_range", f"snapshot at {self.end}, expected {end}")
        _check_snapshot_shapes(layout, self)

    def to_bytes(self, layout: CacheLayout) -> bytes:
        sections: list[tuple[int, int, int, torch.Tensor]] = [
            (i, WINDOW, self.end - int(w.shape[0]), w) for i, w in enumerate(self.window)
        ]
        sections += _carry_sections(self.carry)
        return _encode(
            layout, SNAPSHOT_MAGIC, 0, layout.chunk_size, self.end, self.end, self.created_at,
            self.namespace_digest, sections,
        )  # fmt: skip

    @classmethod
    def from_bytes(
        cls, layout: CacheLayout, data: bytes | bytearray | memoryview, *, namespace_digest: bytes, end: int
    ) -> WindowSnapshot:
        head, rows = _decode(layout, data, SNAPSHOT_MAGIC)
        if head.namespace_digest != namespace_digest:
            raise LayoutError("wrong_namespace")
        if head.end != end or head.start != end:
            raise LayoutError("wrong_range", f"snapshot at {head.end}, expected {end}")
        by_layer: dict[int, dict[int, tuple[int, torch.Tensor]]] = {}
        for layer, kind, first, tensor in rows:
            slot = by_layer.setdefault(layer, {})
            if kind in slot:
                raise LayoutError("duplicate_section", f"layer {layer} {_KIND_NAMES[kind]}")
            slot[kind] = (first, tensor)
        window = []
        for i in range(len(layout.spec.layers)):
            got = by_layer.get(i, {})
            if WINDOW not in got:
                raise LayoutError("missing_section", f"layer {i} window")
            first, tensor = got[WINDOW]
            if first != end - int(tensor.shape[0]):
                raise LayoutError("bad_section", f"layer {i}: window rows do not end at {end}")
            window.append(tensor)
        snap = cls(
            end=end,
            window=tuple(window),
            carry=_carry_from_sections(layout, by_layer),
            namespace_digest=head.namespace_digest,
            created_at=head.created_at,
        )
        _check_snapshot_shapes(layout, snap)
        return snap


# ------------------------------------------------------------------------------------------------
# Extraction and loading
# ------------------------------------------------------------------------------------------------


def _row_position(view: CacheView, row: int) -> int:
    if not 0 <= row < view.batch_size:
        raise IndexError(f"row {row} is outside the view's {view.batch_size} rows")
    return int(view.positions[row])


def _ordered(ring: torch.Tensor, row: int, first: int, end: int) -> torch.Tensor:
    """Rows of positions [first, end) of a ring (slot = position % R), in order, cloned."""
    slots = torch.arange(first, end, device=ring.device).remainder(ring.shape[1])
    return ring[row].index_select(0, slots).clone()


def _extract_carry(layout: CacheLayout, view: CacheView, row: int, end: int) -> tuple[CarryRows, ...]:
    out = []
    for s in layout.spec.sources:
        lv = view.layers[s]
        n = layout.carry_rows(s, end)
        ni = layout.carry_rows(s, end, index=True)
        if lv.carry is None and lv.index_carry is None:
            continue
        empty = torch.zeros(0, 0)
        kv = _ordered(lv.carry.kv, row, end - n, end) if lv.carry is not None else empty
        gate = _ordered(lv.carry.gate, row, end - n, end) if lv.carry is not None else empty
        ikv = igate = None
        if lv.index_carry is not None:
            ikv = _ordered(lv.index_carry.kv, row, end - ni, end)
            igate = _ordered(lv.index_carry.gate, row, end - ni, end)
        out.append(CarryRows(s, end - n, kv, gate, end - ni, ikv, igate))
    return tuple(out)


def _extract_groups(
    layout: CacheLayout, view: CacheView, row: int, start: int, end: int
) -> tuple[SourceGroups, ...]:
    out = []
    for s in layout.spec.sources:
        lv = view.layers[s]
        r = layout.spec.layers[s].ratio
        g0, g1 = start // r, end // r
        if lv.entries is None:
            raise ValueError(f"layer {s} is a KV source but the view has no entries for it")
        if g1 > lv.entries.shape[1]:
            raise ValueError(f"layer {s}: the view holds {lv.entries.shape[1]} entries, {g1} needed")
        entries = lv.entries[row, g0:g1].clone()
        index = lv.index_keys[row, g0:g1].clone() if lv.index_keys is not None else None
        out.append(SourceGroups(s, g0, entries, index))
    return tuple(out)


def extract_chunk(
    layout: CacheLayout,
    view: CacheView,
    row: int,
    index: int,
    namespace_digest: bytes,
    created_at: float = 0.0,
) -> GlobalChunk:
    """Full chunk ``index`` (tokens ``[index·C, (index+1)·C)``) of a row that has processed them."""
    c = layout.chunk_size
    start, end = index * c, (index + 1) * c
    if index < 0 or _row_position(view, row) < end:
        raise ValueError(f"chunk {index} ends at {end}; row {row} is at position {int(view.positions[row])}")
    return GlobalChunk(
        start, end, c, _extract_groups(layout, view, row, start, end), (), namespace_digest, created_at
    )


def extract_tail(
    layout: CacheLayout, view: CacheView, row: int, namespace_digest: bytes, created_at: float = 0.0
) -> GlobalChunk:
    """Tail at the row's position H: complete groups in ``[⌊H/C⌋·C, H)`` plus the carry at H.

    Only valid at the row's current position (the carry rings hold the latest rows only).
    """
    end = _row_position(view, row)
    c = layout.chunk_size
    start = end // c * c
    return GlobalChunk(
        start,
        end,
        c,
        _extract_groups(layout, view, row, start, end),
        _extract_carry(layout, view, row, end),
        namespace_digest,
        created_at,
    )


def extract_snapshot(
    layout: CacheLayout, view: CacheView, row: int, namespace_digest: bytes, created_at: float = 0.0
) -> WindowSnapshot:
    """The row's window entries for ``[H − W, H)`` (every layer) and carry, at its position H."""
    end = _row_position(view, row)
    window = tuple(
        _ordered(view.layers[i].window, row, end - min(end, ls.window), end)
        for i, ls in enumerate(layout.spec.layers)
    )
    return WindowSnapshot(end, window, _extract_carry(layout, view, row, end), namespace_digest, created_at)


def _write_ring(ring: torch.Tensor, row: int, first: int, values: torch.Tensor) -> None:
    if values.shape[0] > ring.shape[1]:
        raise ValueError(f"{values.shape[0]} rows do not fit a ring of {ring.shape[1]}")
    slots = torch.arange(first, first + values.shape[0], device=ring.device).remainder(ring.shape[1])
    ring[row].index_copy_(0, slots, values.to(device=ring.device, dtype=ring.dtype))


def _load_carry(layout: CacheLayout, carry: Iterable[CarryRows], view: CacheView, row: int) -> None:
    for cr in carry:
        lv = view.layers[cr.layer]
        pairs: list[tuple[CompressorCarry | None, int, torch.Tensor | None, torch.Tensor | None]] = [
            (lv.carry, cr.first, cr.kv, cr.gate),
            (lv.index_carry, cr.index_first, cr.index_kv, cr.index_gate),
        ]
        for target, first, kv, gate in pairs:
            if target is None or kv is None or gate is None:
                continue
            # Rows outside [first, end) are never read; clear them so a reused row holds nothing stale.
            target.kv[row].zero_()
            target.gate[row].zero_()
            _write_ring(target.kv, row, first, kv)
            _write_ring(target.gate, row, first, gate)


def load_chunk(layout: CacheLayout, chunk: GlobalChunk, view: CacheView, row: int) -> None:
    """Write a chunk's (or tail's) groups and carry into ``row`` of ``view``; positions untouched."""
    _check_chunk_shapes(layout, chunk)
    if not 0 <= row < view.batch_size:
        raise IndexError(f"row {row} is outside the view's {view.batch_size} rows")
    for sg in chunk.sources:
        lv = view.layers[sg.layer]
        assert lv.entries is not None
        g1 = sg.first_group + sg.count
        if g1 > lv.entries.shape[1]:
            raise ValueError(
                f"layer {sg.layer}: the view holds {lv.entries.shape[1]} entries but the chunk reaches group "
                f"{g1}; allocate the view for at least {chunk.end} tokens"
            )
        lv.entries[row, sg.first_group : g1] = sg.entries.to(device=lv.entries.device, dtype=lv.entries.dtype)
        if sg.index_keys is not None and lv.index_keys is not None:
            lv.index_keys[row, sg.first_group : g1] = sg.index_keys.to(
                device=lv.index_keys.device, dtype=lv.index_keys.dtype
            )
    _load_carry(layout, chunk.carry, view, row)


def load_snapshot(layout: CacheLayout, snapshot: WindowSnapshot, view: CacheView, row: int) -> None:
    """Write a snapshot's window entries and carry into ``row`` of ``view``; positions untouched."""
    _check_snapshot_shapes(layout, snapshot)
    if not 0 <= row < view.batch_size:
        raise IndexError(f"row {row} is outside the view's {view.batch_size} rows")
    for i, entries in enumerate(snapshot.window):
        ring = view.layers[i].window
        ring[row].zero_()
        _write_ring(ring, row, snapshot.end - int(entries.shape[0]), entries)
    _load_carry(layout, snapshot.carry, view, row)


# ------------------------------------------------------------------------------------------------
# Shape checks (what a loaded object must look like for this layout)
# ------------------------------------------------------------------------------------------------


def _check_2d(t: torch.Tensor, rows: int, dim: int, what: str) -> None:
    if t.dim() != 2 or tuple(t.shape) != (rows, dim):
        raise LayoutError("bad_shape", f"{what}: shape {tuple(t.shape)}, expected ({rows}, {dim})")


def _check_carry(layout: CacheLayout, carry: tuple[CarryRows, ...], end: int) -> None:
    want = [
        s
        for s in layout.spec.sources
        if layout.spec.layers[s].carry_ring or layout.spec.layers[s].index_carry_ring
    ]
    if [c.layer for c in carry] != want:
        raise LayoutError("bad_carry", f"carry for layers {[c.layer for c in carry]}, expected {want}")
    for cr in carry:
        ls = layout.spec.layers[cr.layer]
        n = layout.carry_rows(cr.layer, end)
        if ls.carry_ring:
            if cr.first != end - n:
                raise LayoutError("bad_carry", f"layer {cr.layer}: carry starts at {cr.first}, not {end - n}")
            _check_2d(cr.kv, n, ls.carry_width, f"layer {cr.layer} carry kv")
            _check_2d(cr.gate, n, ls.carry_width, f"layer {cr.layer} carry gate")
        if ls.index_carry_ring:
            ni = layout.carry_rows(cr.layer, end, index=True)
            if cr.index_kv is None or cr.index_gate is None or cr.index_first != end - ni:
                raise LayoutError("bad_carry", f"layer {cr.layer}: index carry missing or misplaced")
            _check_2d(cr.index_kv, ni, ls.index_carry_width, f"layer {cr.layer} index carry kv")
            _check_2d(cr.index_gate, ni, ls.index_carry_width, f"layer {cr.layer} index carry gate")
        elif cr.index_kv is not None:
            raise LayoutError("bad_carry", f"layer {cr.layer} has no index compressor")


def _check_chunk_shapes(layout: CacheLayout, chunk: GlobalChunk) -> None:
    c = layout.chunk_size
    if chunk.start % c or not chunk.start <= chunk.end <= chunk.start + c:
        raise LayoutError("wrong_range", f"[{chunk.start}, {chunk.end}) is not inside one chunk of {c}")
    spec = layout.spec
    if [sg.layer for sg in chunk.sources] != list(spec.sources):
        raise LayoutError(
            "bad_section", f"sources {[sg.layer for sg in chunk.sources]}, expected {spec.sources}"
        )
    for sg in chunk.sources:
        ls = spec.layers[sg.layer]
        g0, g1 = chunk.start // ls.ratio, chunk.end // ls.ratio
        if sg.first_group != g0:
            raise LayoutError("bad_section", f"layer {sg.layer}: first group {sg.first_group}, expected {g0}")
        _check_2d(sg.entries, g1 - g0, ls.head_dim, f"layer {sg.layer} entries")
        if ls.index_dim:
            if sg.index_keys is None:
                raise LayoutError("missing_section", f"layer {sg.layer} index keys")
            _check_2d(sg.index_keys, g1 - g0, ls.index_dim, f"layer {sg.layer} index keys")
        elif sg.index_keys is not None:
            raise LayoutError("bad_section", f"layer {sg.layer} has no indexer")
    if chunk.is_tail:
        _check_carry(layout, chunk.carry, chunk.end)
    elif chunk.carry:
        raise LayoutError("bad_carry", "a full chunk carries no compressor rows")


def _check_snapshot_shapes(layout: CacheLayout, snap: WindowSnapshot) -> None:
    spec = layout.spec
    if len(snap.window) != len(spec.layers):
        raise LayoutError(
            "missing_section", f"{len(snap.window)} window sections for {len(spec.layers)} layers"
        )
    for i, (ls, w) in enumerate(zip(spec.layers, snap.window, strict=True)):
        _check_2d(w, min(snap.end, ls.window), ls.head_dim, f"layer {i} window")
    _check_carry(layout, snap.carry, snap.end)


# ------------------------------------------------------------------------------------------------
# Byte encoding
# ------------------------------------------------------------------------------------------------


def _carry_sections(carry: Iterable[CarryRows]) -> list[tuple[int, int, int, torch.Tensor]]:
    out: list[tuple[int, int, int, torch.Tensor]] = []
    for cr in carry:
        if cr.kv.numel() or cr.kv.shape[-1]:
            out.append((cr.layer, CARRY_KV, cr.first, cr.kv))
            out.append((cr.layer, CARRY_GATE, cr.first, cr.gate))
        if cr.index_kv is not None and cr.index_gate is not None:
            out.append((cr.layer, INDEX_CARRY_KV, cr.index_first, cr.index_kv))
            out.append((cr.layer, INDEX_CARRY_GATE, cr.index_first, cr.index_gate))
    return out


def _carry_from_sections(
    layout: CacheLayout, by_layer: dict[int, dict[int, tuple[int, torch.Tensor]]]
) -> tuple[CarryRows, ...]:
    out = []
    for s in layout.spec.sources:
        got = by_layer.get(s, {})
        if not any(k in got for k in (CARRY_KV, CARRY_GATE, INDEX_CARRY_KV, INDEX_CARRY_GATE)):
            continue
        ls = layout.spec.layers[s]
        if ls.carry_ring and (CARRY_KV not in got or CARRY_GATE not in got):
            raise LayoutError("missing_section", f"layer {s} carry")
        empty = (0, torch.zeros(0, 0))
        first, kv = got.get(CARRY_KV, empty)
        gfirst, gate = got.get(CARRY_GATE, empty)
        ifirst, igfirst, ikv, igate = 0, 0, None, None
        if INDEX_CARRY_KV in got:
            ifirst, ikv = got[INDEX_CARRY_KV]
        if INDEX_CARRY_GATE in got:
            igfirst, igate = got[INDEX_CARRY_GATE]
        if gfirst != first or igfirst != ifirst or (ikv is None) != (igate is None):
            raise LayoutError("bad_carry", f"layer {s}: kv and gate rows disagree")
        out.append(CarryRows(s, first, kv, gate, ifirst, ikv, igate))
    return tuple(out)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())


def _encode_section(layout: CacheLayout, kind: int, t: torch.Tensor) -> tuple[int, bytes]:
    """(encoding, bytes) of one [rows, dim] section: packed when lossless, raw otherwise."""
    packed_code = layout.encoding_for(kind)
    if packed_code is not None and t.shape[0] and t.is_floating_point():
        fmt = _PACKED[packed_code]
        dim = int(t.shape[-1])
        if dim % fmt.block == 0:
            src = t.detach().to(torch.float32)
            packed = fmt.pack(src)
            back = fmt.unpack(packed, dim)
            if torch.equal(back.view(torch.int32), src.contiguous().view(torch.int32)):
                return packed_code, _tensor_bytes(packed)
    if kind in (CARRY_KV, CARRY_GATE, INDEX_CARRY_KV, INDEX_CARRY_GATE):
        t = t.to(torch.float32)
    return _raw_code(t.dtype), _tensor_bytes(t)


def _encode(
    layout: CacheLayout,
    magic: bytes,
    flags: int,
    chunk_size: int,
    start: int,
    end: int,
    created_at: float,
    namespace_digest: bytes,
    sections: list[tuple[int, int, int, torch.Tensor]],
) -> bytes:
    if len(namespace_digest) != KEY_BYTES:
        raise ValueError(f"namespace digest must be {KEY_BYTES} bytes (KeyNamespace.seed())")
    table, blobs = [], []
    for layer, kind, first, tensor in sections:
        encoding, blob = _encode_section(layout, kind, tensor)
        rows, dim = (int(tensor.shape[0]), int(tensor.shape[1])) if tensor.dim() == 2 else (0, 0)
        table.append(SECTION.pack(layer, kind, encoding, rows, dim, first, len(blob)))
        blobs.append(blob)
    table_bytes, data = b"".join(table), b"".join(blobs)
    head = CHUNK_HEADER.pack(
        magic, LAYOUT_VERSION, flags, chunk_size, start, end, len(data), created_at,
        namespace_digest, len(sections), 0,
    )[:_CRC_OFFSET]  # fmt: skip
    crc = zlib.crc32(data, zlib.crc32(table_bytes, zlib.crc32(head)))
    return b"".join((head, struct.pack("<I", crc), table_bytes, data))


@dataclass(frozen=True)
class _Head:
    flags: int
    chunk_size: int
    start: int
    end: int
    created_at: float
    namespace_digest: bytes


def _decode(
    layout: CacheLayout, data: bytes | bytearray | memoryview, magic: bytes
) -> tuple[_Head, list[tuple[int, int, int, torch.Tensor]]]:
    view = memoryview(data).cast("B")
    if view.nbytes < CHUNK_HEADER.size:
        raise LayoutError("truncated", f"{view.nbytes} bytes, header needs {CHUNK_HEADER.size}")
    got_magic, version, flags, chunk_size, start, end, data_len, created_at, digest, n_sections, crc = (
        CHUNK_HEADER.unpack_from(view)
    )
    if got_magic != magic:
        raise LayoutError("bad_magic")
    if version != LAYOUT_VERSION:
        raise LayoutError("wrong_version", f"layout version {version}, this build reads {LAYOUT_VERSION}")
    table_end = CHUNK_HEADER.size + n_sections * SECTION.size
    if view.nbytes != table_end + data_len:
        raise LayoutError("bad_length", f"{view.nbytes} bytes, header says {table_end + data_len}")
    check = zlib.crc32(
        view[table_end:], zlib.crc32(view[CHUNK_HEADER.size : table_end], zlib.crc32(view[:_CRC_OFFSET]))
    )
    if check != crc:
        raise LayoutError("bad_crc")
    rows_out: list[tuple[int, int, int, torch.Tensor]] = []
    offset = table_end
    spec = layout.spec
    for i in range(n_sections):
        layer, kind, encoding, rows, dim, first, nbytes = SECTION.unpack_from(
            view, CHUNK_HEADER.size + i * SECTION.size
        )
        if layer >= len(spec.layers) or kind >= len(_KIND_NAMES):
            raise LayoutError("bad_section", f"section {i}: layer {layer} kind {kind}")
        if encoding in _PACKED and _PACKED_FOR_KIND.get(kind) != encoding:
            raise LayoutError("bad_encoding", f"section {i}: encoding {encoding} for {_KIND_NAMES[kind]}")
        try:
            expected = layout._section_bytes(encoding, rows, dim)
        except ValueError as exc:  # a packed dim that is not a multiple of the block
            raise LayoutError("bad_section", f"section {i}: {exc}") from None
        if nbytes != expected or offset + nbytes > view.nbytes:
            raise LayoutError("bad_section", f"section {i}: {nbytes} bytes for {rows} x {dim}")
        raw = (
            torch.frombuffer(bytearray(view[offset : offset + nbytes]), dtype=torch.uint8)
            if nbytes
            else (torch.zeros(0, dtype=torch.uint8))
        )
        offset += nbytes
        if encoding in _PACKED:
            fmt = _PACKED[encoding]
            tensor = fmt.unpack(raw.view(rows, fmt.bytes_per_entry(dim)), dim)
        else:
            tensor = raw.view(_RAW_DTYPES[encoding]).reshape(rows, dim)
        rows_out.append((layer, kind, first, tensor))
    if offset != view.nbytes:
        raise LayoutError("bad_length", "section sizes do not add up to the data length")
    return _Head(flags, chunk_size, start, end, created_at, bytes(digest)), rows_out
