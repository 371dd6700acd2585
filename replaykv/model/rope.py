"""Interleaved partial RoPE on the trailing channels of a vector, DeepSeek-V4 style.

Channel pairs (2i, 2i+1) of the trailing `rope_dim` channels rotate as complex numbers by
angle position * f_i; leading channels pass through. Two flavours: plain (sliding-only
layers) and frequency-only YaRN (compressed branches, no mscale). Not for: caching cos/sin
tables across calls (they are cheap to recompute from positions).
"""

from __future__ import annotations

import torch

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


def cos_sin(freqs: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of positions * freqs: positions [...] -> two float32 tensors [..., rope_dim // 2]."""
    angles = positions[..., None].float() * freqs
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing 2*cos.shape[-1] channels of x.

    x: [..., D]; cos/sin: broadcastable to [..., rope_dim // 2] once a head axis is inserted by
    the caller. `inverse` rotates by the negative angle (the output de-rotation).
    """
    half = cos.shape[-1]
    nope, rope = x[..., : x.shape[-1] - 2 * half], x[..., x.shape[-1] - 2 * half :]
    pairs = rope.float().unflatten(-1, (half, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    if inverse:
        sin = -sin
    rot_even = even * cos - odd * sin
    rot_odd = odd * cos + even * sin
    rotated = torch.stack((rot_even, rot_odd), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat((nope, rotated), dim=-1)
