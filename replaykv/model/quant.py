"""DeepSeek-V4.1's KV numerics and byte layouts, defined once.

Three block-scaled formats sit on the KV path of DeepSeek-V4.1 (architecture notes §2.3, §2.5,
§3.1, §5.1). Each is applied as a *fake quantiser* inside the model (QAT semantics: quantise, then
dequantise straight away, even in unquantised runs) and is stored byte-exact by the caches:

=====================  =====================  ======  ================  ==============  ===========
format                 used for               block   element           scale           Flash bytes
=====================  =====================  ======  ================  ==============  ===========
FP8 window entry       window K = V, all      32      e4m3 (1 B)        ue8m0 (1 B)     512 + 16
                       layers (post-RoPE)                                                = 528
FP4 compressed entry   compressed main KV     16      e2m1 (1/2 B)      e4m3 (1 B)      256 + 32
                       (post-RoPE, "NVFP4")                                              = 288
MXFP4 index key        indexer keys and       32      e2m1 (1/2 B)      ue8m0 (1 B)     64 + 4
                       queries                                                           = 68
=====================  =====================  ======  ================  ==============  ===========

Rules (every step in float32; ``amax`` is the largest ``|x|`` of one block of consecutive channels
along the last dim; checked against transformers ``modular_deepseek_v41.py`` @0a2080b
``_fake_quant_fp8_block`` / ``_fake_quant_fp4_block`` / ``_e2m1_codes`` / ``_pow2_ceil_scale``
[HF-mod] and vLLM ``deepseek_v41/common/ops/cache_utils.py``, ``fused_compress_quant_cache.py``,
``indexer_k_store.py`` [vLLM-cache, vLLM-ik]):

* FP8 window: ``scale = 2^ceil(log2(max(amax, 1e-4) / 448))``; ``q = clamp(x / scale, ±448)``
  cast to ``float8_e4m3fn`` (round to nearest, ties to even); value ``= q * scale``.
* FP4 compressed entry: ``scale = e4m3(min(max(amax, 6·2⁻⁹) / 6, 448))`` (round to nearest even;
  the ``min(…, 448)`` saturates like vLLM's ``clamp(…, 2⁻⁹, 448)``; torch 2.13's CPU cast also
  saturates, but an unclamped cast is not promised to on every version and device; it only
  matters for ``amax > 2784``);
  ``q = e2m1(clamp(x / scale, ±6))``; value ``= q * scale``. No per-tensor global scale.
* MXFP4 index key: ``scale = 2^ceil(log2(max(amax, 6·2⁻¹²⁶) / 6))`` (the floor makes the smallest
  scale 2⁻¹²⁶, the smallest normal float32; the same constant is in HF, vLLM's Triton kernels
  and the DeepSeek-V4 reference ``kernel.py``); ``q = e2m1(clamp(x / scale, ±6))``.
* ``e2m1`` rounds to the grid {0, 0.5, 1, 1.5, 2, 3, 4, 6} (with sign), to nearest, and
  at an exact midpoint to the neighbour with the even 3-bit code, i.e. the even mantissa: 0.25→0,
  0.75→1, 1.25→1, 1.75→2, 2.5→2, 3.5→4, 5→4 (PTX ``cvt.rn.satfinite.e2m1x2.f32`` and HF agree).
  The sign bit comes from ``signbit``, so negative values that round to zero get the ``-0`` code
  0x8 (as in HF and the PTX cast). It decodes to -0.0, like e4m3's 0x80; HF's table decodes it
  to +0.0, which compares equal.
* ``2^ceil(log2 t)`` is computed from the float32 bits of ``t`` (biased exponent, plus one if any
  mantissa bit is set), never with ``log2``, so powers of two are exact. The stored ue8m0 byte is
  that exponent + 127 (E8M0: byte ``b`` means ``2^(b-127)``, 0xFF is NaN). HF and vLLM multiply
  ``amax`` by the float32 reciprocal (``1/448``, ``1/6``) where this module divides; the two give
  the same ceiling for every float32 ``amax`` (they could only differ if one quotient were exactly
  a power of two, which needs ``amax = 448·2^k`` or ``6·2^k``, where both are exact), and the
  tests check it. The e4m3 scale uses true division as HF does.

Every dequantised value is exact in float32 (at most 6 significant bits times a power of two), so
``unpack(pack(x))`` equals ``fake_quant(x)`` bit for bit, and a value on the grid (a fixed point,
``fake_quant(x) == x``) packs losslessly. The FP8 and MXFP4 quantisers are idempotent, so their
outputs always re-pack losslessly (a block may come back with a smaller scale byte and the same
values). The FP4 entry quantiser is idempotent except for blocks whose ``amax`` lies in
``[9·2⁻⁹, 10·2⁻⁹]`` (0.01758 to 0.01953): there the subnormal e4m3 scale rounds up to 2⁻⁸, the
block maximum lands on 4 instead of 6, and a second pass picks the scale 2⁻⁹ and rounds again.
That is the reference rule (HF and vLLM bytes), not a bug to fix here; move packed bytes between
tiers instead of re-quantising dequantised entries.

Inputs of any floating dtype are read as float32. The fake quantisers return the input's dtype
(exact for float32 and bfloat16; float16 may round or overflow on the way back); ``unpack``
returns float32. Non-finite inputs are outside the contract: results are deterministic and the
same on both paths: a NaN makes its whole block NaN in every format, an inf does the same in the
ue8m0 formats, and the FP4 entry saturates an infinite element to ±2688.

Byte layouts are entry-major: one entry is its data bytes, then its scale bytes, with scale ``i``
belonging to channels ``[i*block, (i+1)*block)``. FP4 packs two elements per byte, the even element
in the low nibble. :meth:`KVEntryLayout.to_page_major` converts a run of entries to vLLM's paged
order (all data bytes of the page first, then all scale bytes).

A dim that is not a multiple of the block raises :class:`ValueError` (HF silently skips
quantisation there instead). Pass ``enabled=False`` (or use ``KVQuantConfig(enabled=False)``) to
turn the fake quantisers into the identity for exact-numerics tests; then no dim check is made.

Not for: weight quantisation, quantised matmuls, or the V4 (584 B) record.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "FP4_COMPRESSED_ENTRY",
    "FP8_E4M3_MAX",
    "FP8_WINDOW_ENTRY",
    "MXFP4_INDEX_KEY",
    "Fp4CompressedEntry",
    "Fp8WindowEntry",
    "KVEntryLayout",
    "KVQuantConfig",
    "Mxfp4IndexKey",
    "fp4_entry_fake_quant",
    "fp8_window_fake_quant",
    "mxfp4_index_fake_quant",
]

FP8_E4M3_MAX = 448.0
"""Largest finite ``float8_e4m3fn`` magnitude."""
E2M1_MAX = 6.0
"""Largest e2m1 magnitude."""
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""e2m1 magnitudes indexed by the 3-bit code (bit 3 of a nibble is the sign)."""

