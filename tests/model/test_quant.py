"""Tests for :mod:`replaykv.model.quant`: DeepSeek-V4.1 KV fake quantisers and byte layouts.

The references below are written from the architecture notes (§2.3, §2.5, §3.1, §5.1) in float64
numpy / plain Python, element by element, and share no code with the module.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from replaykv.model.quant import (
    FP4_COMPRESSED_ENTRY,
    FP8_WINDOW_ENTRY,
    MXFP4_INDEX_KEY,
    Fp4CompressedEntry,
    KVEntryLayout,
    KVQuantConfig,
    fp4_entry_fake_quant,
    fp8_window_fake_quant,
    mxfp4_index_fake_quant,
)

# ------------------------------------------------------------------------------------------
# Naive reference, from the spec text
# ------------------------------------------------------------------------------------------


def _e4m3_value(byte: int) -> float:
    """OCP float8 e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; 0x7F/0xFF are NaN."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * (mantissa / 8) * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
# Non-negative grids in code order; codes ascend with the value, so "even code" = even index.
E4M3_GRID = np.array([_e4m3_value(b) for b in range(0x7F)])
E2M1_GRID = np.array(E2M1)
assert np.all(np.diff(E4M3_GRID) > 0) and E4M3_GRID[-1] == 448.0


def _e2m1_value(nibble: int) -> float:
    return (-1.0 if nibble & 0x8 else 1.0) * E2M1[nibble & 0x7]


