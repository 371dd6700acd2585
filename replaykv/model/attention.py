"""DeepSeek-V4 attention: shared-KV MQA over a sliding window plus compressed entries, with sinks.

Every query attends jointly (one softmax, plus a per-head sink logit) to its window keys and to
its visible compressed entries: all of them for dense (HCA) layers, the indexer's top-k for
sparse (CSA) layers. The kernel works on blocks of queries and gathers each block's keys, so no
[S, S] or [S, S/r] tensor is ever built; memory grows linearly with the sequence.

Not for: allocating caches (the caller passes a :class:`LayerCacheView`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from replaykv.model import fused, native
from replaykv.model.cache_view import LayerCacheView
from replaykv.model.compressor import (
    Compressor,
    causal_entry_limit,
    ordered_ring,
    scatter_entries,
    topk_lowest_index,
    write_ring,
)
from replaykv.model.config import DeepseekV4Config
from replaykv.model.layers import (
    MIN_GEMM_ROWS,
    VECTOR_RUN,
    Linear,
    RMSNorm,
    cast,
    linears,
    native_weight,
    rowwise,
    unweighted_rms_norm,
)
from replaykv.model.rope import apply_rope
from replaykv.model.step import Step

# Upper bound on the elements of one block's logits / gathered keys (keeps peak memory flat).
_BLOCK_BUDGET = 1 << 22
# Training scores a sparse layer's block densely (all visible entries, the unselected masked)
# while the visible entries number at most this many times the selected ones: at 128 queries,
# 4 heads, 64 of them selected, forward + backward took 0.25× the per-query gathers at 128
# visible entries, 0.54× at 256, 0.87× at 512 and 2.3× at 1,024.
_DENSE_SELECTION = 8


# The lightning indexers score a block of queries against its visible entries in slices of this
# many entries, each slice's products taken through the ReLU and the head sum while they are in
# cache (one [Q·H, 32K] product for a block of 32 queries took 1.5× the time of eight slices).
# Slices start at entry 0 in every call, so every path scores an entry in the same slice.
INDEX_SLICE = 4096


def sliced_scores(
    score: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    q: torch.Tensor,
    w: torch.Tensor,
    keys: torch.Tensor,
) -> torch.Tensor:
    """score(q, w, keys[:, c0:c1]) -> [..., c1 - c0] over `INDEX_SLICE` slices of the entries
    keys [B, N, Di], joined along the last axis -> [..., N]."""
    n = keys.shape[1]
    if n <= INDEX_SLICE:
        return score(q, w, keys)
    starts = list(range(0, n, INDEX_SLICE))
    if n - starts[-1] < MIN_GEMM_COLS:  # a narrow last slice joins the one before (see index_dots)
        starts.pop()
    ends = [*starts[1:], n]
    return torch.cat([score(q, w, keys[:, c0:c1]) for c0, c1 in zip(starts, ends, strict=True)], dim=-1)


def row_stable_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, M, K] @ b [B, K, N] with fewer than MIN_GEMM_ROWS rows padded (by repeating the
    first) as in `linear`, so a row's value does not depend on how many rows came with it."""
    m = a.shape[1]
    if m >= MIN_GEMM_ROWS or m == 0:
        return torch.matmul(a, b)
    padded = torch.cat([a, a[:, :1].expand(-1, MIN_GEMM_ROWS - m, -1)], dim=1)
    return torch.matmul(padded, b)[:, :m]


# BLAS computes a product of fewer than this many columns with other kernels than a wider one
# (on an AVX2 machine, 11 columns or fewer round differently); narrower key sets are padded.
MIN_GEMM_COLS = 16