_FP8_AMAX_FLOOR = 1e-4
_FP4_ENTRY_AMAX_FLOOR = 6.0 * 2.0**-9  # scale floor 2^-9: the smallest e4m3 subnormal
_MXFP4_AMAX_FLOOR = 6.0 * 2.0**-126  # scale floor 2^-126: the smallest normal float32

# Midpoints between neighbouring e2m1 magnitudes, and whether a value exactly on one rounds up
# (the upper neighbour has the even code) or down (the lower one has).
_E2M1_MIDPOINTS: tuple[tuple[float, bool], ...] = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)

_Encode = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
_Decode = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

_E2M1_TABLES: dict[torch.device, torch.Tensor] = {}


def _e2m1_table(device: torch.device) -> torch.Tensor:
    """float32 value of each 4-bit e2m1 code on ``device`` (code 0x8 decodes to -0.0)."""
    table = _E2M1_TABLES.get(device)
    if table is None:
        signed = [*E2M1_VALUES, *(-v for v in E2M1_VALUES)]
        table = torch.tensor(signed, dtype=torch.float32, device=device)
        _E2M1_TABLES[device] = table
    return table


# ---------------------------------------------------------------------------------------------
# Scalar formats
# ---------------------------------------------------------------------------------------------


def _ue8m0_ceil_code(t: torch.Tensor) -> torch.Tensor:
    """uint8 ue8m0 byte ``ceil(log2 t) + 127`` of positive normal float32 ``t``, read from its bits.

    inf and NaN give 0xFF (E8M0 NaN).
    """
    bits = t.contiguous().view(torch.int32)
    biased_exponent = (bits >> 23) & 0xFF
    inexact = ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (biased_exponent + inexact).clamp(0, 255).to(torch.uint8)


