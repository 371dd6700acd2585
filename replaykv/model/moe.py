"""The DeepSeek-V4 family's MoE: routers (learned and hashed, V4 and V4.1), routed experts as
fused 3-D weights, the shared expert.

Parameter names follow transformers' `deepseek_v4` modules so state dicts load directly. Every
product goes through :func:`replaykv.model.layers.linear`, so a token's output does not depend on
the tokens it was batched with. Not for: the mHC sites and norms around it
(:mod:`replaykv.model.layers`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from replaykv.model.config import DeepseekV4Config
from replaykv.model.layers import Linear, cast, linear, linears, native_weight, rowwise


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """SiLU(min(gate, limit)) * clamp(up, -limit, limit)."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class SharedExpert(nn.Module):
    """The always-on expert: a clamped SwiGLU MLP."""

    def __init__(self, config: DeepseekV4Config) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = Linear(h, i)
        self.up_proj = Linear(h, i)
        self.down_proj = Linear(i, h)
        self.limit = config.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linears(x, self, self.gate_proj.weight, self.up_proj.weight)
        return self.down_proj(clamped_swiglu(gate, up, self.limit))


class Experts(nn.Module):
    """Routed experts as fused 3-D weights: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""

    def __init__(self, config: DeepseekV4Config) -> None:
        super().__init__()
        e, h, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.zeros(e, h, i))
        self.limit = config.swiglu_limit

    def forward(
        self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, weight_before_down: bool = False
    ) -> torch.Tensor:
        """x [T, H], indices [T, k], weights [T, k] -> [T, H].

        DeepSeek-V4 scales each expert's output by its weight; V4.1 (`weight_before_down`)
        scales the activation, in float32, before the down projection.
        """
        t, k = indices.shape
        if t == 1 and not torch.is_grad_enabled():
            return self._one_token(x, indices, weights, weight_before_down)
        # Sort the (token, pick) pairs by expert, run each expert once on its rows, then put the
        # results back in (token, pick) order and sum over the picks. One code path for any number
        # of rows, so a token's result does not depend on what it was batched with.
        # index_select and cat rather than indexed writes: the same values, and a backward of
        # index_add and slices instead of accumulating index_put (a tenth of a training step).
        gate_up_wt, down_wt = self._native_weights()
        flat_idx = indices.reshape(-1)
        order = torch.argsort(flat_idx, stable=True)
        counts = torch.bincount(flat_idx, minlength=self.num_experts).tolist()
        x_sorted = x.index_select(0, order // k)
        w_sorted = weights.reshape(-1)[order]
        outs = [x_sorted[:0]]
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            gate, up = linear(x_sorted[start : start + c], self.gate_up_proj[e], _at(gate_up_wt, e)).chunk(
                2, dim=-1
            )
            act = clamped_swiglu(gate, up, self.limit)
            if weight_before_down:
                act = cast(cast(act, torch.float32) * w_sorted[start : start + c, None], x.dtype)
            outs.append(linear(act, self.down_proj[e], _at(down_wt, e)))
            start += c
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        y = torch.cat(outs).index_select(0, inverse)
        if weight_before_down:
            return y.view(t, k, -1).sum(dim=1)
        return (y.view(t, k, -1) * cast(weights.unsqueeze(-1), x.dtype)).sum(dim=1)

    def _native_weights(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Every expert's weights as the native product reads them (kept until they change), or
        None where it does not run."""
        return (
            native_weight(self, self.gate_up_proj, "_gate_up_native"),
            native_weight(self, self.down_proj, "_down_native"),
        )

    def _one_token(
        self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, weight_before_down: bool
    ) -> torch.Tensor:
        """`forward` of a decode step: each pick's expert on the one row, in pick order. The
        values of the sorted path (a token's rows through the same one-row products, the same
        sum over picks) without its sort, counts and inverse permutation."""
        outs = []
        gate_up_wt, down_wt = self._native_weights()
        for j, e in enumerate(indices[0].tolist()):
            gate, up = linear(x, self.gate_up_proj[e], _at(gate_up_wt, e)).chunk(2, dim=-1)
            act = clamped_swiglu(gate, up, self.limit)
            if weight_before_down:
                act = cast(cast(act, torch.float32) * weights[:, j : j + 1], x.dtype)
            outs.append(linear(act, self.down_proj[e], _at(down_wt, e)))
        y = torch.cat(outs)
        if weight_before_down:
            return y.view(1, len(outs), -1).sum(dim=1)
        return (y.view(1, len(outs), -1) * cast(weights.unsqueeze(-1), x.dtype)).sum(dim=1)


def _at(weights: torch.Tensor | None, e: int) -> torch.Tensor | None:
    return None if weights is None else weights[e]