def index_dots(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [B, Q, H, Di] . keys [B, N, Di] -> [B, Q*H, N], rows (`row_stable_bmm`) and columns
    (zero keys, dropped) padded so a query's score of an entry depends on neither the block it
    was scored in nor how many entries were scored with it."""
    b, nq, h, di = q.shape
    n = keys.shape[1]
    if n == 0 or n >= MIN_GEMM_COLS:
        return row_stable_bmm(q.reshape(b, nq * h, di), keys.transpose(1, 2))
    keys = F.pad(keys, (0, 0, 0, MIN_GEMM_COLS - n))
    return row_stable_bmm(q.reshape(b, nq * h, di), keys.transpose(1, 2))[..., :n]


def head_sum(dots: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_h w_h · dots_h: dots [B, Q, H, N], w [B, Q, H] -> [B, Q, N]. A product and a sum over
    heads, not a [1, H] @ [H, N] product per query, whose rounding depends on N on some CPUs
    (AVX512): an entry's score stays the same in any slice. In place into `dots` unless
    autograd differentiates through it (training)."""
    grad = dots.requires_grad or w.requires_grad
    return (dots * w[..., None] if grad else dots.mul_(w[..., None])).sum(dim=2)


class IndexScorer(nn.Module):
    """Holds the per-head weight projection of the indexer (`scorer.weights_proj`)."""

    def __init__(self, hidden: int, n_heads: int) -> None:
        super().__init__()
        self.weights_proj = Linear(hidden, n_heads)


class Indexer(nn.Module):
    """DeepSeek-V4 lightning indexer: its own overlapping compressor at index_head_dim, ReLU-scored
    multi-head keys, top-k per query (ties to the lower entry). Parameters (transformers names):
    kv_proj, gate_proj, position_bias, kv_norm (kept here under `key_compressor`), q_b_proj,
    scorer.weights_proj."""

    def __init__(self, config: DeepseekV4Config, ratio: int) -> None:
        super().__init__()
        self.ratio = ratio
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.topk = config.index_topk
        self.key_compressor = Compressor(
            config.hidden_size, self.head_dim, ratio, overlap=True, eps=config.rms_norm_eps
        )
        self.q_b_proj = Linear(config.q_lora_rank, self.n_heads * self.head_dim)
        self.scorer = IndexScorer(config.hidden_size, self.n_heads)

    def _scores(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """sum_h w_h · relu(q_h · k): q [B, Q, H, Di], w [B, Q, H], keys [B, N, Di] -> [B, Q, N]."""
        b, nq, h, _ = q.shape
        dots = F.relu_(index_dots(q, keys)).view(b, nq, h, keys.shape[1])
        return head_sum(dots, w)

    def select(
        self, x: torch.Tensor, q_res: torch.Tensor, keys: torch.Tensor, step: Step, rope_kind: str
    ) -> torch.Tensor:
        """Top-k compressed entries per query, -1 where fewer are visible.

        x [B, S, hidden], q_res [B, S, q_lora], keys [B, N, Di] (rotated) -> [B, S, topk].
        """
        b, s, _ = x.shape
        k = self.topk  # a fixed width (-1 padded): attention reductions do not depend on the call
        q = self.q_b_proj(q_res).view(b, s, self.n_heads, self.head_dim)
        q = apply_rope(q, *step.rope.heads(rope_kind)).float()
        # Head weights with the score scale folded in: sum_h w_h * relu(q_h . k) / sqrt(Di).
        w = self.scorer.weights_proj(x).float() * (self.n_heads**-0.5 * self.head_dim**-0.5)
        limit = causal_entry_limit(step.positions, self.ratio)  # [B, S]
        keys_f = keys.float()
        if native.usable(q, w, keys_f):  # scores, mask and top-k in one native pass, no [Q, N] scores
            return native.index_topk(q, w, keys_f[:, : step.visible_entries(self.ratio, s - 1)], limit, k)
        out = torch.full((b, s, k), -1, dtype=torch.long, device=x.device)
        for i0, i1, n_vis in step.entry_blocks(self.ratio, b * self.n_heads, _BLOCK_BUDGET):
            if n_vis > 0:
                scores = sliced_scores(self._scores, q[:, i0:i1], w[:, i0:i1], keys_f[:, :n_vis])  # [B, Q, N]
                lim = limit[:, i0:i1, None]
                lo = step.common_entries(self.ratio, i0)  # entries [0, lo) are visible to all
                if lo < n_vis:
                    tail = torch.arange(lo, n_vis, device=x.device) >= lim
                    scores[..., lo:].masked_fill_(tail, float("-inf"))
                idx = topk_lowest_index(scores, min(k, n_vis))
                out[:, i0:i1, : idx.shape[-1]] = idx.masked_fill_(idx >= lim, -1)
        return out


def joint_attention(
    q: torch.Tensor,
    win_keys: torch.Tensor,
    step: Step,
    window: int,
    sinks: torch.Tensor,
    entries: torch.Tensor | None = None,
    ratio: int = 0,
    selection: torch.Tensor | None = None,
    ring_first: torch.Tensor | None = None,
) -> torch.Tensor:
    """One softmax over window keys, visible compressed entries and the sink.

    q: [B, S, H, D] rotated queries; query i (position p + i) reads window rows j in [i, i + W - 1].
    win_keys: [B, W-1+S, D] window keys; row j sits at position p - W + 1 + j. With `ring_first`
    [B], a ring [B, R, D] instead, whose slot (ring_first + j) % R holds row j (a decode step reads
    the cache's window in place).
    sinks: [H] float32. entries: [B, N, D] compressed entries (or None) of a layer with `ratio`;
    selection: [B, S, k] selected entry ids (-1 = none) for sparse layers, None for dense layers.
    Returns [B, S, H, D]. On CPU float32 without autograd one native pass per query
    (`native.joint_attention`); otherwise queries go in blocks of about one window, so each
    block reads at most 2W - 1 window rows and the visible prefix of the entries.
    """
    b, s, h, d = q.shape
    w = window
    scale = d**-0.5
    all_ok = step.window_unclipped(w)
    key_ok = None  # [B, W-1+S]: which window rows are readable, needed only when some are not
    if not all_ok:
        win_pos = step.start[:, None] + torch.arange(1 - w, s, device=q.device)
        key_ok = win_pos >= step.floors[:, None].clamp(min=0)
    if entries is not None and entries.shape[1] == 0:
        entries = None  # nothing is visible yet (an all -inf branch adds exactly nothing)
    limit = None if entries is None else causal_entry_limit(step.positions, ratio)
    # With gradients (training), a block's queries score all its 2W - 1 window rows in one GEMM and
    # mask the rows outside each query's W: twice the products, several times faster forward and
    # backward than W-row reads per query, the same result up to float rounding. Without (every
    # engine path), each query reads exactly its own W rows.
    band = torch.is_grad_enabled() and (q.requires_grad or win_keys.requires_grad)
    if not band:  # CPU float32 inference: one native pass per query
        fast = native.joint_attention(
            q, win_keys, key_ok, sinks, entries, limit, selection, w, scale, ring_first
        )
        if fast is not None:
            return fast
    if ring_first is not None:  # the rows in order: slot (ring_first + j) % R is row j
        win_keys = ordered_ring(win_keys, ring_first + w - 1 + s, w - 1 + s)
    out = torch.empty_like(q)
    n_sel = 0 if selection is None else selection.shape[-1]
    q_step = min(s, max(w, 64))
    if selection is not None:
        q_step = max(1, min(q_step, _BLOCK_BUDGET // max(1, b * n_sel * d)))
    sink = sinks.float().view(1, 1, h)
    fused_blocks = band and fused.enabled()  # the training-only forms (replaykv.model.fused)
    if band:  # [Q, Q+W-1]: True where row j lies outside query i's window rows [i, i + W - 1]
        rows = torch.arange(q_step + w - 1, device=q.device)
        outside = (rows < rows[:q_step, None]) | (rows >= rows[:q_step, None] + w)
    # Without gradients, a dense layer's blocks end where a query sees one more entry, so every
    # query reduces over exactly its own visible entries (a decode step's width): with the
    # padded products below, its row does not depend on the block or the chunk it ran in.
    split = ratio if (entries is not None and selection is None and not band) else 0
    # ... and every exponential runs in the same vector code for a row whatever rows come with it
    exp = torch.exp if band else functools.partial(rowwise, torch.exp)
    for i0, i1 in _query_blocks(step, s, q_step, split):
        nq = i1 - i0
        qb = q[:, i0:i1]  # [B, Q, H, D]
        if fused_blocks:  # training with the fused forms: the block as one compiled function
            kw = win_keys[:, i0 : i1 + w - 1]
            band_out = outside[:nq, : nq + w - 1]
            mask = band_out[None] if key_ok is None else band_out[None] | ~key_ok[:, None, i0 : i1 + w - 1]
            kc, entry_masked, gathered = _block_entries(
                qb, step, entries, limit, ratio, selection, i0, i1, n_sel
            )
            out[:, i0:i1] = fused.attend_block(qb, kw, mask, sink, kc, entry_masked, scale, gathered)
            continue
        if band:
            kw = win_keys[:, i0 : i1 + w - 1]  # [B, Q+W-1, D]
            lw = torch.matmul(qb.reshape(b, nq * h, d), kw.transpose(1, 2)).float().mul_(scale)
            lw = lw.view(b, nq, h, nq + w - 1)
            band_out = outside[:nq, : nq + w - 1]  # a shorter last block: the same top-left corner
            mask = band_out[None] if key_ok is None else band_out[None] | ~key_ok[:, None, i0 : i1 + w - 1]
            lw = lw.masked_fill_(mask[:, :, None], float("-inf"))
        else:
            # Every query reads exactly its W window keys, in position order, with fixed-size
            # reductions: the result of a query does not depend on how the sequence was chunked.
            kw = win_keys[:, i0 : i1 + w - 1].unfold(1, w, 1).contiguous()  # [B, Q, D, W]
            lw = torch.matmul(qb, kw).float().mul_(scale)  # [B, Q, H, W]
            if key_ok is not None:
                ok = key_ok[:, i0 : i1 + w - 1].unfold(1, w, 1)  # [B, Q, W]
                lw = lw.masked_fill_(~ok[:, :, None], float("-inf"))
        mx = torch.maximum(lw.amax(dim=-1), sink)  # [B, Q, H]
        lc = kc = None
        if entries is not None and limit is not None:
            if selection is None:
                n = step.visible_entries(ratio, i1 - 1)
                kc = entries[:, :n]
                pad = 0 if band else -n % VECTOR_RUN
                if pad:  # a width of whole vector runs (see `rowwise`), the padding read as no entry
                    kc = F.pad(kc, (0, 0, 0, pad))
                lc = index_dots(qb, kc).view(b, nq, h, n + pad).float()  # rows padded: see `split`
                lc = lc.mul_(scale)
                lo = step.common_entries(ratio, i0)  # entries [0, lo) are visible to all
                if n > lo:
                    hide = torch.arange(lo, n, device=q.device) >= limit[:, i0:i1, None]  # [B, Q, N-lo]
                    lc[..., lo:n].masked_fill_(hide[:, :, None], float("-inf"))
                if pad:
                    lc[..., n:] = float("-inf")
            else:
                sel = selection[:, i0:i1]
                kc = entries.gather(1, sel.clamp(min=0).flatten(1)[..., None].expand(-1, -1, d))
                kc = kc.view(b * nq, -1, d)
                lc = torch.bmm(qb.reshape(b * nq, h, d), kc.transpose(1, 2)).view(b, nq, h, -1).float()
                lc = lc.mul_(scale).masked_fill_((sel < 0)[:, :, None], float("-inf"))
            if lc.shape[-1]:
                mx = torch.maximum(mx, lc.amax(dim=-1))
        pw = exp(lw - mx[..., None])
        den = pw.sum(dim=-1) + exp(sink - mx)
        if band:
            o = torch.matmul(cast(pw, q.dtype).view(b, nq * h, -1), kw).view(b, nq, h, d)
        else:
            o = torch.matmul(cast(pw, q.dtype), kw.transpose(-1, -2))  # [B, Q, H, D]
        if lc is not None and kc is not None and lc.shape[-1]:
            pc = exp(lc - mx[..., None])
            den = den + pc.sum(dim=-1)
            if selection is None:
                o = o + row_stable_bmm(cast(pc, q.dtype).view(b, nq * h, -1), kc).view(b, nq, h, d)
            else:
                o = o + torch.bmm(cast(pc, q.dtype).view(b * nq, h, -1), kc).view(b, nq, h, d)
        out[:, i0:i1] = o / cast(den[..., None], q.dtype)
    return out


def _query_blocks(step: Step, s: int, q_step: int, ratio: int) -> list[tuple[int, int]]:
    """Blocks [i0, i1) of at most q_step queries; with `ratio`, also cut before every query at
    which some row's visible entries grow (position p + i with (p + i + 1) % ratio == 0)."""
    cuts = set(range(0, s, q_step))
    if ratio:
        for p in set(step.start_host):
            cuts.update(range((-(p + 1)) % ratio, s, ratio))
    edges = [*sorted(cuts - {0}), s]
    return list(zip([0, *edges[:-1]], edges, strict=True))


def _block_entries(
    qb: torch.Tensor,
    step: Step,
    entries: torch.Tensor | None,
    limit: torch.Tensor | None,
    ratio: int,
    selection: torch.Tensor | None,
    i0: int,
    i1: int,
    n_sel: int,
) -> tuple[torch.Tensor | None, torch.Tensor | None, bool]:
    """The compressed entries a training block of queries [i0, i1) reads, with their mask (True:
    not read) and whether they are gathered per query: all visible entries of a dense layer; of a
    sparse layer the visible ones masked to the selection while they number at most
    `_DENSE_SELECTION` times the selected, else each query's selected entries gathered."""
    if entries is None or limit is None:
        return None, None, False
    b, nq, d = qb.shape[0], i1 - i0, entries.shape[-1]
    n = step.visible_entries(ratio, i1 - 1)
    if selection is None or n <= _DENSE_SELECTION * n_sel:
        if n == 0:
            return None, None, False
        if selection is None:
            masked = torch.arange(n, device=qb.device) >= limit[:, i0:i1, None]  # [B, Q, N]
        else:
            sel = selection[:, i0:i1]
            picked = torch.zeros(b, nq, n + 1, dtype=torch.bool, device=qb.device)
            masked = ~picked.scatter_(-1, sel.masked_fill(sel < 0, n), True)[..., :n]
        return entries[:, :n], masked, False
    sel = selection[:, i0:i1]
    if sel.shape[-1] == 0:
        return None, None, False
    kc = entries.gather(1, sel.clamp(min=0).flatten(1)[..., None].expand(-1, -1, d)).view(b * nq, -1, d)
    return kc, sel < 0, True


def grouped_projection(
    o: torch.Tensor, weight: torch.Tensor, groups: int, owner: nn.Module | None = None
) -> torch.Tensor:
    """The block-diagonal first half of the output projection: heads in `groups` contiguous
    groups, each projected by its slice of `weight` [G·o_lora, H·D/G]. o [B, S, H, D] ->
    [B, S, G·o_lora]. Natively as `linear` where `native.usable` (the kernel's form of the
    weight kept on `owner`), else with few rows padded as in `linear`."""
    b, s = o.shape[:2]
    wg = weight.view(groups, -1, weight.shape[-1])  # [G, o_lora, H*D/G]
    if owner is not None and (wt := native_weight(owner, wg, "_grouped_native")) is not None:
        out = native.linear(o.reshape(b, s, groups, -1), wg, wt)
        if out is not None:
            return out.view(b, s, -1)
    grouped = o.reshape(b * s, groups, -1)
    if b * s < MIN_GEMM_ROWS:
        grouped = torch.cat([grouped, grouped[:1].expand(MIN_GEMM_ROWS - b * s, -1, -1)])
    wa = weight.view(groups, -1, grouped.shape[-1])  # [G, o_lora, H*D/G]
    return torch.bmm(grouped.transpose(0, 1), wa.transpose(1, 2)).transpose(0, 1)[: b * s].reshape(b, s, -1)


class Attention(nn.Module):
    """One DeepSeek-V4 attention block (transformers' parameter names under `self_attn.`)."""

    def __init__(self, config: DeepseekV4Config, layer: int) -> None:
        super().__init__()
        self.config = config
        self.layer = layer
        self.n_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.window = config.sliding_window
        self.ratio = config.compress_ratio(layer)
        self.rope_kind = "main" if self.ratio == 0 else "compress"
        hidden, d, h = config.hidden_size, config.head_dim, config.num_attention_heads
        self.q_a_proj = Linear(hidden, config.q_lora_rank)
        self.q_a_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = Linear(config.q_lora_rank, h * d)
        self.kv_proj = Linear(hidden, d)
        self.kv_norm = RMSNorm(d, config.rms_norm_eps)
        self.o_groups = config.o_groups
        self.o_a_proj = Linear(h * d // config.o_groups, config.o_groups * config.o_lora_rank)
        self.o_b_proj = Linear(config.o_groups * config.o_lora_rank, hidden)
        self.sinks = nn.Parameter(torch.zeros(h, dtype=torch.float32))
        self.compressor: Compressor | None = None
        self.indexer: Indexer | None = None
        if self.ratio:
            overlap = config.has_indexer(layer)
            self.compressor = Compressor(hidden, d, self.ratio, overlap=overlap, eps=config.rms_norm_eps)
            if overlap:
                self.indexer = Indexer(config, self.ratio)

    def compress(
        self, compressor: Compressor, x: torch.Tensor, step: Step, cache: LayerCacheView, index: bool
    ) -> None:
        """Pool the groups that complete in this call, rotate them at their first position, store."""
        carry = cache.index_carry if index else cache.carry
        store = cache.index_keys if index else cache.entries
        assert store is not None
        latents, first, count = compressor.pool(x, step, carry)
        if latents.shape[1]:
            groups = torch.tensor(first, device=x.device)[:, None] + torch.arange(
                latents.shape[1], device=x.device
            )
            cos, sin = step.rope.at("compress", groups * self.ratio)
            scatter_entries(store, apply_rope(latents, cos, sin), first, count)

    def forward(self, x: torch.Tensor, step: Step, cache: LayerCacheView) -> torch.Tensor:
        """x [B, S, hidden] (normed) -> [B, S, hidden]."""
        b, s, _ = x.shape
        h, d, w = self.n_heads, self.head_dim, self.window
        cos, sin = step.rope[self.rope_kind]
        cos_h, sin_h = step.rope.heads(self.rope_kind)

        q_a, kv_a = linears(x, self, self.q_a_proj.weight, self.kv_proj.weight)  # one product
        q_res = self.q_a_norm(q_a)
        q = self.q_b_proj(q_res).view(b, s, h, d)
        q = unweighted_rms_norm(q, self.config.rms_norm_eps)
        q = apply_rope(q, cos_h, sin_h)

        kv = apply_rope(self.kv_norm(kv_a), cos, sin)  # [B, S, D]
        ring_first = None
        if s == 1:  # decode: write the slot, then read the window (in place where its dtype allows)
            slots = step.start.remainder(w)
            cache.window[torch.arange(b, device=x.device), slots] = cast(kv[:, 0], cache.window.dtype)
            if cache.window.dtype == kv.dtype:
                win_keys, ring_first = cache.window, step.start + 1 - w
            else:
                win_keys = cast(ordered_ring(cache.window, step.start + 1, w), kv.dtype)
        else:
            win_keys = torch.cat([cast(ordered_ring(cache.window, step.start, w - 1), kv.dtype), kv], dim=1)
            write_ring(cache.window, kv, step.start)

        entries = selection = None
        if self.compressor is not None:
            assert cache.entries is not None
            writing = step.global_rows
            if writing is not None:
                self.compress(self.compressor, x[:, step.global_from :], writing, cache, index=False)
            n = max((p + s) // self.ratio for p in step.start_host)
            entries = cast(cache.entries[:, :n], q.dtype)
            if self.indexer is not None:
                assert cache.index_keys is not None
                if writing is not None:
                    self.compress(
                        self.indexer.key_compressor, x[:, step.global_from :], writing, cache, index=True
                    )
                selection = self.indexer.select(x, q_res, cache.index_keys[:, :n], step, self.rope_kind)

        o = joint_attention(q, win_keys, step, w, self.sinks, entries, self.ratio, selection, ring_first)
        o = apply_rope(o, cos_h, sin_h, inverse=True)
        return self.o_b_proj(grouped_projection(o, self.o_a_proj.weight, self.o_groups, self.o_a_proj))