def _ue8m0_decode(code: torch.Tensor) -> torch.Tensor:
    """float32 ``2^(code - 127)`` of a uint8 ue8m0 byte; 0x00 is 2^-127, 0xFF is NaN."""
    c = code.to(torch.int32)
    power = (c << 23).view(torch.float32)  # exact for 1 <= c <= 254
    power = torch.where(c == 0, torch.full_like(power, 2.0**-127), power)
    return torch.where(c == 255, torch.full_like(power, float("nan")), power)


def _e2m1_encode(q: torch.Tensor) -> torch.Tensor:
    """4-bit e2m1 codes (uint8, sign in bit 3) of float32 ``q`` already clamped to ±6.

    Round to nearest; an exact midpoint goes to the even code (round half to even).
    """
    magnitude = q.abs()
    code = torch.zeros(q.shape, dtype=torch.uint8, device=q.device)
    for midpoint, tie_rounds_up in _E2M1_MIDPOINTS:
        code += (magnitude >= midpoint) if tie_rounds_up else (magnitude > midpoint)
    return code | (torch.signbit(q).to(torch.uint8) << 3)


def _e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """float32 values of 4-bit e2m1 codes."""
    return _e2m1_table(code.device)[code.long()]


# ---------------------------------------------------------------------------------------------
# Block formats: blocks are float32 [..., n_blocks, block]; encoders return
# (element codes uint8 [..., n_blocks, block], scale bytes uint8 [..., n_blocks]).
# ---------------------------------------------------------------------------------------------


