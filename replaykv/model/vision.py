"""DeepSeek-V4.1's image path: the DeepSeek-ViT tower, pixel-unshuffle, the aligner and the
learned span embeddings, producing one text-width vector per position of an image's span.

Structure (architecture reference §8; transformers ships only the config, so the module layout
and parameter names below are ours):

* ``patch_embed`` [hidden, 3·patch²]: each patch of the canvas, flattened channel-major
  (c, row, column), projected to the tower's width;
* ``layers.N``: pre-norm blocks (LayerNorm, multi-head self-attention over all patches of the
  image with 2D RoPE: the first half of each head's channels rotate by the patch's row, the
  second half by its column, base ``rope_theta``; LayerNorm, GELU MLP of ``intermediate_size``);
  ``norm`` after the last block;
* pixel-unshuffle by ``downsample_ratio`` (r): the patch grid is zero-padded to whole r × r
  groups and each group's r² vectors (row-major) are concatenated into one;
* the aligner ``aligner.fc1`` [text hidden, r²·hidden], GELU, ``aligner.fc2``: one text-width
  vector per LLM token;
* ``image_start``, ``image_newline``, ``image_end`` [text hidden]: the learned vectors of the
  span's marker positions. The span is start, then per grid row its w vectors and a newline,
  then end (h·(w+1)+2 positions, :func:`replaykv.images.span_layout`).

The MoE router selects experts for span positions with ``e_score_correction_bias_vl`` instead
of the text bias (:class:`replaykv.model.moe.RouterV41`). Not for: decoding or resizing
images (:mod:`replaykv.images`), or placing spans in prompts (the engine).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from replaykv.images import PreparedImage
from replaykv.model.rope import apply_rope, rope_table

VISION_MODEL_TYPE = "deepseek_v41_vision"


@dataclass(frozen=True)
class DeepseekV41VisionConfig:
    """The ``vision_config`` of a composite DeepSeek-V4.1 config.json, with transformers' field
    names (``DeepseekV41VisionConfig``); ``layer_norm_eps`` is ours (the tower's norms)."""

    hidden_size: int = 1024
    intermediate_size: int = 2816
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    patch_size: int = 14
    downsample_ratio: int = 3
    rope_theta: float = 10000.0
    max_image_tokens: int = 1024
    min_pixels: int = 295936
    max_wh_ratio: int | None = None
    layer_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "patch_size", "downsample_ratio", "min_pixels"):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"vision_config.{name} must be a positive int; got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"vision_config.hidden_size ({self.hidden_size}) must be a multiple of "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if (self.hidden_size // self.num_attention_heads) % 4:
            raise ValueError(
                "vision_config: the head width (hidden_size / num_attention_heads) must be a multiple of 4 "
                "(2D RoPE rotates pairs in two halves)"
            )
        if self.max_image_tokens < 4:
            raise ValueError(
                f"vision_config.max_image_tokens must be at least 4; got {self.max_image_tokens}"
            )
        if self.max_wh_ratio is not None and self.max_wh_ratio <= 0:
            raise ValueError("vision_config.max_wh_ratio must be positive or null")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> DeepseekV41VisionConfig:
        d = dict(raw)
        d.pop("model_type", None)
        for generic in ("transformers_version", "torch_dtype", "dtype", "architectures"):
            d.pop(generic, None)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown vision_config fields: {unknown}")
        if "rope_theta" in d:
            d["rope_theta"] = float(d["rope_theta"])
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return {"model_type": VISION_MODEL_TYPE, **dataclasses.asdict(self)}


