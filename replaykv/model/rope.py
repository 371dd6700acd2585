"""Interleaved partial RoPE on the trailing channels of a vector, DeepSeek-V4 style.

Channel pairs (2i, 2i+1) of the trailing `rope_dim` channels rotate as complex numbers by
angle position * f_i; leading channels pass through. Two flavours: plain (sliding-only
layers) and frequency-only YaRN (compressed branches, no mscale). A call's tables are built
once per forward and shared by every layer. Not for: caching tables across calls.
"""

from __future__ import annotations

import torch

from replaykv.model import native
from replaykv.model.config import RopeConfig, yarn_low_high


def inv_freq(rope: RopeConfig, rope_dim: int, device: torch.device | None = None) -> torch.Tensor:
    """Inverse frequencies f_i, i = 0..rope_dim/2-1, float32 [rope_dim // 2]."""
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32, device=device) / rope_dim
    pos_freqs = rope.rope_theta**exponents
    extrapolation = 1.0 / pos_freqs
    if rope.rope_type == "default":
        return extrapolation
    assert rope.factor is not None
    interpolation = 1.0 / (rope.factor * pos_freqs)
    low, high = yarn_low_high(rope, rope_dim)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(
        0, 1
    )
    keep = 1 - ramp  # 1 where the pair keeps its original (high) frequency
    return interpolation * (1 - keep) + extrapolation * keep


def rope_table(freqs: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed sin) at positions [...], each [..., rope_dim] float32.

    cos is repeated per pair (c0, c0, c1, c1, ...); sin is signed (-s0, s0, -s1, s1, ...), so a
    rotation is x * cos + swap_pairs(x) * sin.
    """
    angles = positions[..., None].float() * freqs
    # In float64, rounded to float32: a CPU computes sin and cos in library routines whose last
    # bits depend on where an element sits in the array, so one position alone (a decode step)
    # and among others could differ by an ulp in float32; a float64 result rounds to the same
    # float32 unless it lies within 2^-29 relative of a rounding boundary.
    wide = angles.double()
    cos, sin = wide.cos().float(), wide.sin().float()
    return cos.repeat_interleave(2, dim=-1), torch.stack((-sin, sin), dim=-1).flatten(-2)


_SWAPS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _pair_swap(r: int, device: torch.device) -> torch.Tensor:
    """The channel order (1, 0, 3, 2, ...) of r channels (one gather instead of a flip's three
    operations per call; built once per size and device)."""
    key = (r, device)
    if key not in _SWAPS:
        with torch.inference_mode(False):  # a normal tensor, usable by autograd later
            _SWAPS[key] = torch.arange(r, device=device).view(-1, 2).flip(-1).flatten()
    return _SWAPS[key]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing cos.shape[-1] channels of x by the table's angles (or their negatives).

    x: [..., D]; cos/sin: broadcastable to x[..., -rope_dim:] (insert a head axis at the caller).
    The products are those of (x0·c − x1·s, x1·c + x0·s), in float32 (natively in one call
    where `native.usable` and the tables are per row, with or without a head axis of one).
    """
    out = native.rope(x, cos, sin, inverse)
    if out is not None:
        return out
    r = cos.shape[-1]
    tail = x[..., x.shape[-1] - r :]
    if tail.dtype != torch.float32:
        tail = tail.float()
    swapped = tail.index_select(-1, _pair_swap(r, tail.device))  # (x1, x0, x3, x2, ...)
    rotated = tail * cos + swapped * (-sin if inverse else sin)
    if rotated.dtype != x.dtype:
        rotated = rotated.to(x.dtype)
    if r == x.shape[-1]:
        return rotated
    return torch.cat((x[..., : x.shape[-1] - r], rotated), dim=-1)