def _fp8_ue8m0_encode(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = blocks.abs().amax(dim=-1)
    scale_code = _ue8m0_ceil_code(amax.clamp_min(_FP8_AMAX_FLOOR) / FP8_E4M3_MAX)
    scale = _ue8m0_decode(scale_code).unsqueeze(-1)
    q = (blocks / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return q.to(torch.float8_e4m3fn).view(torch.uint8), scale_code


def _fp8_ue8m0_decode(data: torch.Tensor, scale_code: torch.Tensor) -> torch.Tensor:
    values = data.contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    return values * _ue8m0_decode(scale_code).unsqueeze(-1)


def _fp4_e4m3_encode(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = blocks.abs().amax(dim=-1)
    raw = (amax.clamp_min(_FP4_ENTRY_AMAX_FLOOR) / E2M1_MAX).clamp_max(FP8_E4M3_MAX)
    scale_fp8 = raw.to(torch.float8_e4m3fn)
    scale = scale_fp8.to(torch.float32).unsqueeze(-1)
    q = (blocks / scale).clamp(-E2M1_MAX, E2M1_MAX)
    return _e2m1_encode(q), scale_fp8.view(torch.uint8)


def _fp4_e4m3_encode_exact(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The storage encoder: the quantiser's rule, except for blocks that are already FP4 values."""
    codes, scale_u8 = _fp4_e4m3_encode(blocks)
    scale_fp8 = scale_u8.view(torch.float8_e4m3fn)
    scale = scale_fp8.to(torch.float32).unsqueeze(-1)
    amax = blocks.abs().amax(dim=-1)
    # The FP4 quantiser is not idempotent: when a block's scale rounded up, its largest value
    # lands below 6 and the standard rule would pick another scale for the already-quantised
    # block. A block that some other e4m3 scale represents exactly keeps that exact encoding,
    # so packing a cache that already holds fake-quantised entries loses nothing.
    inexact = (_e2m1_decode(codes) * scale != blocks).any(dim=-1)
    if bool(inexact.any()):
        for top in (4.0, 3.0, 2.0, 1.5, 1.0, 0.5):
            alt_fp8 = (amax / top).clamp(min=2.0**-9, max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)
            alt = alt_fp8.to(torch.float32).unsqueeze(-1)
            alt_codes = _e2m1_encode((blocks / alt).clamp(-E2M1_MAX, E2M1_MAX))
            fits = inexact & (_e2m1_decode(alt_codes) * alt == blocks).all(dim=-1)
            codes = torch.where(fits.unsqueeze(-1), alt_codes, codes)
            scale_fp8 = torch.where(fits, alt_fp8.view(torch.uint8), scale_fp8.view(torch.uint8)).view(
                torch.float8_e4m3fn
            )
            inexact &= ~fits
            if not bool(inexact.any()):
                break
    return codes, scale_fp8.view(torch.uint8)


def _fp4_e4m3_decode(codes: torch.Tensor, scale_code: torch.Tensor) -> torch.Tensor:
    scale = scale_code.contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    return _e2m1_decode(codes) * scale.unsqueeze(-1)


def _mxfp4_encode(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = blocks.abs().amax(dim=-1)
    scale_code = _ue8m0_ceil_code(amax.clamp_min(_MXFP4_AMAX_FLOOR) / E2M1_MAX)
    scale = _ue8m0_decode(scale_code).unsqueeze(-1)
    q = (blocks / scale).clamp(-E2M1_MAX, E2M1_MAX)
    return _e2m1_encode(q), scale_code


def _mxfp4_decode(codes: torch.Tensor, scale_code: torch.Tensor) -> torch.Tensor:
    return _e2m1_decode(codes) * _ue8m0_decode(scale_code).unsqueeze(-1)


# ---------------------------------------------------------------------------------------------
# Fake quantisers
# ---------------------------------------------------------------------------------------------


def _check_blocked(x: torch.Tensor, block: int, what: str) -> None:
    if not x.is_floating_point():
        raise TypeError(f"{what}: expected a floating-point tensor, got {x.dtype}")
    if block <= 0:
        raise ValueError(f"{what}: block must be a positive number of channels, got {block}")
    dim = x.shape[-1] if x.dim() else 0
    if dim <= 0 or dim % block:
        raise ValueError(
            f"{what}: last dim {dim} is not a positive multiple of the {block}-channel block; "
            f"DeepSeek-V4.1 scales every run of {block} consecutive channels of the last dim "
            f"together, so the dim must be divisible by {block} (or switch the fake quantisers "
            f"off with enabled=False / KVQuantConfig(enabled=False))"
        )


class _StraightThrough(torch.autograd.Function):
    """Forward returns the quantised tensor; backward passes the gradient to ``x`` unchanged."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, quantised: torch.Tensor) -> torch.Tensor:
        del ctx, x
        return quantised.view_as(quantised)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        del ctx
        return grad, None


def _fake_quant(x: torch.Tensor, block: int, encode: _Encode, decode: _Decode) -> torch.Tensor:
    with torch.no_grad():
        blocks = x.detach().to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)
        data, scales = encode(blocks)
        out = decode(data, scales).reshape(x.shape).to(x.dtype)
    if x.requires_grad and torch.is_grad_enabled():
        return cast(torch.Tensor, _StraightThrough.apply(x, out))
    return out


def fp8_window_fake_quant(x: torch.Tensor, block: int = 32, *, enabled: bool = True) -> torch.Tensor:
    """FP8 window-KV fake quantiser: e4m3 elements, one ue8m0 scale per ``block`` channels.

    ``scale = 2^ceil(log2(max(amax, 1e-4) / 448))``, ``x -> e4m3(clamp(x / scale, ±448)) * scale``
    (architecture §2.3 step 3). Returns ``x``'s shape and dtype; the gradient is straight-through.
    ``enabled=False`` returns ``x`` itself.
    """
    if not enabled:
        return x
    _check_blocked(x, block, "fp8_window_fake_quant")
    return _fake_quant(x, block, _fp8_ue8m0_encode, _fp8_ue8m0_decode)


def fp4_entry_fake_quant(x: torch.Tensor, block: int = 16, *, enabled: bool = True) -> torch.Tensor:
    """FP4 compressed-entry fake quantiser: e2m1 elements, one e4m3 scale per ``block`` channels.

    ``scale = e4m3(min(max(amax, 6·2⁻⁹) / 6, 448))``, ``x -> e2m1(clamp(x / scale, ±6)) * scale``
    with round-half-to-even e2m1 (architecture §3.1 step 6). Returns ``x``'s shape and dtype; the
    gradient is straight-through. ``enabled=False`` returns ``x`` itself.
    """
    if not enabled:
        return x
    _check_blocked(x, block, "fp4_entry_fake_quant")
    return _fake_quant(x, block, _fp4_e4m3_encode, _fp4_e4m3_decode)


def mxfp4_index_fake_quant(x: torch.Tensor, block: int = 32, *, enabled: bool = True) -> torch.Tensor:
    """MXFP4 index-key/query fake quantiser: e2m1 elements, one ue8m0 scale per ``block`` channels.

    ``scale = 2^ceil(log2(max(amax, 6·2⁻¹²⁶) / 6))``, ``x -> e2m1(clamp(x / scale, ±6)) * scale``
    with round-half-to-even e2m1 (architecture §2.5). Returns ``x``'s shape and dtype; the gradient
    is straight-through. ``enabled=False`` returns ``x`` itself.
    """
    if not enabled:
        return x
    _check_blocked(x, block, "mxfp4_index_fake_quant")
    return _fake_quant(x, block, _mxfp4_encode, _mxfp4_decode)


@dataclass(frozen=True)
class KVQuantConfig:
    """Switch for the three KV fake quantisers; ``enabled=False`` makes each the identity.

    Model code holds one of these and calls its methods instead of the free functions, so a test
    can build the model with ``KVQuantConfig(enabled=False)`` for exact (unquantised) numerics.
    """

    enabled: bool = True

    def fp8_window(self, x: torch.Tensor) -> torch.Tensor:
        """:func:`fp8_window_fake_quant` (block 32), or ``x`` when disabled."""
        return fp8_window_fake_quant(x, enabled=self.enabled)

    def fp4_entry(self, x: torch.Tensor) -> torch.Tensor:
        """:func:`fp4_entry_fake_quant` (block 16), or ``x`` when disabled."""
        return fp4_entry_fake_quant(x, enabled=self.enabled)

    def mxfp4_index(self, x: torch.Tensor) -> torch.Tensor:
        """:func:`mxfp4_index_fake_quant` (block 32), or ``x`` when disabled."""
        return mxfp4_index_fake_quant(x, enabled=self.enabled)


# ---------------------------------------------------------------------------------------------
# Byte layouts
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KVEntryLayout:
    """A block-scaled KV entry, ``[..., dim]`` float ↔ ``[..., bytes_per_entry(dim)]`` uint8.

    Entry-major: ``dim * data_bits / 8`` data bytes, then ``dim / block`` scale bytes (scale ``i``
    covers channels ``[i*block, (i+1)*block)``); with 4-bit data the even element of each pair is
    in the low nibble. Subclasses fix the format; use the module constants.
    """

    block: ClassVar[int]
    data_bits: ClassVar[int]
    flash_dim: ClassVar[int]
    _encode: ClassVar[_Encode]
    _decode: ClassVar[_Decode]

    @property
    def name(self) -> str:
        """Class name of the layout (for messages)."""
        return type(self).__name__

    def check_dim(self, dim: int) -> None:
        """Raise :class:`ValueError` unless ``dim`` is a positive multiple of :attr:`block`."""
        if dim <= 0 or dim % self.block:
            raise ValueError(
                f"{self.name}: dim {dim} is not a positive multiple of the {self.block}-channel "
                f"scale block; the entry stores one scale per {self.block} consecutive channels, "
                f"so bytes = dim*{self.data_bits}/8 + dim/{self.block} needs dim % {self.block} == 0"
            )

    def data_bytes(self, dim: int) -> int:
        """Element bytes of one entry: ``dim * data_bits / 8``."""
        self.check_dim(dim)
        return dim * self.data_bits // 8

    def scale_bytes(self, dim: int) -> int:
        """Scale bytes of one entry: ``dim / block``."""
        self.check_dim(dim)
        return dim // self.block

    def bytes_per_entry(self, dim: int) -> int:
        """Total bytes of one entry: ``dim * data_bits / 8 + dim / block``."""
        return self.data_bytes(dim) + self.scale_bytes(dim)

    @property
    def flash_bytes(self) -> int:
        """:meth:`bytes_per_entry` at the released V4.1-Flash dim."""
        return self.bytes_per_entry(self.flash_dim)

    def fake_quant(self, x: torch.Tensor, *, enabled: bool = True) -> torch.Tensor:
        """The matching fake quantiser at this layout's block; equals ``unpack(pack(x))``."""
        if not enabled:
            return x
        _check_blocked(x, self.block, f"{self.name}.fake_quant")
        return _fake_quant(x, self.block, type(self)._encode, type(self)._decode)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """Quantise ``x[..., dim]`` (any float dtype, read as float32) to ``[..., nbytes]`` uint8."""
        _check_blocked(x, self.block, f"{self.name}.pack")
        dim = x.shape[-1]
        blocks = x.detach().to(torch.float32).reshape(*x.shape[:-1], dim // self.block, self.block)
        data, scales = type(self)._encode(blocks)
        data = data.reshape(*x.shape[:-1], dim)
        if self.data_bits == 4:
            data = data[..., 0::2] | (data[..., 1::2] << 4)
        return torch.cat((data, scales), dim=-1)

    def unpack(self, packed: torch.Tensor, dim: int) -> torch.Tensor:
        """Dequantise ``packed[..., bytes_per_entry(dim)]`` uint8 to float32 ``[..., dim]``."""
        if packed.dtype != torch.uint8:
            raise TypeError(f"{self.name}.unpack: expected uint8 bytes, got {packed.dtype}")
        n_data, n_bytes = self.data_bytes(dim), self.bytes_per_entry(dim)
        if packed.dim() == 0 or packed.shape[-1] != n_bytes:
            raise ValueError(
                f"{self.name}.unpack: last dim must be {n_bytes} bytes for dim {dim}, "
                f"got shape {tuple(packed.shape)}"
            )
        lead = packed.shape[:-1]
        data, scales = packed[..., :n_data], packed[..., n_data:]
        if self.data_bits == 4:
            data = torch.stack((data & 0x0F, data >> 4), dim=-1).reshape(*lead, dim)
        blocks = data.reshape(*lead, dim // self.block, self.block)
        return type(self)._decode(blocks, scales).reshape(*lead, dim)

    def to_page_major(self, entries: torch.Tensor, dim: int) -> torch.Tensor:
        """``[..., n, nbytes]`` entry-major → ``[..., n * nbytes]``: all data bytes, then all scales.

        This is the order vLLM uses inside one page (architecture §5.1), without page padding.
        """
        n_data, n_bytes = self.data_bytes(dim), self.bytes_per_entry(dim)
        if entries.dim() < 2 or entries.shape[-1] != n_bytes:
            raise ValueError(
                f"{self.name}.to_page_major: expected [..., n, {n_bytes}], got {tuple(entries.shape)}"
            )
        return torch.cat((entries[..., :n_data].flatten(-2), entries[..., n_data:].flatten(-2)), dim=-1)

    def from_page_major(self, page: torch.Tensor, dim: int) -> torch.Tensor:
        """Inverse of :meth:`to_page_major`: ``[..., n * nbytes]`` → ``[..., n, nbytes]``."""
        n_data, n_bytes = self.data_bytes(dim), self.bytes_per_entry(dim)
        if page.dim() == 0 or page.shape[-1] % n_bytes:
            raise ValueError(
                f"{self.name}.from_page_major: last dim must be a multiple of {n_bytes}, "
                f"got {tuple(page.shape)}"
            )
        n = page.shape[-1] // n_bytes
        data = page[..., : n * n_data].unflatten(-1, (n, n_data))
        scales = page[..., n * n_data :].unflatten(-1, (n, n_bytes - n_data))
        return torch.cat((data, scales), dim=-1)


@dataclass(frozen=True)
class Fp8WindowEntry(KVEntryLayout):
    """Window KV entry: ``[..., dim]`` → ``dim`` e4m3 + ``dim/32`` ue8m0 bytes; Flash 512 → 528 B.

    Element bytes are ``float8_e4m3fn`` bit patterns; scale byte ``b`` means ``2^(b-127)``.
    Rule: :func:`fp8_window_fake_quant`. [vLLM-cache ``V41_BYTES_PER_TOKEN``, HF-mod]
    """

    block: ClassVar[int] = 32
    data_bits: ClassVar[int] = 8
    flash_dim: ClassVar[int] = 512
    _encode: ClassVar[_Encode] = _fp8_ue8m0_encode
    _decode: ClassVar[_Decode] = _fp8_ue8m0_decode


@dataclass(frozen=True)
class Fp4CompressedEntry(KVEntryLayout):
    """Compressed main-KV entry: ``[..., dim]`` → ``dim/2`` e2m1 + ``dim/16`` e4m3 bytes; 512 → 288 B.

    Two e2m1 nibbles per byte (even element low, sign in bit 3 of each nibble); scale bytes are
    ``float8_e4m3fn`` bit patterns. Rule: :func:`fp4_entry_fake_quant`. NeMo and vLLM call it NVFP4
    (no per-tensor global scale). [vLLM-cache ``V41_NVFP4_BYTES_PER_TOKEN``, HF-mod]
    """

    block: ClassVar[int] = 16
    data_bits: ClassVar[int] = 4
    flash_dim: ClassVar[int] = 512
    _encode: ClassVar[_Encode] = _fp4_e4m3_encode_exact
    _decode: ClassVar[_Decode] = _fp4_e4m3_decode


@dataclass(frozen=True)
class Mxfp4IndexKey(KVEntryLayout):
    """Indexer key: ``[..., dim]`` → ``dim/2`` e2m1 + ``dim/32`` ue8m0 bytes; Flash 128 → 68 B.

    Two e2m1 nibbles per byte (even element low); scale byte ``b`` means ``2^(b-127)``.
    Rule: :func:`mxfp4_index_fake_quant`. [vLLM-ik, HF-mod]
    """

    block: ClassVar[int] = 32
    data_bits: ClassVar[int] = 4
    flash_dim: ClassVar[int] = 128
    _encode: ClassVar[_Encode] = _mxfp4_encode
    _decode: ClassVar[_Decode] = _mxfp4_decode


FP8_WINDOW_ENTRY = Fp8WindowEntry()
"""Window KV entry layout (528 B at dim 512)."""
FP4_COMPRESSED_ENTRY = Fp4CompressedEntry()
"""Compressed main-KV entry layout (288 B at dim 512)."""
MXFP4_INDEX_KEY = Mxfp4IndexKey()
"""Indexer key layout (68 B at dim 128)."""