def _rope_2d_tables(
    grid_h: int, grid_w: int, head_dim: int, theta: float, device: torch.device
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(cos, sin) for rows and for columns of every patch, [P, 1, head_dim / 2] each."""
    half = head_dim // 2
    freqs = 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float32, device=device) / half)
    rows = torch.arange(grid_h, device=device).repeat_interleave(grid_w)
    cols = torch.arange(grid_w, device=device).repeat(grid_h)
    rc, rs = rope_table(freqs, rows)
    cc, cs = rope_table(freqs, cols)
    return (rc[:, None], rs[:, None]), (cc[:, None], cs[:, None])


def rope_2d(x: torch.Tensor, tables: tuple[tuple[torch.Tensor, torch.Tensor], ...]) -> torch.Tensor:
    """x [P, heads, d]: the first d/2 channels rotated by the row tables, the rest by the column's."""
    (rc, rs), (cc, cs) = tables
    half = x.shape[-1] // 2
    return torch.cat([apply_rope(x[..., :half], rc, rs), apply_rope(x[..., half:], cc, cs)], dim=-1)


class VisionBlock(nn.Module):
    """Pre-norm attention (2D RoPE) and GELU MLP."""

    def __init__(self, config: DeepseekV41VisionConfig) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.layer_norm_eps
        self.n_heads = config.num_attention_heads
        self.norm1 = nn.LayerNorm(d, eps=eps)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d, eps=eps)
        self.fc1 = nn.Linear(d, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, d)

    def forward(self, x: torch.Tensor, tables: tuple[tuple[torch.Tensor, torch.Tensor], ...]) -> torch.Tensor:
        p, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(p, 3, self.n_heads, d // self.n_heads).unbind(1)
        q, k = rope_2d(q, tables), rope_2d(k, tables)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        x = x + self.proj(o.transpose(0, 1).reshape(p, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


def patchify(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """[3, H, W] -> [(H/p)·(W/p), 3·p²]: row-major patches, each flattened (c, row, column)."""
    c, h, w = pixels.shape
    gh, gw = h // patch, w // patch
    x = pixels[:, : gh * patch, : gw * patch].reshape(c, gh, patch, gw, patch)
    return x.permute(1, 3, 0, 2, 4).reshape(gh * gw, c * patch * patch)


def pixel_unshuffle(x: torch.Tensor, grid_h: int, grid_w: int, ratio: int) -> torch.Tensor:
    """[gh·gw, d] patch vectors -> [ceil(gh/r)·ceil(gw/r), r²·d]: zero-padded r × r groups, each
    group's vectors concatenated in row-major order."""
    d = x.shape[-1]
    th, tw = -(-grid_h // ratio), -(-grid_w // ratio)
    grid = x.view(grid_h, grid_w, d)
    grid = F.pad(grid, (0, 0, 0, tw * ratio - grid_w, 0, th * ratio - grid_h))
    grid = grid.view(th, ratio, tw, ratio, d).permute(0, 2, 1, 3, 4)
    return grid.reshape(th * tw, ratio * ratio * d)


class VisionTower(nn.Module):
    """Tower, aligner and span embeddings (the module docstring's names under ``model.vision.``)."""

    def __init__(self, config: DeepseekV41VisionConfig, text_hidden: int) -> None:
        super().__init__()
        self.config = config
        d, r = config.hidden_size, config.downsample_ratio
        self.patch_embed = nn.Linear(3 * config.patch_size**2, d)
        self.layers = nn.ModuleList([VisionBlock(config) for _ in range(config.num_hidden_layers)])
        self.norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.aligner_fc1 = nn.Linear(r * r * d, text_hidden)
        self.aligner_fc2 = nn.Linear(text_hidden, text_hidden)
        self.image_start = nn.Parameter(torch.zeros(text_hidden))
        self.image_newline = nn.Parameter(torch.zeros(text_hidden))
        self.image_end = nn.Parameter(torch.zeros(text_hidden))

    def grid_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """Normalised canvas [3, H, W] -> aligned features [gh_llm, gw_llm, text hidden]."""
        cfg = self.config
        p, r = cfg.patch_size, cfg.downsample_ratio
        gh, gw = pixels.shape[1] // p, pixels.shape[2] // p
        dtype = self.patch_embed.weight.dtype
        x = self.patch_embed(patchify(pixels, p).to(dtype))
        tables = _rope_2d_tables(gh, gw, cfg.head_dim, cfg.rope_theta, x.device)
        for block in self.layers:
            x = block(x, tables)
        x = pixel_unshuffle(self.norm(x), gh, gw, r)
        x = self.aligner_fc2(F.gelu(self.aligner_fc1(x)))
        return x.view(-(-gh // r), -(-gw // r), -1)

    def span(self, image: PreparedImage) -> torch.Tensor:
        """The span's input vectors [h·(w+1)+2, text hidden] for one image."""
        dev = self.image_start.device
        feats = self.grid_features(image.pixels(torch.float32, dev))
        h, w, _ = feats.shape
        if (h, w) != image.grid:
            raise ValueError(f"the canvas gives a {h}×{w} grid, the image was planned for {image.grid}")
        newline = self.image_newline.to(feats.dtype).expand(h, 1, -1)
        rows = torch.cat([feats, newline], dim=1).reshape(h * (w + 1), -1)
        return torch.cat([self.image_start.to(feats.dtype)[None], rows, self.image_end.to(feats.dtype)[None]])