class Router(nn.Module):
    """Top-k router with sqrt-softplus scores.

    Learned routing: selection by top-k of (score + e_score_correction_bias), weights are the
    unbiased scores of the picks. Hash routing (`tid2eid`): selection is a fixed token-id table.
    Weights are normalised by their sum (+1e-20) and scaled by routed_scaling_factor.
    """

    def __init__(self, config: DeepseekV4Config, hashed: bool) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.scaling = config.routed_scaling_factor
        self.hashed = hashed
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size))
        self.tid2eid: torch.Tensor
        self.e_score_correction_bias: torch.Tensor
        if hashed:
            self.register_buffer(
                "tid2eid", torch.zeros(config.vocab_size, self.top_k, dtype=torch.long), persistent=True
            )
        else:
            self.register_buffer(
                "e_score_correction_bias",
                torch.zeros(config.n_routed_experts, dtype=torch.float32),
                persistent=True,
            )

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H], input_ids [T] -> (indices [T, k], weights [T, k])."""
        scores = rowwise(F.softplus, linear(x, self.weight, native_weight(self, self.weight))).sqrt()
        if self.hashed:
            indices = self.tid2eid[input_ids].long()
        else:
            biased = scores + self.e_score_correction_bias
            indices = torch.topk(biased, self.top_k, dim=-1, sorted=False).indices
        w = scores.gather(1, indices)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return indices, w * self.scaling


class MoE(nn.Module):
    """Routed experts plus the shared expert."""

    def __init__(self, config: DeepseekV4Config, layer: int) -> None:
        super().__init__()
        self.gate = Router(config, hashed=config.mlp_layer_types[layer] == "hash_moe")
        self.experts = Experts(config)
        self.shared_experts = SharedExpert(config)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x [B, S, H], input_ids [B, S] -> [B, S, H]."""
        flat = x.reshape(-1, x.shape[-1])
        indices, weights = self.gate(flat, input_ids.reshape(-1))
        routed = self.experts(flat, indices, weights).view_as(x)
        return routed + self.shared_experts(x)


class RouterV41(nn.Module):
    """DeepSeek-V4.1 gate: float32 logits / gate_temp, sqrt-softplus scores, selection by top-k of
    (score + e_score_correction_bias), weights from the unbiased scores (normalised when
    norm_topk_prob and top_k > 1), times routed_scaling_factor. Image-span positions select with
    `e_score_correction_bias_vl` instead of the text bias."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.scaling = config.routed_scaling_factor
        self.gate_temp = config.gate_temp
        self.normalise = config.norm_topk_prob and self.top_k > 1
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size))
        self.e_score_correction_bias: torch.Tensor
        self.e_score_correction_bias_vl: torch.Tensor
        self.register_buffer(
            "e_score_correction_bias", torch.zeros(config.n_routed_experts, dtype=torch.float32)
        )
        self.register_buffer(
            "e_score_correction_bias_vl", torch.zeros(config.n_routed_experts, dtype=torch.float32)
        )

    def forward(
        self, x: torch.Tensor, image: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H], image [T] bool or None -> (indices [T, k], weights [T, k] float32)."""
        if torch.is_autocast_enabled(x.device.type):  # training in bf16: the logits stay float32
            with torch.autocast(x.device.type, enabled=False):
                return self.forward(x, image)
        w = cast(self.weight, torch.float32)
        logits = linear(cast(x, torch.float32), w, native_weight(self, w))
        if self.gate_temp != 1.0:
            logits = logits / self.gate_temp
        scores = rowwise(F.softplus, logits).sqrt()
        bias = self.e_score_correction_bias
        if image is not None:
            bias = torch.where(image[:, None], self.e_score_correction_bias_vl, bias)
        indices = torch.topk(scores + bias, self.top_k, dim=-1, sorted=False).indices
        w = scores.gather(1, indices)
        if self.normalise:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return indices, w * self.scaling


class MoEV41(nn.Module):
    """DeepSeek-V4.1 MoE: routed experts (each output weighted before its down projection, in
    float32) plus the shared expert, accumulated in float32."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.gate = RouterV41(config)
        self.experts = Experts(config)
        self.shared_experts = SharedExpert(config)
        self.images = getattr(config, "vision_config", None) is not None

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x [..., H]; input_ids [...] (negative at image-span positions, read with a vision tower)."""
        flat = x.reshape(-1, x.shape[-1])
        indices, weights = self.gate(flat, input_ids.reshape(-1) < 0 if self.images else None)
        routed = self.experts(flat, indices, weights, weight_before_down=True)
        out = cast(routed, torch.float32) + cast(self.shared_experts(x).reshape_as(flat), torch.float32)
        return cast(out, x.dtype).view_as(x)
