"""A naive DeepSeek-V4.1 image path written from the description in replaykv/model/vision.py
and architecture reference §8, sharing no code with replaykv: patches cut out one by one, 2D
RoPE as complex multiplications per patch, attention as an explicit softmax per head, the
pixel-unshuffle groups gathered by loops, the span assembled row by row."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F


def _layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def _rotate(v: torch.Tensor, angle_index: int, theta: float) -> torch.Tensor:
    """Interleaved pairs (2m, 2m+1) of `v` [n] rotated by angle_index · theta^(-2m/n)."""
    n = v.shape[-1]
    out = v.clone()
    for m in range(n // 2):
        a = angle_index * theta ** (-2 * m / n)
        z = complex(float(v[2 * m]), float(v[2 * m + 1])) * complex(math.cos(a), math.sin(a))
        out[2 * m], out[2 * m + 1] = z.real, z.imag
    return out


def naive_span(model: Any, canvas: torch.Tensor) -> torch.Tensor:
    """Span vectors [h·(w+1)+2, text hidden] of a uint8 canvas [3, H, W]."""
    vc = model.config.vision_config
    sd = {k.removeprefix("model.vision."): v.detach().float() for k, v in model.state_dict().items()}
    p, r, eps = vc.patch_size, vc.downsample_ratio, vc.layer_norm_eps
    px = (canvas.float() / 255.0 - 0.5) / 0.5
    gh, gw = px.shape[1] // p, px.shape[2] // p
    patches = [
        px[:, i * p : (i + 1) * p, j * p : (j + 1) * p].reshape(-1) for i in range(gh) for j in range(gw)
    ]
    x = torch.stack(patches) @ sd["patch_embed.weight"].T + sd["patch_embed.bias"]
    heads, d = vc.num_attention_heads, vc.hidden_size // vc.num_attention_heads
    for layer in range(vc.num_hidden_layers):
        pre = f"layers.{layer}."
        h = _layer_norm(x, sd[pre + "norm1.weight"], sd[pre + "norm1.bias"], eps)
        qkv = h @ sd[pre + "qkv.weight"].T + sd[pre + "qkv.bias"]
        q, k, v = (
            qkv[:, : vc.hidden_size],
            qkv[:, vc.hidden_size : 2 * vc.hidden_size],
            qkv[:, 2 * vc.hidden_size :],
        )
        outs = []
        for hd in range(heads):
            sl = slice(hd * d, (hd + 1) * d)
            qr, kr = [], []
            for idx in range(gh * gw):
                row, col = divmod(idx, gw)
                for src, dst in ((q, qr), (k, kr)):
                    vec = src[idx, sl]
                    dst.append(
                        torch.cat(
                            [
                                _rotate(vec[: d // 2], row, vc.rope_theta),
                                _rotate(vec[d // 2 :], col, vc.rope_theta),
                            ]
                        )
                    )
            qh, kh = torch.stack(qr), torch.stack(kr)
            att = torch.softmax(qh @ kh.T / math.sqrt(d), dim=-1)
            outs.append(att @ v[:, sl])
        x = x + torch.cat(outs, dim=-1) @ sd[pre + "proj.weight"].T + sd[pre + "proj.bias"]
        h = _layer_norm(x, sd[pre + "norm2.weight"], sd[pre + "norm2.bias"], eps)
        x = (
            x
            + F.gelu(h @ sd[pre + "fc1.weight"].T + sd[pre + "fc1.bias"]) @ sd[pre + "fc2.weight"].T
            + sd[pre + "fc2.bias"]
        )
    x = _layer_norm(x, sd["norm.weight"], sd["norm.bias"], eps)
    th, tw = -(-gh // r), -(-gw // r)
    tokens = []
    for ti in range(th):
        for tj in range(tw):
            parts = []
            for a in range(r):
                for b in range(r):
                    i, j = ti * r + a, tj * r + b
                    parts.append(x[i * gw + j] if i < gh and j < gw else torch.zeros(vc.hidden_size))
            vec = torch.cat(parts)
            hid = F.gelu(vec @ sd["aligner_fc1.weight"].T + sd["aligner_fc1.bias"])
            tokens.append(hid @ sd["aligner_fc2.weight"].T + sd["aligner_fc2.bias"])
    span = [sd["image_start"]]
    for ti in range(th):
        span.extend(tokens[ti * tw : (ti + 1) * tw])
        span.append(sd["image_newline"])
    span.append(sd["image_end"])
    return torch.stack(span)


def reference_logits_with_images(
    model: Any, ids: list[int], images: list[tuple[int, torch.Tensor]]
) -> torch.Tensor:
    """The dense text reference's logits [S, vocab] of `ids` with each image (first position,
    uint8 canvas) placed by this module's naive tower, its rows routed with the image bias."""
    from tests.model.v41_reference import reference_logits

    emb = model.state_dict()["model.embed_tokens.weight"].detach().float()[torch.tensor(ids)].clone()
    rows = torch.zeros(len(ids), dtype=torch.bool)
    for start, canvas in images:
        span = naive_span(model, canvas)
        emb[start : start + span.shape[0]] = span
        rows[start : start + span.shape[0]] = True
    return reference_logits(model, ids, inputs=emb, image_rows=rows)[0]
