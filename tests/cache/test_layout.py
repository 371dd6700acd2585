"""cache/layout.py: byte round trips, verification, sizes against accounting, exact continuation.

The exact-continuation tests run a real model: prefill [0, H), extract the chunks, the tail and
the snapshot, serialise them, load them into a fresh view and continue [H, end) (a prefill and a
few decode steps). The result must equal the same calls on the original view bit for bit, and a
one-shot prefill of [0, end) to float tolerance (the model's blocked attention sums in another
order when a prefill is split, so a split run is not bitwise a one-shot run even without caching).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from replaykv.cache.layout import (
    CHUNK_HEADER,
    LAYOUT_VERSION,
    SECTION,
    CacheLayout,
    GlobalChunk,
    LayoutError,
    WindowSnapshot,
    extract_chunk,
    extract_snapshot,
    extract_tail,
    load_chunk,
    load_snapshot,
)
from replaykv.cache.views import advance, allocate_view
from replaykv.model.accounting import kv_ledger
from replaykv.model.cache_view import CacheView
from replaykv.model.config import CSA, HCA
from replaykv.model.init import init_weights
from replaykv.model.presets import v4_tiny
from replaykv.model.presets_v41 import v41_tiny
from replaykv.model.quant import FP4_COMPRESSED_ENTRY, FP8_WINDOW_ENTRY, MXFP4_INDEX_KEY
from replaykv.model.spec import ModelSpec
from replaykv.model.v4 import DeepseekV4ForCausalLM
from replaykv.model.v41 import DeepseekV41ForCausalLM

DIGEST = bytes(range(32))


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Tiny models gain nothing from threads, and on a shared 2-core runner OpenMP spin-waits make
    a 2-thread forward many times slower; restore the setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def v4_small() -> Any:
    """v4_tiny with a window of 8 and ratios 4 (CSA) / 8 (HCA), so chunks of 16 work."""
    return v4_tiny().replace(sliding_window=8, compress_rates={CSA: 4, HCA: 8})


# ------------------------------------------------------------------------------------------------
# A deterministic stand-in for a model: fills a row exactly where a model would write, with values
# that depend only on the token prefix. Shared with test_manager.py.
# ------------------------------------------------------------------------------------------------


def _prefix_hashes(tokens: list[int]) -> list[int]:
    out, h = [], 7
    for t in tokens:
        h = (h * 1_000_003 + int(t) + 1) % (1 << 61)
        out.append(h)
    return out


_QUANT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "window": FP8_WINDOW_ENTRY.fake_quant,
    "entry": FP4_COMPRESSED_ENTRY.fake_quant,
    "index": MXFP4_INDEX_KEY.fake_quant,
}


@functools.lru_cache(maxsize=1 << 16)
def _vec(h: int, salt: int, dim: int, quant: str | None) -> torch.Tensor:
    gen = torch.Generator().manual_seed((h * 131 + salt) % (1 << 62))
    v = torch.randn(dim, generator=gen)
    return _QUANT[quant](v[None])[0] if quant is not None else v


def fake_fill(
    spec: ModelSpec,
    view: CacheView,
    row: int,
    tokens: list[int],
    start: int,
    end: int,
    *,
    quant: bool = False,
) -> None:
    """Write what a model would for positions [start, end) of ``tokens`` (row must be at ``start``)."""
    hashes = _prefix_hashes(tokens[:end])
    wq, eq, iq = ("window", "entry", "index") if quant else (None, None, None)
    for p in range(start, end):
        for i, ls in enumerate(spec.layers):
            lv = view.layers[i]
            lv.window[row, p % ls.window] = _vec(hashes[p], i, ls.head_dim, wq)
            if not ls.owns_compressor:
                continue
            for carry, off in ((lv.carry, 100), (lv.index_carry, 200)):
                if carry is not None:
                    carry.kv[row, p % carry.ring] = _vec(hashes[p], off + i, carry.kv.shape[-1], None)
                    carry.gate[row, p % carry.ring] = _vec(
                        hashes[p], off + 50 + i, carry.gate.shape[-1], None
                    )
            if (p + 1) % ls.ratio == 0:
                g = p // ls.ratio
                assert lv.entries is not None
                lv.entries[row, g] = _vec(hashes[p], 300 + i, ls.head_dim, eq)
                if lv.index_keys is not None:
                    lv.index_keys[row, g] = _vec(hashes[p], 400 + i, ls.index_dim, iq)


def fake_view(spec: ModelSpec, tokens: list[int], capacity: int, *, quant: bool = False) -> CacheView:
    view = allocate_view(spec, 1, capacity)
    fake_fill(spec, view, 0, tokens, 0, len(tokens), quant=quant)
    advance(view, len(tokens))
    return view


def round_trip(
    layout: CacheLayout, view: CacheView, row: int = 0
) -> tuple[list[GlobalChunk], GlobalChunk, WindowSnapshot]:
    """Extract → bytes → objects for every full chunk, the tail and the snapshot at the row's position."""
    h, c = int(view.positions[row]), layout.chunk_size
    chunks = [
        GlobalChunk.from_bytes(
            layout,
            extract_chunk(layout, view, row, i, DIGEST).to_bytes(layout),
            namespace_digest=DIGEST,
            start=i * c,
            end=(i + 1) * c,
        )
        for i in range(h // c)
    ]
    tail = GlobalChunk.from_bytes(
        layout, extract_tail(layout, view, row, DIGEST).to_bytes(layout), namespace_digest=DIGEST,
        start=h // c * c, end=h,
    )  # fmt: skip
    snap = WindowSnapshot.from_bytes(
        layout, extract_snapshot(layout, view, row, DIGEST).to_bytes(layout), namespace_digest=DIGEST, end=h
    )
    return chunks, tail, snap


def load_all(
    layout: CacheLayout, view: CacheView, objs: tuple[list[GlobalChunk], GlobalChunk, WindowSnapshot]
) -> None:
    chunks, tail, snap = objs
    for chunk in chunks:
        load_chunk(layout, chunk, view, 0)
    load_chunk(layout, tail, view, 0)
    load_snapshot(layout, snap, view, 0)
    view.positions[0] = snap.end


def assert_same_state(layout: CacheLayout, a: CacheView, b: CacheView) -> None:
    """Global KV of [0, H), window entries of [H − W, H) and the carry needed at H are equal."""
    h = int(a.positions[0])
    assert h == int(b.positions[0])
    for s in layout.spec.sources:
        r = layout.spec.layers[s].ratio
        la, lb = a.layers[s], b.layers[s]
        assert la.entries is not None and lb.entries is not None
        assert torch.equal(la.entries[0, : h // r], lb.entries[0, : h // r])
        if la.index_keys is not None and lb.index_keys is not None:
            assert torch.equal(la.index_keys[0, : h // r], lb.index_keys[0, : h // r])
    sa, sb = extract_snapshot(layout, a, 0, DIGEST), extract_snapshot(layout, b, 0, DIGEST)
    for wa, wb in zip(sa.window, sb.window, strict=True):
        assert torch.equal(wa, wb)
    for ca, cb in zip(sa.carry, sb.carry, strict=True):
        assert torch.equal(ca.kv, cb.kv) and torch.equal(ca.gate, cb.gate)
        if ca.index_kv is not None:
            assert cb.index_kv is not None and torch.equal(ca.index_kv, cb.index_kv)


# ------------------------------------------------------------------------------------------------
# Exact continuation with real models
# ------------------------------------------------------------------------------------------------


@functools.cache
def _build(kind: str, quant: bool = False) -> tuple[Any, ModelSpec, int]:
    if kind == "v4":
        config: Any = v4_small()
        model = DeepseekV4ForCausalLM(config)
        chunk = 16
    else:
        config = v41_tiny().replace(kv_quant=quant)
        model = DeepseekV41ForCausalLM(config)
        chunk = 8
    init_weights(model, seed=3)
    model.eval()
    return model, ModelSpec.from_config(config), chunk


@pytest.mark.parametrize("kind", ["v4", "v41"])
@pytest.mark.parametrize("cut", [1, 5, 16, 37])
def test_exact_continuation(kind: str, cut: int) -> None:
    """prefill [0, H) → extract → bytes → fresh view → load → continue == never stopped, bitwise."""
    model, spec, chunk = _build(kind)
    layout = CacheLayout(spec, chunk_size=chunk)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, 52), generator=torch.Generator().manual_seed(cut))
    with torch.no_grad():
        original = allocate_view(spec, 1, 64)
        model(ids[:, :cut], original)
        advance(original, cut)
        objs = round_trip(layout, original)
        resumed = allocate_view(spec, 1, 64)
        load_all(layout, resumed, objs)
        assert_same_state(layout, original, resumed)
        outs = []
        for view in (original, resumed):
            step = [model(ids[:, cut:48], view)]
            advance(view, 48 - cut)
            for t in range(48, 52):  # decode
                step.append(model(ids[:, t : t + 1], view))
                advance(view, 1)
            outs.append(torch.cat(step, dim=1))
        assert torch.equal(outs[0], outs[1])
        one_shot = model(ids, allocate_view(spec, 1, 64))[:, cut:]
        torch.testing.assert_close(outs[1], one_shot, rtol=1e-4, atol=1e-4)


def test_exact_continuation_v4_tiny_real_window() -> None:
    """The real v4_tiny shape (window 128, ratios 4 / 128), odd cut inside the second chunk."""
    config = v4_tiny()
    model = DeepseekV4ForCausalLM(config)
    init_weights(model, seed=1)
    model.eval()
    spec = ModelSpec.from_config(config)
    layout = CacheLayout(spec, chunk_size=128)
    ids = torch.randint(0, config.vocab_size, (1, 150), generator=torch.Generator().manual_seed(0))
    cut = 131
    with torch.no_grad():
        original = allocate_view(spec, 1, 256)
        model(ids[:, :cut], original)
        advance(original, cut)
        resumed = allocate_view(spec, 1, 256)
        load_all(layout, resumed, round_trip(layout, original))
        a = model(ids[:, cut:], original)
        b = model(ids[:, cut:], resumed)
    assert torch.equal(a, b)


@pytest.mark.parametrize("cut", [7, 24])
def test_exact_continuation_v41_quantised(cut: int) -> None:
    """Quantisers on: sections are packed (FP4 / MXFP4 / FP8) and continuation stays bitwise."""
    model, spec, chunk = _build("v41", quant=True)
    layout = CacheLayout(spec, chunk_size=chunk, kv_quant=True)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(cut))
    with torch.no_grad():
        original = allocate_view(spec, 1, 64)
        model(ids[:, :cut], original)
        advance(original, cut)
        resumed = allocate_view(spec, 1, 64)
        load_all(layout, resumed, round_trip(layout, original))
        assert torch.equal(model(ids[:, cut:], original), model(ids[:, cut:], resumed))


# ------------------------------------------------------------------------------------------------
# Round trips with the fake filler (both presets, every kind of cut)
# ------------------------------------------------------------------------------------------------


SPECS = {
    "v41": lambda: ModelSpec.from_config(v41_tiny()),
    "v4": lambda: ModelSpec.from_config(v4_small()),
}


@pytest.mark.parametrize("kind", ["v41", "v4"])
@pytest.mark.parametrize("cut", [0, 1, 2, 3, 8, 15, 16, 17, 33, 40])
def test_round_trip_fake(kind: str, cut: int) -> None:
    spec = SPECS[kind]()
    layout = CacheLayout(spec, chunk_size=8 if kind == "v41" else 16)
    tokens = list(range(5, 5 + cut))
    original = fake_view(spec, tokens, 48)
    resumed = allocate_view(spec, 1, 48)
    resumed.layers[0].window.fill_(9.0)  # stale data in a reused row must not matter
    load_all(layout, resumed, round_trip(layout, original))
    assert_same_state(layout, original, resumed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_round_trip_narrow_dtypes(dtype: torch.dtype) -> None:
    spec = SPECS["v41"]()
    layout = CacheLayout(spec, chunk_size=8, dtype=dtype)
    original = allocate_view(spec, 1, 32, dtype=dtype)
    fake_fill(spec, original, 0, list(range(21)), 0, 21)
    advance(original, 21)
    resumed = allocate_view(spec, 1, 32, dtype=dtype)
    load_all(layout, resumed, round_trip(layout, original))
    assert_same_state(layout, original, resumed)
    assert "raw_" + str(dtype).removeprefix("torch.") in layout.kv_dtypes


def test_quantised_sections_are_packed_and_sizes_match_accounting() -> None:
    config = v41_tiny()
    spec = ModelSpec.from_config(config)
    ledger = kv_ledger(config)
    layout = CacheLayout(spec, chunk_size=8, kv_quant=True)
    assert layout.packed
    assert layout.page_bytes == ledger.global_bytes(8)
    assert layout.global_bytes(1000) == ledger.global_bytes(1000)
    for cut in (9, 16, 21):  # odd cuts have one pending row per ratio-2 source
        view = fake_view(spec, list(range(cut)), 32, quant=True)
        chunk = extract_chunk(layout, view, 0, 0, DIGEST).to_bytes(layout)
        n_sections = 2 * len(spec.sources)
        assert len(chunk) == CHUNK_HEADER.size + n_sections * SECTION.size + ledger.global_bytes(8)
        snap_bytes = extract_snapshot(layout, view, 0, DIGEST).to_bytes(layout)
        n_snap = len(spec.layers) + 2 * sum(1 for s in spec.sources if spec.layers[s].carry_ring)
        data = len(snap_bytes) - CHUNK_HEADER.size - n_snap * SECTION.size
        assert data == layout.snapshot_bytes(cut)
        assert layout.window_bytes(cut) == ledger.window_state_bytes()
        assert layout.carry_bytes(cut) <= ledger.compressor_tail_bytes()
        if cut % 2:
            assert layout.carry_bytes(cut) == ledger.compressor_tail_bytes()
        assert layout.max_snapshot_bytes == ledger.snapshot_bytes()
        resumed = allocate_view(spec, 1, 32)
        load_all(layout, resumed, round_trip(layout, view))
        assert_same_state(layout, view, resumed)


def test_v4_carry_never_exceeds_accounting() -> None:
    config = v4_small()
    layout = CacheLayout(ModelSpec.from_config(config), chunk_size=16)
    ledger = kv_ledger(config)
    assert not layout.packed
    assert 0 < max(layout.carry_bytes(h) for h in range(64)) <= ledger.compressor_tail_bytes()


def test_off_grid_values_fall_back_to_raw_sections() -> None:
    """kv_quant on but values not on the grid (or an FP4 block that does not re-pack): stored raw, exact."""
    spec = SPECS["v41"]()
    layout = CacheLayout(spec, chunk_size=8, kv_quant=True)
    view = fake_view(spec, list(range(13)), 32, quant=False)
    blob = extract_chunk(layout, view, 0, 0, DIGEST).to_bytes(layout)
    packed_size = CHUNK_HEADER.size + 2 * len(spec.sources) * SECTION.size + layout.page_bytes
    assert len(blob) > packed_size  # raw float32
    resumed = allocate_view(spec, 1, 32)
    load_all(layout, resumed, round_trip(layout, view))
    assert_same_state(layout, view, resumed)


# ------------------------------------------------------------------------------------------------
# Verification
# ------------------------------------------------------------------------------------------------


def _blob() -> tuple[CacheLayout, bytes]:
    spec = SPECS["v41"]()
    layout = CacheLayout(spec, chunk_size=8)
    view = fake_view(spec, list(range(11)), 32)
    return layout, extract_tail(layout, view, 0, DIGEST).to_bytes(layout)


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda b: b[:-1], "bad_length"),
        (lambda b: b[:50], "truncated"),
        (lambda b: b[:-3] + bytes([b[-3] ^ 1]) + b[-2:], "bad_crc"),
        (lambda b: b[:100] + bytes([b[100] ^ 0x10]) + b[101:], "bad_crc"),
        (lambda b: bytes(len(b)), "bad_magic"),
        (lambda b: b[:8] + (LAYOUT_VERSION + 1).to_bytes(2, "little") + b[10:], "wrong_version"),
    ],
)
def test_corrupt_blobs_are_refused(mutate: Callable[[bytes], bytes], reason: str) -> None:
    layout, blob = _blob()
    with pytest.raises(LayoutError) as info:
        GlobalChunk.from_bytes(layout, mutate(blob), namespace_digest=DIGEST, start=8, end=11)
    assert info.value.reason == reason