def _round_half_even(a: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Nearest grid value to each a >= 0 (a <= grid max); exact ties go to the even code."""
    idx = np.searchsorted(grid, a, side="left").clip(1, len(grid) - 1)
    lo, hi = grid[idx - 1], grid[idx]
    up = (hi - a < a - lo) | ((hi - a == a - lo) & (idx % 2 == 0))
    return np.where(up, hi, lo)


def _signed_round(q: np.ndarray, grid: np.ndarray) -> np.ndarray:
    return np.copysign(_round_half_even(np.abs(q), grid), q)


def _ceil_pow2(v: float) -> float:
    return 2.0 ** math.ceil(math.log2(v))


def ref_fp8_scales(blocks: np.ndarray) -> np.ndarray:
    """§2.3: scale = 2^ceil(log2(max(amax, 1e-4) / 448))."""
    return np.array([_ceil_pow2(max(float(np.abs(b).max()), 1e-4) / 448) for b in blocks])


def ref_fp4_scales(blocks: np.ndarray) -> np.ndarray:
    """§3.1 step 6: scale = float8_e4m3(max(amax, 6*2^-9) / 6) (saturating at 448 above 2784)."""
    raw = np.array([min(max(float(np.abs(b).max()), 6 * 2.0**-9) / 6, 448.0) for b in blocks])
    return _round_half_even(raw, E4M3_GRID)


def ref_mxfp4_scales(blocks: np.ndarray) -> np.ndarray:
    """§2.5: ue8m0 scale = 2^ceil(log2(max(amax, 6*2^-126) / 6))."""
    return np.array([_ceil_pow2(max(float(np.abs(b).max()), 6 * 2.0**-126) / 6) for b in blocks])


def ref_fake_quant(x: np.ndarray, block: int, kind: str) -> np.ndarray:
    """Quantise-dequantise float64 ``x[..., dim]`` the naive way."""
    blocks = x.reshape(-1, block).astype(np.float64)
    if kind == "fp8":
        scale = ref_fp8_scales(blocks)[:, None]
        out = _signed_round(np.clip(blocks / scale, -448, 448), E4M3_GRID) * scale
    else:
        scale = (ref_fp4_scales(blocks) if kind == "fp4" else ref_mxfp4_scales(blocks))[:, None]
        out = _signed_round(np.clip(blocks / scale, -6, 6), E2M1_GRID) * scale
    return out.reshape(x.shape)


def ref_decode(packed: np.ndarray, layout: KVEntryLayout, dim: int) -> np.ndarray:
    """Decode entry bytes from the §5.1 description (data bytes, then one scale byte per block)."""
    out = np.empty((*packed.shape[:-1], dim))
    for index in np.ndindex(*packed.shape[:-1]):
        row = [int(b) for b in packed[index]]
        if layout.data_bits == 8:
            data, scale_bytes = [_e4m3_value(b) for b in row[:dim]], row[dim:]
        else:  # two nibbles per byte, even element in the low nibble
            data = [_e2m1_value(n) for b in row[: dim // 2] for n in (b & 0xF, b >> 4)]
            scale_bytes = row[dim // 2 :]
        if isinstance(layout, Fp4CompressedEntry):
            scales = [_e4m3_value(b) for b in scale_bytes]
        else:  # ue8m0: exponent + 127
            scales = [2.0 ** (b - 127) for b in scale_bytes]
        out[index] = [v * scales[i // layout.block] for i, v in enumerate(data)]
    return out


# ------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------

FakeQuant = Callable[..., torch.Tensor]
CASES: list[tuple[KVEntryLayout, FakeQuant, str]] = [
    (FP8_WINDOW_ENTRY, fp8_window_fake_quant, "fp8"),
    (FP4_COMPRESSED_ENTRY, fp4_entry_fake_quant, "fp4"),
    (MXFP4_INDEX_KEY, mxfp4_index_fake_quant, "mxfp4"),
]
IDS = ["fp8_window", "fp4_entry", "mxfp4_index"]


def awkward_inputs(dim: int, seed: int = 0) -> torch.Tensor:
    """float32 [rows, dim]: random blocks spanning magnitudes, plus zeros, huge, tiny, negative."""
    g = torch.Generator().manual_seed(seed)
    rows = [
        torch.randn(dim, generator=g),
        torch.randn(dim, generator=g) * 1e-3,
        torch.zeros(dim),
        -torch.zeros(dim),
        torch.randn(dim, generator=g) * 1e30,
        torch.randn(dim, generator=g) * 1e4,  # FP4 entry scales saturate at 448 above amax 2784
        torch.randn(dim, generator=g) * 1e-30,
        torch.randn(dim, generator=g) * 1e-40,  # float32 subnormals
        -torch.rand(dim, generator=g) * 5,
        torch.full((dim,), -3.0),
        torch.where(torch.arange(dim) % 7 == 0, 1e6, 1e-6) * torch.randn(dim, generator=g),
    ]
    # each block of 16 channels at its own magnitude
    mags = 10.0 ** torch.randint(-12, 12, (8, dim // 16), generator=g).float().repeat_interleave(16, -1)
    rows.extend(torch.randn(8, dim, generator=g) * mags)
    return torch.stack(rows).to(torch.float32)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).contiguous().view(torch.int32)


# ------------------------------------------------------------------------------------------
# Sizes and layouts
# ------------------------------------------------------------------------------------------


def test_flash_byte_sizes() -> None:
    assert FP8_WINDOW_ENTRY.bytes_per_entry(512) == 528 == FP8_WINDOW_ENTRY.flash_bytes
    assert FP4_COMPRESSED_ENTRY.bytes_per_entry(512) == 288 == FP4_COMPRESSED_ENTRY.flash_bytes
    assert MXFP4_INDEX_KEY.bytes_per_entry(128) == 68 == MXFP4_INDEX_KEY.flash_bytes
    assert (FP8_WINDOW_ENTRY.data_bytes(512), FP8_WINDOW_ENTRY.scale_bytes(512)) == (512, 16)
    assert (FP4_COMPRESSED_ENTRY.data_bytes(512), FP4_COMPRESSED_ENTRY.scale_bytes(512)) == (256, 32)
    assert (MXFP4_INDEX_KEY.data_bytes(128), MXFP4_INDEX_KEY.scale_bytes(128)) == (64, 4)
    # §5.2: 890 B/token of global KV for V4.1-Flash (three r=2 sources, one r=1 source)
    per_source = FP4_COMPRESSED_ENTRY.flash_bytes + MXFP4_INDEX_KEY.flash_bytes
    assert 3 * per_source / 2 + per_source == 890


@pytest.mark.parametrize(("dim", "sizes"), [(64, (66, 36, 34)), (128, (132, 72, 68)), (32, (33, 18, 17))])
def test_small_dim_byte_sizes(dim: int, sizes: tuple[int, int, int]) -> None:
    layouts = (FP8_WINDOW_ENTRY, FP4_COMPRESSED_ENTRY, MXFP4_INDEX_KEY)
    assert tuple(layout.bytes_per_entry(dim) for layout in layouts) == sizes
    for layout in layouts:
        x = torch.randn(3, dim)
        assert layout.pack(x).shape == (3, layout.bytes_per_entry(dim))


def test_known_bytes() -> None:
    # FP8: a block with amax 448 has scale 2^0 (byte 127); 1.0 is e4m3 0x38, -2.0 is 0xC0.
    x = torch.zeros(64)
    x[0], x[1], x[2], x[32] = 448.0, 1.0, -2.0, 0.5
    packed = FP8_WINDOW_ENTRY.pack(x)
    assert packed[:3].tolist() == [0x7E, 0x38, 0xC0]
    # second block amax 0.5: scale 2^ceil(log2(0.5/448)) = 2^-9, 0.5 / 2^-9 = 256 = e4m3 0x78
    assert packed[32].item() == 0x78
    assert packed[64:].tolist() == [127, 127 - 9]
    # FP4 entry: amax 6 -> scale e4m3(1.0) = 0x38; nibbles pack even element low.
    y = torch.zeros(16)
    y[:4] = torch.tensor([0.5, 1.0, -6.0, 3.0])
    packed = FP4_COMPRESSED_ENTRY.pack(y)
    assert packed[:2].tolist() == [0x21, 0x5F]  # (lo 0.5=1, hi 1.0=2), (lo -6=0xF, hi 3=5)
    assert packed[8:].tolist() == [0x38]
    # MXFP4: amax 12 -> scale 2^1 (byte 128); 12/2 = 6 (code 7), 1/2 = 0.5 (code 1)
    z = torch.zeros(32)
    z[0], z[1] = 1.0, -12.0
    packed = MXFP4_INDEX_KEY.pack(z)
    assert packed[0].item() == 0xF1 and packed[16:].tolist() == [128]


def test_page_major_round_trip() -> None:
    layout, dim = FP8_WINDOW_ENTRY, 64
    entries = layout.pack(torch.randn(2, 5, dim))  # [2 pages, 5 entries, 66 bytes]
    page = layout.to_page_major(entries, dim)
    assert page.shape == (2, 5 * 66)
    assert torch.equal(page[:, : 5 * 64].reshape(2, 5, 64), entries[..., :64])
    assert torch.equal(page[:, 5 * 64 :].reshape(2, 5, 2), entries[..., 64:])
    assert torch.equal(layout.from_page_major(page, dim), entries)


# ------------------------------------------------------------------------------------------
# Numerics against the naive reference
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("layout", "fq", "kind"), CASES, ids=IDS)
@pytest.mark.parametrize("dim", [64, 512])
def test_matches_naive_reference(layout: KVEntryLayout, fq: FakeQuant, kind: str, dim: int) -> None:
    x = awkward_inputs(dim)
    out = fq(x)
    assert out.dtype == torch.float32 and out.shape == x.shape
    expected = ref_fake_quant(x.double().numpy(), layout.block, kind)
    np.testing.assert_array_equal(out.double().numpy(), expected)
    assert torch.equal(layout.fake_quant(x), out)


@pytest.mark.parametrize(("layout", "fq", "kind"), CASES, ids=IDS)
def test_scale_bytes_match_naive_rule(layout: KVEntryLayout, fq: FakeQuant, kind: str) -> None:
    dim = 128
    x = awkward_inputs(dim, seed=1)
    scale_bytes = layout.pack(x)[:, layout.data_bytes(dim) :].numpy()
    blocks = x.double().numpy().reshape(-1, layout.block)
    if kind == "fp4":
        decoded = np.array([_e4m3_value(int(b)) for b in scale_bytes.ravel()])
        np.testing.assert_array_equal(decoded, ref_fp4_scales(blocks))
    else:
        rule = ref_fp8_scales if kind == "fp8" else ref_mxfp4_scales
        np.testing.assert_array_equal(scale_bytes.ravel().astype(np.int64) - 127, np.log2(rule(blocks)))


@pytest.mark.parametrize(("layout", "fq", "kind"), CASES, ids=IDS)
def test_bytes_decode_independently(layout: KVEntryLayout, fq: FakeQuant, kind: str) -> None:
    dim = 64
    x = awkward_inputs(dim, seed=2)
    packed = layout.pack(x)
    np.testing.assert_array_equal(ref_decode(packed.numpy(), layout, dim), fq(x).double().numpy())


@pytest.mark.parametrize(("layout", "fq", "kind"), CASES, ids=IDS)
def test_grid_membership(layout: KVEntryLayout, fq: FakeQuant, kind: str) -> None:
    dim = 128
    x = awkward_inputs(dim, seed=3)
    out = fq(x).double().numpy().reshape(-1, layout.block)
    blocks = x.double().numpy().reshape(-1, layout.block)
    scales = {"fp8": ref_fp8_scales, "fp4": ref_fp4_scales, "mxfp4": ref_mxfp4_scales}[kind](blocks)
    grid = set(E4M3_GRID.tolist()) if kind == "fp8" else set(E2M1)
    assert set(np.abs(out / scales[:, None]).ravel().tolist()) <= grid
    if kind == "fp4":
        assert set(scales.tolist()) <= set(E4M3_GRID.tolist()) and scales.min() > 0
    else:
        assert np.all(np.exp2(np.round(np.log2(scales))) == scales)


def test_e2m1_ties_round_half_to_even() -> None:
    # With amax 6 the scale is exactly 1 for both FP4 formats; with amax 6.75 the e4m3 scale
    # is 1.125 and the midpoints times 1.125 are still exact float32 ties.
    midpoints = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    rounded = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    for amax, fq, scale in [
        (6.0, fp4_entry_fake_quant, 1.0),
        (6.75, fp4_entry_fake_quant, 1.125),
        (6.0, mxfp4_index_fake_quant, 1.0),
        (12.0, mxfp4_index_fake_quant, 2.0),
    ]:
        block = torch.zeros(32)
        block[0] = amax
        block[1:8] = torch.tensor(midpoints) * scale
        block[8:15] = -torch.tensor(midpoints) * scale
        out = fq(block) / scale
        assert out[1:8].tolist() == rounded
        assert out[8:15].tolist() == [-v for v in rounded]
        # one float32 ulp either side of each midpoint rounds to the nearer neighbour
        above = torch.nextafter(block[1:8], torch.tensor(math.inf))
        below = torch.nextafter(block[1:8], torch.tensor(0.0))
        assert (fq(torch.cat([block[:1], above, block[8:]])) / scale)[1:8].tolist() == [
            0.5,
            1.0,
            1.5,
            2.0,
            3.0,
            4.0,
            6.0,
        ]
        assert (fq(torch.cat([block[:1], below, block[8:]])) / scale)[1:8].tolist() == [
            0.0,
            0.5,
            1.0,
            1.5,
            2.0,
            3.0,
            4.0,
        ]


def test_e4m3_ties_round_half_to_even() -> None:
    block = torch.zeros(32)
    block[0] = 448.0  # scale exactly 1
    ties = [1.0625, 1.1875, 17.0, 19.0, 2.0**-10, 3 * 2.0**-10, 448.0, 248.0]
    block[1 : 1 + len(ties)] = torch.tensor(ties)
    out = fp8_window_fake_quant(block)[1 : 1 + len(ties)].tolist()
    assert out == [1.0, 1.25, 16.0, 20.0, 0.0, 2.0**-8, 448.0, 256.0]


def test_scale_boundaries() -> None:
    def scale_byte(layout: KVEntryLayout, amax: float) -> int:
        x = torch.zeros(layout.block)
        x[3] = amax
        return int(layout.pack(x)[-1])

    for k in (-20, -3, 0, 5, 60):
        exact = 448.0 * 2.0**k
        assert scale_byte(FP8_WINDOW_ENTRY, exact) == 127 + k
        up = torch.nextafter(torch.tensor(exact), torch.tensor(math.inf)).item()
        assert scale_byte(FP8_WINDOW_ENTRY, up) == 127 + k + 1
        exact = 6.0 * 2.0**k
        assert scale_byte(MXFP4_INDEX_KEY, exact) == 127 + k
        up = torch.nextafter(torch.tensor(exact), torch.tensor(math.inf)).item()
        assert scale_byte(MXFP4_INDEX_KEY, up) == 127 + k + 1
    # floors: all-zero blocks
    assert scale_byte(FP8_WINDOW_ENTRY, 0.0) == 127 - 22  # 2^ceil(log2(1e-4/448)) = 2^-22
    assert scale_byte(MXFP4_INDEX_KEY, 0.0) == 1  # 2^-126
    assert scale_byte(FP4_COMPRESSED_ENTRY, 0.0) == 0x01  # e4m3 2^-9
    # e4m3 scale ties: 6.375/6 = 1.0625 -> 1.0 (0x38); 7.125/6 = 1.1875 -> 1.25 (0x3A)
    assert scale_byte(FP4_COMPRESSED_ENTRY, 6.375) == 0x38
    assert scale_byte(FP4_COMPRESSED_ENTRY, 7.125) == 0x3A
    # saturation: amax/6 above 448 keeps the largest finite e4m3 scale
    assert scale_byte(FP4_COMPRESSED_ENTRY, 1e9) == 0x7E


def test_division_matches_reciprocal_multiply_of_hf_and_vllm() -> None:
    """HF and vLLM compute amax * fp32(1/448) (or 1/6); the ceiling must be the same."""
    for limit, layout in [(448.0, FP8_WINDOW_ENTRY), (6.0, MXFP4_INDEX_KEY)]:
        centre = torch.tensor(limit).view(torch.int32).item()
        amax = torch.arange(centre - 300, centre + 300, dtype=torch.int32).view(torch.float32)
        for k in (-10, 0, 7):
            a = amax * 2.0**k
            product = a * torch.tensor(1.0 / limit, dtype=torch.float32)
            expected = [127 + math.ceil(math.log2(v)) for v in product.double().tolist()]
            x = torch.zeros(len(a), layout.block)
            x[:, 0] = a
            assert layout.pack(x)[:, -1].tolist() == expected


# ------------------------------------------------------------------------------------------
# Round trips, idempotence, shapes, dtypes
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("layout", "fq", "kind"), CASES, ids=IDS)
def test_pack_unpack_bit_exact(layout: KVEntryLayout, fq: FakeQuant, kind: str) -> None:
    dim = layout.flash_dim
    x = awkward_inputs(dim, seed=4)
    out = layout.unpack(layout.pack(x), dim)
    assert out.dtype == torch.float32
    assert torch.equal(bits(out), bits(fq(x)))


def fp4_entry_stable_blocks(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """Blocks outside the one band where the FP4 entry rule is not idempotent (see module doc).

    amax in [9*2^-9, 10*2^-9]: amax/6 rounds to the subnormal e4m3 scale 2^-8, amax/2^-8 <= 5
    rounds to 4, and the re-quantised block (amax 2^-6) gets the scale 2^-9.
    """
    amax = x.reshape(*x.shape[:-1], -1, block).abs().amax(-1)
    return ~((amax >= 9 * 2.0**-9) & (amax <= 10 * 2.0**-9))


def assert_idempotent(layout: KVEntryLayout, fq: FakeQuant, kind: str, x: torch.Tensor) -> None:
    once = fq(x)
    twice, repacked = fq(once), layout.unpack(layout.pack(once), x.shape[-1])
    if kind == "fp4":
        keep = fp4_entry_stable_blocks(x).repeat_interleave(layout.block, -1)
        once, twice, repacked = once[keep], twice[keep], repacked[keep]
    assert torch.equal(bits(twice), bits(once))
    assert torch.equal(bits(repacked), bits(once))


@pytest.mark.parametrize(("layout", "fq", "kind"), CASES, ids=IDS)
def test_idempotent_and_on_grid_values_pack_losslessly(
    layout: KVEntryLayout, fq: FakeQuant, kind: str
) -> None:
    x = awkward_inputs(128, seed=5)
    assert_idempotent(layout, fq, kind, x)
    # a fixed point of the quantiser is "on the grid" and always packs losslessly
    once = fq(x)
    fixed = once[(fq(once) == once).all(-1)]
    assert len(fixed) > 0
    assert torch.equal(bits(layout.unpack(layout.pack(fixed), 128)), bits(fixed))


def test_fp4_entry_non_idempotent_band_is_exactly_documented() -> None:
    lo, hi = (torch.tensor(v).view(torch.int32).item() for v in (0.0172, 0.0200))
    amax = torch.arange(lo, hi, 7, dtype=torch.int32).view(torch.float32)
    amax = torch.cat([amax, torch.tensor([9 * 2.0**-9, 10 * 2.0**-9])])
    x = torch.zeros(len(amax), 16)
    x[:, 0], x[:, 1] = amax, amax / 3
    once = fp4_entry_fake_quant(x)
    changed = (fp4_entry_fake_quant(once) != once).any(-1)
    assert torch.equal(changed, ~fp4_entry_stable_blocks(x)[:, 0])
    assert changed[-2:].all()
    # inside the band the block max lands on 4 * 2^-8 (not 6 * scale)
    assert torch.all(once[changed, 0] == 4 * 2.0**-8)


@pytest.mark.parametrize(("layout", "fq", "kind"), CASES, ids=IDS)
def test_leading_batch_dims(layout: KVEntryLayout, fq: FakeQuant, kind: str) -> None:
    dim = 64
    x = torch.randn(2, 3, 4, dim, generator=torch.Generator().manual_seed(6))
    packed = layout.pack(x)
    assert packed.shape == (2, 3, 4, layout.bytes_per_entry(dim)) and packed.dtype == torch.uint8
    assert torch.equal(packed[1, 2], layout.pack(x[1, 2]))
    assert torch.equal(fq(x)[1, 2], fq(x[1, 2]))
    assert torch.equal(layout.unpack(packed, dim), fq(x))
    # non-contiguous input and empty leading dims
    xt = x.transpose(0, 1)
    assert torch.equal(fq(xt), fq(xt.contiguous()))
    empty = torch.empty(0, 5, dim)
    assert layout.pack(empty).shape == (0, 5, layout.bytes_per_entry(dim))
    assert fq(empty).shape == empty.shape


@pytest.mark.parametrize(("layout", "fq", "kind"), CASES, ids=IDS)
def test_bfloat16_input(layout: KVEntryLayout, fq: FakeQuant, kind: str) -> None:
    dim = 128
    x = (awkward_inputs(dim, seed=7)[:12]).to(torch.bfloat16)  # rows within bf16 range
    out = fq(x)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    reference = fq(x.float())
    assert torch.equal(out.float(), reference)  # dequantised values are exact in bf16
    assert torch.equal(layout.pack(x), layout.pack(x.float()))
    assert torch.equal(layout.unpack(layout.pack(x), dim), reference)


@pytest.mark.parametrize(("layout", "fq", "kind"), CASES, ids=IDS)
def test_straight_through_gradient(layout: KVEntryLayout, fq: FakeQuant, kind: str) -> None:
    x = torch.randn(3, 64, requires_grad=True)
    weights = torch.randn(3, 64)
    out = fq(x)
    assert out.requires_grad
    (out * weights).sum().backward()
    assert x.grad is not None and torch.equal(x.grad, weights)
    with torch.no_grad():
        assert torch.equal(fq(x), out.detach())


def test_devices_agree() -> None:
    devices = [torch.device("cuda")] if torch.cuda.is_available() else []
    if not devices:
        pytest.skip("no accelerator: device-agnostic code runs on CPU only here")
    x = awkward_inputs(128, seed=8)
    for layout, fq, _ in CASES:
        for device in devices:
            assert torch.equal(bits(fq(x.to(device)).cpu()), bits(fq(x)))
            assert torch.equal(layout.pack(x.to(device)).cpu(), layout.pack(x))


# ------------------------------------------------------------------------------------------
# Switch and errors
# ------------------------------------------------------------------------------------------


def test_switch_off_is_identity() -> None:
    x = torch.randn(2, 100)  # not a multiple of any block: fine when disabled
    off = KVQuantConfig(enabled=False)
    assert off.fp8_window(x) is x and off.fp4_entry(x) is x and off.mxfp4_index(x) is x
    for _, fq, _ in CASES:
        assert fq(x, enabled=False) is x
    on = KVQuantConfig()
    y = torch.randn(2, 128)
    assert torch.equal(on.fp8_window(y), fp8_window_fake_quant(y))
    assert torch.equal(on.fp4_entry(y), fp4_entry_fake_quant(y))
    assert torch.equal(on.mxfp4_index(y), mxfp4_index_fake_quant(y))
    assert FP8_WINDOW_ENTRY.fake_quant(x, enabled=False) is x


@pytest.mark.parametrize(("layout", "fq", "kind"), CASES, ids=IDS)
def test_indivisible_dims_raise(layout: KVEntryLayout, fq: FakeQuant, kind: str) -> None:
    x = torch.randn(2, 100)
    with pytest.raises(ValueError, match=rf"last dim 100 is not a positive multiple of the {layout.block}"):
        fq(x)
    with pytest.raises(ValueError, match="multiple of"):
        layout.pack(x)
    with pytest.raises(ValueError, match=rf"dim 100 is not a positive multiple of the {layout.block}"):
        layout.bytes_per_entry(100)
    with pytest.raises(ValueError, match="bytes for dim 64"):
        layout.unpack(torch.zeros(2, 7, dtype=torch.uint8), 64)
    with pytest.raises(TypeError):
        layout.unpack(torch.zeros(2, layout.bytes_per_entry(64)), 64)
    with pytest.raises(TypeError):
        fq(torch.zeros(2, 64, dtype=torch.int32))
    with pytest.raises(ValueError):
        fq(torch.zeros(2, 0))


# ------------------------------------------------------------------------------------------
# Property test
# ------------------------------------------------------------------------------------------

_LIMIT = 2.0**100  # about 1.3e30: far from float32 overflow after dequantisation
_finite32 = st.floats(width=32, min_value=-_LIMIT, max_value=_LIMIT, allow_nan=False, allow_infinity=False)


@settings(max_examples=60, deadline=None, derandomize=True)
@example(case=1, data=np.ones((1, 32), dtype=np.float32), exponent=0)
@given(
    case=st.sampled_from(range(len(CASES))),
    data=hnp.arrays(np.float32, st.tuples(st.integers(1, 3), st.sampled_from([32, 64])), elements=_finite32),
    exponent=st.integers(-30, 30),
)
def test_property_round_trip_and_reference(case: int, data: np.ndarray, exponent: int) -> None:
    layout, fq, kind = CASES[case]
    x = torch.from_numpy(data) * 2.0**exponent  # spread magnitudes; may overflow or go subnormal
    x = torch.nan_to_num(x, posinf=_LIMIT, neginf=-_LIMIT).clamp(-_LIMIT, _LIMIT)
    dim = x.shape[-1]
    out = fq(x)
    stored = layout.unpack(layout.pack(x), dim)
    if kind == "fp4":
        # The storage encoder keeps a block that another e4m3 scale represents exactly (all
        # ones: 4 x 0.25) where the quantiser's rule rounds its scale (1/6 -> 0.171875, giving
        # 1.03125): such a block stores as itself, every other block as the quantiser's output.
        per_block = (*x.shape[:-1], dim // layout.block, layout.block)
        same_as_fq = (bits(stored) == bits(out)).reshape(per_block).all(-1)
        same_as_x = (bits(stored) == bits(x)).reshape(per_block).all(-1)
        assert bool((same_as_fq | same_as_x).all())
    else:
        assert torch.equal(bits(stored), bits(out))
    assert_idempotent(layout, fq, kind, x)
    np.testing.assert_array_equal(
        out.double().numpy(), ref_fake_quant(x.double().numpy(), layout.block, kind)
    )


def test_packing_already_quantised_fp4_is_lossless() -> None:
    """Caches hold fake-quantised values; storing them must not re-round (the band above)."""
    x = torch.randn(4096, 64, generator=torch.Generator().manual_seed(11)) * 0.02
    once = fp4_entry_fake_quant(x)
    assert torch.equal(FP4_COMPRESSED_ENTRY.unpack(FP4_COMPRESSED_ENTRY.pack(once), 64), once)
