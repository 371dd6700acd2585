"""Replay paths measured side by side on a DeepSeek-V4.1-shaped model (the released 20 + 20
layer schedule, reduced widths, 128-token window), one process.

(a) Decoder replay: prefill throughput of a batch of prompts with decoder replay on versus off
    (layer-token bound: full work / trimmed work).
(b) A cached prefix + new tokens with the SWA snapshot missing: time to first token of every
    miss strategy and of a full hit, and the recovery work alone (each TTFT minus the hit's),
    against each path's layer×token bound.

    python bench/bench_replay.py [--prompts 8 --tokens 8192] [--prefix 32768 --new 256]
        [--skip-a] [--skip-b] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import replace_section

from replaykv.cache.views import allocate_view
from replaykv.engine.runner import execute
from replaykv.engine.scenario import drop_snapshot
from replaykv.model.cache_view import CacheView, CompressorCarry, LayerCacheView
from replaykv.model.init import init_weights
from replaykv.model.presets_v41 import v41_flash
from replaykv.model.spec import ModelSpec
from replaykv.model.v41 import DeepseekV41ForCausalLM
from replaykv.replay import CacheState, ReplayFlags, plan_prefill

MARK_BEGIN = "<!-- bench_replay:begin -->"
MARK_END = "<!-- bench_replay:end -->"


def bench_config():  # type: ignore[no-untyped-def]
    """The released V4.1-Flash schedule (40 layers: 2 window-only, 18 ratio-2, 20 ratio-1; sources
    2/8/14/20; Reindex 24/28/32/36; candidate source 20) at reduced widths."""
    return v41_flash().replace(
        vocab_size=512, hidden_size=128, num_attention_heads=2, head_dim=64, q_lora_rank=64,
        qk_rope_head_dim=16, o_groups=1, o_lora_rank=32, index_n_heads=2, index_head_dim=32,
        index_topk=64, candidate_topk_blocks=64, candidate_block_size=8, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=64, hc_mult=2, rms_norm_eps=1e-6,
        max_position_embeddings=262144,
    )  # fmt: skip


def clone_view(view: CacheView) -> CacheView:
    """A deep copy that keeps Reuse layers aliased to their source's tensors."""
    memo: dict[int, torch.Tensor] = {}

    def c(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        if id(t) not in memo:
            memo[id(t)] = t.clone()
        return memo[id(t)]

    layers = []
    for lc in view.layers:
        layers.append(
            LayerCacheView(
                window=c(lc.window),  # type: ignore[arg-type]
                entries=c(lc.entries),
                carry=None if lc.carry is None else CompressorCarry(c(lc.carry.kv), c(lc.carry.gate)),  # type: ignore[arg-type]
                index_keys=c(lc.index_keys),
            )
        )
    return CacheView(positions=view.positions.clone(), layers=layers)


def bench_decoder_replay(model: DeepseekV41ForCausalLM, prompts: int, tokens: int) -> list[str]:
    spec = ModelSpec.from_config(model.config)
    gen = torch.Generator().manual_seed(0)
    batch = [torch.randint(0, model.config.vocab_size, (1, tokens), generator=gen) for _ in range(prompts)]
    times = {}
    plans = {}
    for dec in (False, True):
        flags = ReplayFlags(enable_decoder_swa_bounded_replay=dec)
        plan = plan_prefill(CacheState(tokens=tokens), spec, flags)
        plans[dec] = plan
        t0 = time.perf_counter()
        for ids in batch:
            execute(model, plan, ids, allocate_view(spec, 1, tokens))
        times[dec] = time.perf_counter() - t0
    bound = plans[False].work / plans[True].work
    speed = times[False] / times[True]
    return [
        f"(a) Decoder replay, {prompts} prompts × {tokens:,} tokens (cold prefills, decoder after layer "
        f"{spec.decoder_cut}):",
        "",
        "| | replay off | replay on | ratio |",
        "|---|---:|---:|---:|",
        f"| layer·tokens per prompt | {plans[False].work:,} | {plans[True].work:,} | {bound:.2f}× (bound) |",
        f"| prefill time (all prompts) | {times[False]:.1f} s | {times[True]:.1f} s | {speed:.2f}× |",
        f"| prefill throughput | {prompts * tokens / times[False]:,.0f} tok/s | "
        f"{prompts * tokens / times[True]:,.0f} tok/s | {speed:.2f}× |",
        "",
    ]


def bench_miss_paths(model: DeepseekV41ForCausalLM, prefix: int, new: int) -> list[str]:
    spec = ModelSpec.from_config(model.config)
    total = prefix + new
    ids = torch.randint(0, model.config.vocab_size, (1, total), generator=torch.Generator().manual_seed(1))
    earlier = plan_prefill(CacheState(tokens=prefix), spec, ReplayFlags())
    base = allocate_view(spec, 1, total)
    t0 = time.perf_counter()
    execute(model, earlier, ids[:, :prefix], base)
    t_prefix = time.perf_counter() - t0
    rows = []
    cases = [
        ("hit", None),
        ("bounded", "bounded"),
        ("exact", "exact"),
        ("truncate", "truncate"),
        ("full", "full"),
    ]
    for name, strategy in cases:
        view = clone_view(base)
        if strategy is None:
            state, flags = CacheState(total, prefix, (prefix,)), ReplayFlags()
        else:
            drop_snapshot(view)
            state, flags = CacheState(total, prefix, ()), ReplayFlags(swa_miss_strategy=strategy)
        plan = plan_prefill(state, spec, flags)
        t0 = time.perf_counter()
        execute(model, plan, ids, view)
        rows.append((name, plan, time.perf_counter() - t0))
    hit_plan, hit_t = rows[0][1], rows[0][2]
    full_plan, full_t = rows[-1][1], rows[-1][2]
    per_work = (full_t - hit_t) / max(1, full_plan.work - hit_plan.work)  # seconds per extra layer·token
    per_work_deep = hit_t / max(1, hit_plan.work)  # seconds per layer·token of rows at the prefix's end
    lines = [
        f"(b) {prefix:,}-token cached prefix + {new} new tokens, decoder replay on (the earlier request's "
        f"prefill took {t_prefix:.1f} s). Recovery = TTFT − the hit's. Bound A = the path's extra "
        "layer·tokens × the full path's seconds per extra layer·token (rows at every depth, on average "
        "half the prefix); bound B = the extra layer·tokens × the hit's seconds per layer·token (rows "
        f"at depth {prefix:,}, where every replayed or rebuilt row is: an index source scores each row "
        "against every entry before it, so a row's cost grows with its depth).",
        "",
        "| path | layer·tokens | extra over hit | TTFT | recovery | bound A | recovery / A | bound B | recovery / B |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, plan, t in rows:
        extra = plan.work - hit_plan.work
        rec = t - hit_t
        bound, deep = extra * per_work, extra * per_work_deep
        ratio = "—" if name in ("hit", "full") or bound <= 0 else f"{rec / bound:.2f}"
        ratio_b = "—" if name == "hit" or deep <= 0 else f"{rec / deep:.2f}"
        lines.append(
            f"| {name} | {plan.work:,} | {extra:,} | {t:.2f} s | {rec:.2f} s | {bound:.2f} s | {ratio} "
            f"| {deep:.2f} s | {ratio_b} |"
        )
    exact = next(p for n, p, _ in rows if n == "exact")
    bounded = next(p for n, p, _ in rows if n == "bounded")
    t_exact = next(t for n, _, t in rows if n == "exact") - hit_t
    t_bounded = next(t for n, _, t in rows if n == "bounded") - hit_t
    lines += [
        "",
        f"Encoder bounded replay adds {bounded.work - hit_plan.work:,} layer·tokens "
        f"({spec.decoder_cut + 1} layers × {spec.sliding_window}); exact replay "  # type: ignore[operator]
        f"{exact.work - hit_plan.work:,} ({(exact.work - hit_plan.work) / max(1, bounded.work - hit_plan.work):.1f}×). "
        f"Measured recovery: bounded {t_bounded:.2f} s, exact {t_exact:.2f} s "
        f"({t_exact / t_bounded if t_bounded > 0 else float('nan'):.1f}× cheaper with bounded).",
        "",
    ]
    return lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--prefix", type=int, default=32768)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--skip-a", action="store_true")
    ap.add_argument("--skip-b", action="store_true")
    ap.add_argument("--write", default="")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = init_weights(DeepseekV41ForCausalLM(bench_config()), seed=0).eval()
    n_params = sum(p.numel() for p in model.parameters())
    lines = [
        MARK_BEGIN,
        "",
        f"DeepSeek-V4.1 schedule at reduced widths ({n_params / 1e6:.1f}M parameters, window 128, KV "
        f"quantisers on), float32, {torch.get_num_threads()} torch thread(s) on {os.cpu_count()} CPU cores, "
        "one process.",
        "",
    ]
    if not args.skip_a:
        lines += bench_decoder_replay(model, args.prompts, args.tokens)
        print("\n".join(lines), flush=True)
    if not args.skip_b:
        lines += bench_miss_paths(model, args.prefix, args.new)
    lines.append(MARK_END)
    table = "\n".join(lines)
    print(table)
    if args.write:
        heading = "## SWA bounded replay\n\n`python bench/bench_replay.py --write docs/benchmarks.md`"
        replace_section(args.write, table, MARK_BEGIN, MARK_END, heading)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