def test_wrong_namespace_range_or_kind_is_refused() -> None:
    layout, blob = _blob()
    with pytest.raises(LayoutError, match="wrong_namespace"):
        GlobalChunk.from_bytes(layout, blob, namespace_digest=bytes(32), start=8, end=11)
    with pytest.raises(LayoutError, match="wrong_range"):
        GlobalChunk.from_bytes(layout, blob, namespace_digest=DIGEST, start=8, end=12)
    with pytest.raises(LayoutError, match="bad_magic"):
        WindowSnapshot.from_bytes(layout, blob, namespace_digest=DIGEST, end=11)
    other = CacheLayout(SPECS["v4"](), chunk_size=16)
    with pytest.raises(LayoutError):
        GlobalChunk.from_bytes(other, blob, namespace_digest=DIGEST, start=0, end=11)


def test_layout_validation() -> None:
    spec = SPECS["v4"]()
    with pytest.raises(ValueError, match="multiple of every source"):
        CacheLayout(spec, chunk_size=12)
    layout = CacheLayout(spec, chunk_size=16)
    ns = layout.namespace("cfg", "w", "salt")
    layout.check_namespace(ns)
    with pytest.raises(ValueError, match="chunk_size"):
        CacheLayout(spec, chunk_size=32).check_namespace(ns)
    with pytest.raises(ValueError, match="positive multiple"):
        CacheLayout(spec, chunk_size=0)
    view = fake_view(spec, list(range(20)), 32)
    with pytest.raises(ValueError, match="chunk 1 ends at 32"):
        extract_chunk(layout, view, 0, 1, DIGEST)
    small = allocate_view(spec, 1, 8)
    with pytest.raises(ValueError, match="allocate the view"):
        load_chunk(layout, extract_chunk(layout, view, 0, 0, DIGEST), small, 0)
