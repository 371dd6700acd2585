"""Replay paths measured side by side on a DeepSeek-V4.1-shaped model (the released 20 + 20
layer schedule, reduced widths, 128-token window), one process.

`--widths reduced` (hidden 128, 6.7M parameters) keeps every run short; `--widths wide` (hidden
512, attention 4 × 128, experts 8 × 512) makes a 128-row layer call mostly arithmetic: at hidden
128 such a call costs about 2 ms of arithmetic beside about 2.5 ms of fixed per-call work (a
one-token step over all 40 layers takes 0.1 s), so a short call costs more per row than a long
one, which the released widths do not do.

(a) Decoder replay: prefill throughput of a batch of prompts with decoder replay on versus off
    (layer-token bound: full work / trimmed work).
(b) A cached prefix + new tokens with the SWA snapshot missing: time to first token of every
    miss strategy and of a full hit, and the recovery work alone (each TTFT minus the hit's),
    against each path's layer×token bound: its extra layer·tokens priced at what an ordinary
    prefill charges for them (the same rows in the same layers at the same depth, each layer in
    one call, measured beside it; recomputes at the full path's rate).

    python bench/bench_replay.py [--prompts 8 --tokens 8192] [--prefix 32768 --new 256]
        [--repeats 9 --long-repeats 2] [--widths reduced|wide] [--skip-a] [--skip-b]
        [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import replace_section

from replaykv.cache.views import allocate_view
from replaykv.engine.runner import execute
from replaykv.engine.scenario import drop_snapshot
from replaykv.malloc import reexec_keeping_freed_memory
from replaykv.model.cache_view import CacheView, CompressorCarry, LayerCacheView
from replaykv.model.init import init_weights
from replaykv.model.presets_v41 import v41_flash
from replaykv.model.spec import ModelSpec
from replaykv.model.v41 import DeepseekV41ForCausalLM
from replaykv.replay import CacheState, PrefillPlan, ReplayFlags, Segment, plan_prefill

WIDTHS = ("reduced", "wide")


def marks(widths: str) -> tuple[str, str]:
    """The docs section markers of a run at `widths` (the reduced run keeps the plain name)."""
    name = "bench_replay" if widths == "reduced" else f"bench_replay:{widths}"
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def bench_config(widths: str = "reduced"):  # type: ignore[no-untyped-def]
    """The released V4.1-Flash schedule (40 layers: 2 window-only, 18 ratio-2, 20 ratio-1; sources
    2/8/14/20; Reindex 24/28/32/36; candidate source 20) at reduced widths; `wide` widens the
    attention and the experts (the indexers stay 2 heads × 32)."""
    config = v41_flash().replace(
        vocab_size=512, hidden_size=128, num_attention_heads=2, head_dim=64, q_lora_rank=64,
        qk_rope_head_dim=16, o_groups=1, o_lora_rank=32, index_n_heads=2, index_head_dim=32,
        index_topk=64, candidate_topk_blocks=64, candidate_block_size=8, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=64, hc_mult=2, rms_norm_eps=1e-6,
        max_position_embeddings=262144,
    )  # fmt: skip
    if widths == "wide":
        config = config.replace(
            hidden_size=512, num_attention_heads=4, head_dim=128, q_lora_rank=256, o_groups=2,
            o_lora_rank=128, n_routed_experts=8, moe_intermediate_size=512,
        )  # fmt: skip
    elif widths != "reduced":
        raise ValueError(f"unknown widths {widths!r}; choose one of {WIDTHS}")
    return config


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
    plans = {
        dec: plan_prefill(CacheState(tokens=tokens), spec, ReplayFlags(enable_decoder_swa_bounded_replay=dec))
        for dec in (False, True)
    }
    # Each prompt runs with replay off and on back to back, so a slow spell lands on both alike.
    times = {False: 0.0, True: 0.0}
    for ids in batch:
        for dec, plan in plans.items():
            view = allocate_view(spec, 1, tokens)
            t0 = time.perf_counter()
            execute(model, plan, ids, view)
            times[dec] += time.perf_counter() - t0
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


class LayerClock:
    """Wall time of every layer call of `model`, in call order (forward pre- and post-hooks; the
    CPU runs a layer synchronously, so the difference is the layer's time)."""

    def __init__(self, model: DeepseekV41ForCausalLM) -> None:
        self.times: list[float] = []
        self._t0 = 0.0
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        for layer in model.model.layers:
            self.handles.append(layer.register_forward_pre_hook(self._start))
            self.handles.append(layer.register_forward_hook(self._stop))

    def _start(self, *_: object) -> None:
        self._t0 = time.perf_counter()

    def _stop(self, *_: object) -> None:
        self.times.append(time.perf_counter() - self._t0)

    def take(self) -> list[float]:
        times, self.times = self.times, []
        return times

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def layer_calls(plan: PrefillPlan) -> list[tuple[int, int, bool]]:
    """(layer, rows, recovery) of every layer call `plan` makes, in execution order; recovery:
    the call runs only rows below the cached prefix, read-only (exact's rebuild; bounded
    replay's rows ride in the new rows' calls, so it has none)."""
    calls = []
    for call in plan.calls:
        t0, t1 = call.tokens
        recovery = call.global_from == t1 <= plan.use_global
        calls += [(layer, t1 - t0, recovery) for layer in range(*call.layers)]
    return calls


def as_ordinary(plan: PrefillPlan) -> PrefillPlan:
    """The price of `plan`'s layer·tokens as ordinary prefill: every layer runs the union of the
    rows `plan` gives it in one call (floor at the first of them), with the global KV read-only
    (replayed rows read the cached global KV; the hit this is compared with is read-only too, so
    the new rows' compressors, which a path runs like the hit does, drop out of the difference).
    Only for timing: the rows below the cut read no valid window."""
    rows: dict[int, tuple[int, int, int]] = {}
    for seg in plan.segments:
        t0, t1 = seg.tokens
        for layer in range(*seg.layers) if t1 > t0 else ():
            a, b, floor = rows.get(layer, (t0, t0, seg.window_floor))
            assert b == t0, "a layer's rows are contiguous across the path's segments"
            rows[layer] = (a, t1, floor)
    segs: list[Segment] = []
    for layer in sorted(rows):
        a, b, floor = rows[layer]
        last = segs[-1] if segs else None
        if (
            last is not None
            and last.layers[1] == layer
            and last.tokens == (a, b)
            and last.window_floor == floor
        ):
            segs[-1] = dataclasses.replace(last, layers=(last.layers[0], layer + 1))
        else:
            segs.append(Segment((layer, layer + 1), (a, b), floor, False, "new"))
    out = dataclasses.replace(plan, segments=tuple(segs))
    assert out.work == plan.work
    return out


def bench_miss_paths(
    model: DeepseekV41ForCausalLM, prefix: int, new: int, repeats: int, long_repeats: int
) -> list[str]:
    spec = ModelSpec.from_config(model.config)
    total, window = prefix + new, spec.sliding_window
    ids = torch.randint(0, model.config.vocab_size, (1, total), generator=torch.Generator().manual_seed(1))
    earlier = plan_prefill(CacheState(tokens=prefix), spec, ReplayFlags())
    base = allocate_view(spec, 1, total)
    t0 = time.perf_counter()
    execute(model, earlier, ids[:, :prefix], base)
    t_prefix = time.perf_counter() - t0

    def miss(strategy: str) -> PrefillPlan:
        return plan_prefill(CacheState(total, prefix, ()), spec, ReplayFlags(swa_miss_strategy=strategy))

    hit = plan_prefill(CacheState(total, prefix, (prefix,)), spec, ReplayFlags())
    replays = ("bounded", "exact")
    # name -> (plan, snapshot dropped, runs). Cases run in interleaved rounds, in this order in even
    # rounds and the reverse in odd ones, so a slow spell of the machine lands on every case alike and no
    # case always follows the same one (truncate and full run the same plan here, so their ratio shows
    # the timing's own error), and a difference is the median over rounds of one case's time minus
    # another's in the same round. A short case runs once untimed just before each timed run, so every
    # case is timed in the same warm state (pages already mapped, caches holding its own data) whatever
    # ran before it. "… as ordinary" cases price a replay path's rows; "hit, read-only" is what they are
    # compared with.
    cases: dict[str, tuple[PrefillPlan, bool, int]] = {
        "hit": (hit, False, repeats),
        "hit, read-only": (as_ordinary(hit), False, repeats),
        **{name: (miss(name), True, repeats) for name in replays},
        **{f"{name} as ordinary": (as_ordinary(miss(name)), True, repeats) for name in replays},
        "truncate": (miss("truncate"), True, long_repeats),
        "full": (miss("full"), True, long_repeats),
    }
    calls = {name: layer_calls(plan) for name, (plan, *_) in cases.items()}
    times: dict[str, list[float]] = {name: [] for name in cases}
    # The same runs on this thread's CPU clock: with one torch thread every kernel runs here, so
    # it counts the work without the time the thread waited for a core.
    cpu: dict[str, list[float]] = {name: [] for name in cases}
    per_call: dict[str, list[list[float]]] = {name: [] for name in cases}  # each run's layer-call times

    def fresh(dropped: bool) -> CacheView:
        view = clone_view(base)
        if dropped:
            drop_snapshot(view)
        return view

    clock = LayerClock(model)
    for r in range(max(n for *_, n in cases.values())):
        for name, (plan, dropped, n) in list(cases.items())[:: -1 if r % 2 else 1]:
            if r >= n:
                continue
            if name not in ("truncate", "full"):  # a short case: warm-up
                execute(model, plan, ids, fresh(dropped))
            view = fresh(dropped)
            clock.take()
            c0, t0 = time.thread_time(), time.perf_counter()
            execute(model, plan, ids, view)
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.thread_time() - c0)
            per_call[name].append(clock.take())
    clock.close()

    def layer_time(name: str, recovery: bool) -> list[float]:
        """Per run, the time inside the replay and rebuild calls (recovery) or the other calls."""
        return [
            sum(t for t, (_, _, rc) in zip(run, calls[name], strict=True) if rc == recovery)
            for run in per_call[name]
        ]

    recovering = {name: layer_time(name, True) for name in cases}
    other = {name: layer_time(name, False) for name in cases}

    def diffs(name: str, series: dict[str, list[float]], base: str) -> list[float]:
        return [t - h for t, h in zip(series[name], series[base], strict=False)]

    def paired(name: str, series: dict[str, list[float]], base: str = "hit") -> float:
        return statistics.median(diffs(name, series, base))

    def middle(name: str, base: str = "hit") -> str:
        """The middle half of the rounds' differences (first to third quartile)."""
        d = diffs(name, times, base)
        if len(d) < 4:
            return ""
        q1, _, q3 = statistics.quantiles(d, n=4)
        return f" ({q1:.2f}–{q3:.2f})"

    def interval(stat: Callable[[Sequence[int]], float], n: int) -> str:
        """A 95% bootstrap interval of `stat` over the rounds (resampled whole, so the pairs stay)."""
        if n < 4:
            return ""
        rng = random.Random(0)
        vals = sorted(stat([rng.randrange(n) for _ in range(n)]) for _ in range(2000))
        return f" [{vals[49]:.2f}–{vals[1949]:.2f}]"

    def ratio_of_medians(top: list[float], bottom: list[float]) -> Callable[[Sequence[int]], float]:
        def stat(idx: Sequence[int]) -> float:
            b = statistics.median(bottom[i] for i in idx)
            return statistics.median(top[i] for i in idx) / b if b > 0 else float("nan")

        return stat

    ran = [name for name in PATHS if times[name]]
    median = {name: statistics.median(ts) for name, ts in times.items() if ts}

    def priced(series: dict[str, list[float]]) -> tuple[dict[str, float], dict[str, float], float | None]:
        """On one clock: each path's recovery, its bound, and the full path's seconds per extra
        layer·token (None without full, --long-repeats 0)."""
        rec = {name: paired(name, series) for name in ran}
        per_work = rec["full"] / max(1, cases["full"][0].work - hit.work) if "full" in rec else None
        bound = {name: paired(f"{name} as ordinary", series, "hit, read-only") for name in replays}
        if per_work is not None:
            bound.update({name: (cases[name][0].work - hit.work) * per_work for name in ("truncate", "full")})
        return rec, bound, per_work

    def ratios(series: dict[str, list[float]]) -> dict[str, str]:
        """Recovery ÷ bound of each path on one clock, with a bootstrap interval for the replays."""
        rec, bound, _ = priced(series)
        out = {}
        for name in ran:
            b = bound.get(name)
            if b is None or b <= 0:
                out[name] = "—"
                continue
            spread = ""
            if name in replays:
                top, bottom = (
                    diffs(name, series, "hit"),
                    diffs(f"{name} as ordinary", series, "hit, read-only"),
                )
                spread = interval(ratio_of_medians(top, bottom), len(series[name]))
            out[name] = f"{rec[name] / b:.2f}{spread}"
        return out

    rec, bound, per_work = priced(times)
    wall_ratio, cpu_ratio = ratios(times), ratios(cpu)

    lines = [
        f"(b) {prefix:,}-token cached prefix + {new} new tokens, decoder replay on (the earlier request's "
        f"prefill took {t_prefix:.1f} s). TTFT is the median of the runs shown. The cases run in "
        "interleaved rounds; recovery is the median over rounds of the path's TTFT minus the same "
        'round\'s hit; "its segments" is the median time inside the layer calls of its rebuild '
        "segments (bounded replay's replayed rows run in the same call as the new rows, one call "
        'per layer range, so it has none), "other layers vs hit" the median difference of the time '
        "inside all its other layer calls and the hit's (hooks on every layer call); in brackets, the middle half "
        "of the rounds' differences (first to third quartile), and in square brackets a 95% bootstrap "
        "interval over the rounds. The bound is each path's extra "
        "layer·tokens priced at what an ordinary prefill charges for them. A layer·token does not "
        "cost the same everywhere (a layer with a lightning indexer, the KV sources and the Reindex "
        "layers, scores a row at position p against every compressed entry before it; a window-only "
        "layer scores nothing), so a replay's rows, which sit just below the cached prefix, are "
        "priced by running them as ordinary rows: every layer runs the rows the path gives it in "
        f"one call, global KV read-only, and the bound is that run's time minus a read-only hit's "
        f"(median over rounds; {median['hit, read-only']:.2f} s, "
        f"{median['bounded as ordinary']:.2f} s and {median['exact as ordinary']:.2f} s). A "
        "recompute's rows (at every depth) are priced at the full path's seconds per extra "
        'layer·token, so full\'s ratio is 1 by construction; "uniform rate" prices every path '
        'that way. "On the CPU clock" is recovery ÷ bound again with every run timed by the '
        "process's thread CPU time (one torch thread: every kernel runs on it), which leaves out "
        "the time the thread waited for a core.",
        "",
        "| path | runs | layer calls | layer·tokens | extra over hit | TTFT | recovery | its segments "
        "| other layers vs hit | uniform rate | bound | recovery ÷ bound | on the CPU clock |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in ran:
        plan, _, n = cases[name]
        extra = plan.work - hit.work
        is_replay = name in replays
        has_own = any(rc for *_, rc in calls[name])
        seg = statistics.median(recovering[name]) if is_replay and has_own else None
        rest = paired(name, other) if is_replay else None

        def sec(x: float | None) -> str:
            return "—" if x is None else f"{x:.2f} s"

        b = bound.get(name)
        lines.append(
            f"| {name} | {n} | {len(calls[name])} | {plan.work:,} | {extra:,} | {median[name]:.2f} s "
            f"| {rec[name]:.2f} s{middle(name) if is_replay else ''} | {sec(seg)} | {sec(rest)} "
            f"| {sec(None if per_work is None else extra * per_work)} "
            f"| {sec(b) if name != 'hit' else '—'}{middle(f'{name} as ordinary', 'hit, read-only') if is_replay else ''} "
            f"| {wall_ratio[name]} | {cpu_ratio[name]} |"
        )
    exact, bounded = cases["exact"][0], cases["bounded"][0]
    t_exact, t_bounded = rec["exact"], rec["bounded"]
    s_exact = statistics.median(recovering["exact"])
    lines += [
        "",
        f"Encoder bounded replay adds {bounded.work - hit.work:,} layer·tokens "
        f"({spec.decoder_cut + 1} layers × {window}); exact replay "  # type: ignore[operator]
        f"{exact.work - hit.work:,} ({(exact.work - hit.work) / max(1, bounded.work - hit.work):.1f}×). "
        f"Measured recovery: bounded {t_bounded:.2f} s, exact {t_exact:.2f} s "
        f"({t_exact / t_bounded if t_bounded > 0 else float('nan'):.1f}×"
        f"{interval(ratio_of_medians(diffs('exact', times, 'hit'), diffs('bounded', times, 'hit')), len(times['exact']))} "
        f"cheaper with bounded); exact's rebuild segments take {s_exact:.2f} s, bounded replay's rows "
        "run inside the new rows' calls.",
        "",
    ]
    return lines


def main() -> int:
    reexec_keeping_freed_memory()
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--prefix", type=int, default=32768)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=9, help="runs of the hit, bounded and exact")
    ap.add_argument("--long-repeats", type=int, default=2, help="runs of truncate and full (0: skip them)")
    ap.add_argument("--widths", choices=WIDTHS, default="reduced")
    ap.add_argument("--skip-a", action="store_true")
    ap.add_argument("--skip-b", action="store_true")
    ap.add_argument("--write", default="")
    args = ap.parse_args()
    torch.manual_seed(0)
    config = bench_config(args.widths)
    model = DeepseekV41ForCausalLM(config)
    init_weights(model, seed=0).eval()
    n_params = sum(p.numel() for p in model.parameters())
    begin, end = marks(args.widths)
    lines = [
        begin,
        "",
        f"DeepSeek-V4.1 schedule at {args.widths} widths (hidden {config.hidden_size}, "
        f"{n_params / 1e6:.1f}M parameters, window 128, KV "
        f"quantisers on), float32, {torch.get_num_threads()} torch thread(s) on {os.cpu_count()} CPU cores, "
        "one process, glibc keeping freed memory (`MALLOC_ENV`).",
        "",
    ]
    if not args.skip_a:
        lines += bench_decoder_replay(model, args.prompts, args.tokens)
        print("\n".join(lines), flush=True)
    if not args.skip_b:
        lines += bench_miss_paths(model, args.prefix, args.new, args.repeats, args.long_repeats)
    lines.append(end)
    table = "\n".join(lines)
    print(table)
    if args.write:
        heading = f"## SWA bounded replay, {args.widths} widths\n\n`python bench/bench_replay.py --widths {args.widths}`"
        replace_section(args.write, table, begin, end, heading)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
