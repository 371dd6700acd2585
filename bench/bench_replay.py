"""Replay paths measured side by side on a DeepSeek-V4.1-shaped model (the released 20 + 20
layer schedule, reduced widths, 128-token window), one process.

(a) Decoder replay: prefill throughput of a batch of prompts with decoder replay on versus off
    (layer-token bound: full work / trimmed work).
(b) A cached prefix + new tokens with the SWA snapshot missing: time to first token of every
    miss strategy and of a full hit, and the recovery work alone (each TTFT minus the hit's),
    against each path's layer×token bound and against a work model that also counts layer
    passes and the entries the lightning indexers score (fitted to runs that are not recoveries).

    python bench/bench_replay.py [--prompts 8 --tokens 8192] [--prefix 32768 --new 256]
        [--repeats 5] [--calib-tokens 8192] [--skip-a] [--skip-b] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
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
from replaykv.replay import CacheState, PrefillPlan, ReplayFlags, plan_prefill

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


PATHS = ("hit", "bounded", "exact", "truncate", "full")  # the rows of table (b), in order


def work_features(
    model: DeepseekV41ForCausalLM, spec: ModelSpec, plan: PrefillPlan
) -> tuple[int, int, int, int]:
    """(layer passes, layer·tokens, entries scored by source indexers, entries scored by Reindex
    indexers). A layer pass is one layer run over one segment's rows, whatever their number: its
    fixed cost (launching some hundred tensor operations) is what a few rows pay most of.

    Every layer with a lightning indexer scores a row at position p against all (p + 1) // ratio
    compressed entries visible to it; a Reindex layer then masks the scores to the candidate
    source's blocks (more work per entry), so the two kinds are counted apart."""
    kinds: dict[int, int] = {}
    for i, block in enumerate(model.model.layers):
        indexer = getattr(block.self_attn, "indexer", None)
        if indexer is not None:
            kinds[i] = 2 if indexer.uses_candidates else 1
    scored = [0, 0, 0]
    for seg in plan.segments:
        rows = torch.arange(seg.tokens[0] + 1, seg.tokens[1] + 1, dtype=torch.int64)
        for layer in range(*seg.layers):
            if layer in kinds:
                scored[kinds[layer]] += int((rows // spec.layers[layer].ratio).sum())
    passes = sum(seg.layers[1] - seg.layers[0] for seg in plan.segments)
    return passes, plan.work, scored[1], scored[2]


def bench_miss_paths(
    model: DeepseekV41ForCausalLM, prefix: int, new: int, repeats: int, calib_tokens: int
) -> list[str]:
    spec = ModelSpec.from_config(model.config)
    total = prefix + new
    ids = torch.randint(0, model.config.vocab_size, (1, total), generator=torch.Generator().manual_seed(1))
    earlier = plan_prefill(CacheState(tokens=prefix), spec, ReplayFlags())
    base = allocate_view(spec, 1, total)
    t0 = time.perf_counter()
    execute(model, earlier, ids[:, :prefix], base)
    t_prefix = time.perf_counter() - t0

    def miss(strategy: str) -> PrefillPlan:
        return plan_prefill(CacheState(total, prefix, ()), spec, ReplayFlags(swa_miss_strategy=strategy))

    # name -> (plan, tokens it runs over, view, runs); view: "hit" = a copy of the cached prefix,
    # "miss" = the same with the window snapshot dropped, "cold" = an empty one. Cases run in
    # interleaved rounds, so a slow spell of the machine lands on every case alike; each reports
    # its median.
    cases: dict[str, tuple[PrefillPlan, int, str, int]] = {
        "hit": (
            plan_prefill(CacheState(total, prefix, (prefix,)), spec, ReplayFlags()),
            total,
            "hit",
            repeats,
        ),
        "bounded": (miss("bounded"), total, "miss", repeats),
        "exact": (miss("exact"), total, "miss", repeats),
        "truncate": (miss("truncate"), total, "miss", max(1, repeats // 2)),
        "full": (miss("full"), total, "miss", max(1, repeats // 2)),
        # Calibration runs of bound C (below), neither a recovery nor a path of the table:
        "hit, 1 new token": (
            plan_prefill(CacheState(prefix + 1, prefix, (prefix,)), spec, ReplayFlags()),
            prefix + 1,
            "hit",
            repeats,
        ),
        f"cold {calib_tokens:,}-token prefill, decoder replay off": (
            plan_prefill(
                CacheState(tokens=calib_tokens), spec, ReplayFlags(enable_decoder_swa_bounded_replay=False)
            ),
            calib_tokens,
            "cold",
            max(1, repeats // 2),
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(max(n for *_, n in cases.values())):
        for name, (plan, tokens, kind, n) in cases.items():
            if r >= n:
                continue
            view = allocate_view(spec, 1, tokens) if kind == "cold" else clone_view(base)
            if kind == "miss":
                drop_snapshot(view)
            t0 = time.perf_counter()
            execute(model, plan, ids[:, :tokens], view)
            times[name].append(time.perf_counter() - t0)
    median = {name: statistics.median(ts) for name, ts in times.items()}
    rows = [(name, cases[name][0], median[name], cases[name][3]) for name in PATHS]
    hit_plan, hit_t = cases["hit"][0], median["hit"]
    full_plan, full_t = cases["full"][0], median["full"]
    per_work = (full_t - hit_t) / max(1, full_plan.work - hit_plan.work)  # seconds per extra layer·token
    per_work_deep = hit_t / max(1, hit_plan.work)  # seconds per layer·token of rows at the prefix's end
    # Bound C: seconds = d · layer passes + a · layer·tokens + b · source-scored entries + c ·
    # Reindex-scored entries, solved from four runs that are not recoveries: the two calibration
    # cases, the hit and the full path.
    calib_names = [name for name in cases if name not in PATHS]
    feats = {name: work_features(model, spec, plan) for name, (plan, *_) in cases.items()}
    calibration = [(feats[name], median[name]) for name in [*calib_names, "hit", "full"]]
    coef = torch.linalg.lstsq(
        torch.tensor([f for f, _ in calibration], dtype=torch.float64),
        torch.tensor([t for _, t in calibration], dtype=torch.float64),
    ).solution.tolist()
    lines = [
        f"(b) {prefix:,}-token cached prefix + {new} new tokens, decoder replay on (the earlier request's "
        f"prefill took {t_prefix:.1f} s). TTFT is the median of the runs shown. Recovery = TTFT − the "
        "hit's. Bound A = the path's extra layer·tokens × the full path's seconds per extra layer·token "
        "(rows at every depth, on average half the prefix); bound B = the extra layer·tokens × the hit's "
        f"seconds per layer·token (rows at depth {prefix:,}). Neither is exact, because a row's cost "
        "grows with its depth: every layer with a lightning indexer (the sources and the Reindex layers) "
        "scores the row against every compressed entry before it. Bound C counts that work too: "
        "seconds = d · layer passes (one layer over one segment's rows: a fixed cost, whatever the "
        "rows) + a · layer·tokens + b · entries scored by source indexers + c · entries scored by "
        f"Reindex indexers, with d = {coef[0] * 1e3:.2f} ms, a = {coef[1] * 1e6:.1f} µs, "
        f"b = {coef[2] * 1e9:.2f} ns, c = {coef[3] * 1e9:.2f} ns solved from four runs that are not "
        "recoveries: "
        + ", ".join(f"{name} ({median[name]:.2f} s)" for name in calib_names)
        + ", the hit and the full path (so the full path's ÷ C is 1 by construction); then applied "
        "to each path's extra work.",
        "",
        "| path | runs | layer passes | layer·tokens | extra over hit | extra scored (source / Reindex) "
        "| TTFT | recovery "
        "| bound A | ÷ A | bound B | ÷ B | bound C | ÷ C |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, plan, t, n in rows:
        extra = plan.work - hit_plan.work
        delta = [x - y for x, y in zip(feats[name], feats["hit"], strict=True)]
        d_src, d_re = delta[2], delta[3]
        rec = t - hit_t
        bound, deep = extra * per_work, extra * per_work_deep
        fitted = sum(c * x for c, x in zip(coef, delta, strict=True))
        ratio = "—" if name in ("hit", "full") or bound <= 0 else f"{rec / bound:.2f}"
        ratio_b = "—" if name == "hit" or deep <= 0 else f"{rec / deep:.2f}"
        ratio_c = "—" if name in ("hit", "full") or fitted <= 0 else f"{rec / fitted:.2f}"
        lines.append(
            f"| {name} | {n} | {feats[name][0]} | {plan.work:,} | {extra:,} | {d_src:,} / {d_re:,} "
            f"| {t:.2f} s | {rec:.2f} s "
            f"| {bound:.2f} s | {ratio} | {deep:.2f} s | {ratio_b} | {fitted:.2f} s | {ratio_c} |"
        )
    exact, bounded = cases["exact"][0], cases["bounded"][0]
    t_exact, t_bounded = median["exact"] - hit_t, median["bounded"] - hit_t
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
    ap.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="runs of the hit and bounded (exact, truncate, full: about half)",
    )
    ap.add_argument("--calib-tokens", type=int, default=8192, help="cold prefill, decoder replay off")
    ap.add_argument("--skip-a", action="store_true")
    ap.add_argument("--skip-b", action="store_true")
    ap.add_argument("--write", default="")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = DeepseekV41ForCausalLM(bench_config())
    init_weights(model, seed=0).eval()
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
        lines += bench_miss_paths(model, args.prefix, args.new, args.repeats, args.calib_tokens)
    lines.append(MARK_END)
    table = "\n".join(lines)
    print(table)
    if args.write:
        heading = "## SWA bounded replay\n\n`python bench/bench_replay.py --write docs/benchmarks.md`"
        replace_section(args.write, table, MARK_BEGIN, MARK_END, heading)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
