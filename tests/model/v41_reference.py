"""A naive dense-masked DeepSeek-V4.1 written from the architecture reference (§1–§3, §12).

It shares no code with replaykv: every query attends over all S window keys and all N
compressed entries through explicit boolean masks, groups are pooled one by one, top-k ties go
to the lower index by a stable sort, MoE runs every expert on every token. Slow and simple on
purpose: it is the independent reference the model is checked against.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _pow2_ceil(t: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(t.double()))).float()


def _e2m1_round(q: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 value, ties to the even code (codes 0..7 over E2M1)."""
    mag = q.abs()
    dist = (mag[..., None] - E2M1).abs()
    best = dist.min(-1, keepdim=True).values
    cand = dist == best  # ties: up to two codes
    codes = torch.arange(8).expand_as(cand)
    even = cand & (codes % 2 == 0)
    code = torch.where(even.any(-1), (codes * even).amax(-1), (codes * cand).amax(-1))
    return torch.sign(q) * E2M1[code]


def fq_fp8(x: torch.Tensor, on: bool) -> torch.Tensor:
    if not on:
        return x
    b = x.unflatten(-1, (-1, 32))
    scale = _pow2_ceil(b.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448.0)
    return ((b / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale).flatten(-2)


def fq_fp4(x: torch.Tensor, on: bool) -> torch.Tensor:
    if not on:
        return x
    b = x.unflatten(-1, (-1, 16))
    scale = (b.abs().amax(-1, keepdim=True).clamp_min(6 * 2.0**-9) / 6).to(torch.float8_e4m3fn).float()
    return (_e2m1_round((b / scale).clamp(-6, 6)) * scale).flatten(-2)


def fq_mxfp4(x: torch.Tensor, on: bool) -> torch.Tensor:
    if not on:
        return x
    b = x.unflatten(-1, (-1, 32))
    scale = _pow2_ceil(b.abs().amax(-1, keepdim=True).clamp_min(6 * 2.0**-126) / 6)
    return (_e2m1_round((b / scale).clamp(-6, 6)) * scale).flatten(-2)


def rms(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def freqs(theta: float, rd: int, yarn: Any | None) -> torch.Tensor:
    f = torch.tensor([theta ** (-2 * i / rd) for i in range(rd // 2)], dtype=torch.float32)
    if yarn is None:
        return f

    def corr(rot: float) -> float:
        return (
            rd * math.log(yarn.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(theta))
        )

    low, high = max(math.floor(corr(yarn.beta_fast)), 0), min(math.ceil(corr(yarn.beta_slow)), rd - 1)
    gamma = ((torch.arange(rd // 2).float() - low) / max(high - low, 1e-3)).clamp(0, 1)
    return f * (1 - gamma) + (f / yarn.factor) * gamma


def rope(x: torch.Tensor, pos: torch.Tensor, f: torch.Tensor, sign: float = 1.0) -> torch.Tensor:
    """Rotate trailing pairs of x [..., P, (H,) D] at positions pos [P]."""
    rd = 2 * f.shape[0]
    ang = pos.float()[:, None] * f * sign  # [P, rd/2]
    while ang.dim() < x.dim():
        ang = ang.unsqueeze(-2)
    head, tail = x[..., :-rd], x[..., -rd:]
    e, o = tail[..., 0::2], tail[..., 1::2]
    c, s = ang.cos(), ang.sin()
    return torch.cat([head, torch.stack([e * c - o * s, o * c + e * s], -1).flatten(-2)], -1)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The mHC Sinkhorn as the architecture writes it: columns once, then rows and columns."""
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


def topk_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[S, N] -> bool mask of the k best finite scores per row, ties to the lower index."""
    n = scores.shape[-1]
    mask = torch.zeros_like(scores, dtype=torch.bool)
    for t in range(scores.shape[0]):
        row = scores[t].tolist()
        ranked = sorted(range(n), key=lambda j: (-row[j], j))[: min(k, n)]
        for j in ranked:
            if row[j] != float("-inf"):
                mask[t, j] = True
    return mask


def reference_logits(
    model: Any, ids: list[int], inputs: torch.Tensor | None = None, image_rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Logits [S, vocab] and the selection mask [S, N] of every index source. `inputs` [S, D]
    replaces the token embeddings (image spans placed); rows where `image_rows` [S] is true
    select experts with the image bias."""
    c = model.config
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    s_len, eps, hc, w_len = len(ids), c.rms_norm_eps, c.hc_mult, c.sliding_window
    pos = torch.arange(s_len)
    rd = c.qk_rope_head_dim
    f_main = freqs(c.rope_main.rope_theta, rd, None)
    yarn = c.rope_compress if c.rope_compress.rope_type == "yarn" else None
    f_comp = freqs(c.rope_compress.rope_theta, rd, yarn)
    q8 = c.kv_quant

    x = sd["model.embed_tokens.weight"][torch.tensor(ids)] if inputs is None else inputs.float()
    streams = x[:, None, :].repeat(1, hc, 1)  # [S, n, D]
    pre_mix = torch.zeros(s_len, hc)
    pre_mix[:, 0] = 1.0
    entries: dict[int, torch.Tensor] = {}
    keys: dict[int, torch.Tensor] = {}
    selection: torch.Tensor | None = None
    candidates: torch.Tensor | None = None
    selections: dict[int, torch.Tensor] = {}

    def mixes(st: torch.Tensor, p: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        fl = rms(st.flatten(1), None, eps)
        m = fl @ sd[p + ".fn"].T
        base, scale = sd[p + ".base"], sd[p + ".scale"]
        pre = torch.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + c.hc_eps
        post = 2 * torch.sigmoid(m[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
        comb = torch.softmax((m[:, 2 * hc :] * scale[2] + base[2 * hc :]).view(-1, hc, hc), -1) + c.hc_eps
        return pre, post, sinkhorn(comb, c.hc_sinkhorn_iters, c.hc_eps)

    for layer in range(c.num_hidden_layers):
        p = f"model.layers.{layer}."
        a = p + "self_attn."
        r = c.compress_ratios[layer]
        f = f_main if r == 0 else f_comp
        attn_pre, attn_post, attn_comb = mixes(streams, p + "attn_hc")
        xin = rms((pre_mix[:, :, None] * streams).sum(1), sd[p + "input_layernorm.weight"], eps)
        q_res = rms(xin @ sd[a + "q_a_proj.weight"].T, sd[a + "q_a_norm.weight"], eps)
        q = rope((q_res @ sd[a + "q_b_proj.weight"].T).view(s_len, c.num_attention_heads, c.head_dim), pos, f)
        kv = fq_fp8(rope(rms(xin @ sd[a + "kv_proj.weight"].T, sd[a + "kv_norm.weight"], eps), pos, f), q8)
        if layer in c.kv_source_layer_ids:
            n_g = s_len // r
            kvp = xin @ sd[a + "compressor.kv_proj.weight"].T
            lat = []
            for g in range(n_g):
                rows = kvp[g * r : g * r + r]
                if r > 1:
                    gate = xin[g * r : g * r + r] @ sd[a + "compressor.gate_proj.weight"].T
                    lat.append((rows * torch.softmax(gate, 0)).sum(0))
                else:
                    lat.append(rows[0])
            latent = rms(torch.stack(lat), sd[a + "compressor.kv_norm.weight"], eps)
            gpos = torch.arange(n_g) * r
            k = rms(latent @ sd[a + "indexer.k_proj.weight"].T, sd[a + "indexer.k_norm.weight"], eps)
            keys[layer] = fq_mxfp4(rope(k, gpos, f_comp), q8)
            entries[layer] = fq_fp4(rope(latent, gpos, f_comp), q8)
        if r:
            src = max(s for s in c.kv_source_layer_ids if s <= layer)
            n = entries[src].shape[0]
            visible = torch.arange(n)[None, :] < ((pos + 1) // r)[:, None]  # [S, N]
            if layer in c.index_source_layer_ids:
                hi, di = c.index_n_heads, c.index_head_dim
                qi = rope((q_res @ sd[a + "indexer.q_b_proj.weight"].T).view(s_len, hi, di), pos, f_comp)
                qi = fq_mxfp4(qi, q8)
                wts = (xin @ sd[a + "indexer.weights_proj.weight"].T) * hi**-0.5
                dots = torch.relu(torch.einsum("shd,nd->shn", qi, keys[src])) * di**-0.5
                sc = (dots * wts[:, :, None]).sum(1).masked_fill(~visible, float("-inf"))
                if layer == c.candidate_source_layer_id:
                    bs, nb = c.candidate_block_size, -(-n // c.candidate_block_size)
                    blk = F.pad(sc, (0, nb * bs - n), value=float("-inf")).view(s_len, nb, bs).amax(-1)
                    newest = ((pos + 1) // r - 1) // bs
                    for t in range(s_len):
                        if newest[t] >= 0:
                            blk[t, newest[t]] = float("inf")
                    keep = topk_mask(blk, c.candidate_topk_blocks)
                    candidates = keep.repeat_interleave(bs, -1)[:, :n]
                elif 0 <= c.candidate_source_layer_id < layer and candidates is not None:
                    sc = sc.masked_fill(~candidates[:, :n], float("-inf"))
                selection = topk_mask(sc, c.index_topk)
                selections[layer] = selection
            comp_mask = selection if selection is not None else torch.zeros(s_len, n, dtype=torch.bool)
            ck = entries[src]
        else:
            comp_mask, ck = torch.zeros(s_len, 0, dtype=torch.bool), torch.zeros(0, c.head_dim)
        win = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - w_len)  # [S(q), S(k)]
        keys_all = torch.cat([kv, ck], 0)  # [S + N, D]
        mask = torch.cat([win, comp_mask], 1)
        logits = torch.einsum("shd,kd->hsk", q, keys_all) * c.head_dim**-0.5
        logits = logits.masked_fill(~mask[None], float("-inf"))
        sink = sd[a + "sinks"].view(-1, 1, 1).expand(-1, s_len, 1)
        probs = torch.softmax(torch.cat([logits, sink], -1), -1)[..., :-1]
        o = rope(torch.einsum("hsk,kd->shd", probs, keys_all), pos, f, sign=-1.0)
        g = c.o_groups
        wa = sd[a + "o_a_proj.weight"].view(g, -1, o.shape[-1] * o.shape[-2] // g)
        z = torch.einsum("sgi,goi->sgo", o.reshape(s_len, g, -1), wa).reshape(s_len, -1)
        attn_out = z @ sd[a + "o_b_proj.weight"].T
        streams = attn_post[:, :, None] * attn_out[:, None, :] + torch.einsum(
            "sjk,sjd->skd", attn_comb, streams
        )

        ffn_pre, ffn_post, ffn_comb = mixes(streams, p + "ffn_hc")
        xf = rms((attn_pre[:, :, None] * streams).sum(1), sd[p + "post_attention_layernorm.weight"], eps)
        m = p + "mlp."
        score = F.softplus(xf @ sd[m + "gate.weight"].T / c.gate_temp).sqrt()
        bias = sd[m + "gate.e_score_correction_bias"].expand(s_len, -1)
        if image_rows is not None:
            bias = torch.where(image_rows[:, None], sd[m + "gate.e_score_correction_bias_vl"], bias)
        pick = torch.topk(score + bias, c.num_experts_per_tok, -1).indices
        wsel = score.gather(1, pick)
        if c.norm_topk_prob and c.num_experts_per_tok > 1:
            wsel = wsel / (wsel.sum(-1, keepdim=True) + 1e-20)
        wsel = wsel * c.routed_scaling_factor
        lim = c.swiglu_limit
        gu, dn = sd[m + "experts.gate_up_proj"], sd[m + "experts.down_proj"]
        inter = dn.shape[-1]
        y = torch.zeros_like(xf)
        for t in range(s_len):
            for j in range(pick.shape[1]):
                e = int(pick[t, j])
                h = gu[e] @ xf[t]
                act = F.silu(h[:inter].clamp(max=lim)) * h[inter:].clamp(-lim, lim)
                y[t] += dn[e] @ (wsel[t, j] * act)
        sh = F.silu((xf @ sd[m + "shared_experts.gate_proj.weight"].T).clamp(max=lim))
        sh = sh * (xf @ sd[m + "shared_experts.up_proj.weight"].T).clamp(-lim, lim)
        y = y + sh @ sd[m + "shared_experts.down_proj.weight"].T
        streams = ffn_post[:, :, None] * y[:, None, :] + torch.einsum("sjk,sjd->skd", ffn_comb, streams)
        pre_mix = ffn_pre
    hidden = rms((pre_mix[:, :, None] * streams).sum(1), sd["model.norm.weight"], eps)
    return hidden @ sd["lm_head.weight"].T, selections
