"""PNG plots of a :class:`~replaykv.plan.planner.Plan` (matplotlib, headless).

* ``storage_vs_turn_length.png``: persistent bytes per token versus turn length, V4 policy
  (global KV + window snapshots) and V4.1 policy (global KV only), with the break-even length;
* ``pool_hit_rate_vs_ttl.png``: SWA-pool hit rate versus TTL, with unlimited RAM and with this
  pool's capacity, with the configured TTL and the target;
* ``prefill_work_vs_prompt_length.png``: prefill layer × token rows versus prompt length with
  and without decoder replay, and the saving.

Every curve is recomputed from the plan's ledger and workload. Not for: the numbers themselves
(:mod:`replaykv.plan.planner`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from replaykv.plan.planner import Plan, hit_rate

STORAGE_PNG = "storage_vs_turn_length.png"
POOL_PNG = "pool_hit_rate_vs_ttl.png"
PREFILL_PNG = "prefill_work_vs_prompt_length.png"
_SIZE = (6.4, 3.8)
_DPI = 90


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _geomspace(lo: float, hi: float, n: int) -> list[float]:
    return [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]


def plot_storage(plan: Plan, path: Path) -> Path:
    plt = _pyplot()
    ledger, w = plan.ledger, plan.inputs
    g = float(ledger.global_bytes_per_token())
    k = w.snapshots_per_turn
    snap = ledger.window_state_bytes()
    xs = _geomspace(16, 262144, 200)
    fig, ax = plt.subplots(figsize=_SIZE)
    ax.plot(xs, [g + k * snap / x for x in xs], label=f"V4 policy: global KV + {k} snapshots/turn")
    ax.plot(xs, [g for _ in xs], label="V4.1 policy: global KV only")
    be = plan.ledgers.break_even_turn_tokens
    if math.isfinite(be):
        ax.axvline(be, color="grey", linestyle="--", linewidth=1)
        ax.annotate(
            f"break-even {be:,.0f} tok", (be, 2 * g), xytext=(6, 6), textcoords="offset points", fontsize=8
        )
    mean_turn = plan.ledgers.mean_turn_tokens
    ax.plot([mean_turn], [g + k * snap / mean_turn], "o", color="C3", label=f"mean turn {mean_turn:,.0f} tok")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens added per turn")
    ax.set_ylabel("persistent bytes per token")
    ax.set_title(f"{plan.model}: persistent cache per token", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def plot_pool(plan: Plan, path: Path) -> Path:
    plt = _pyplot()
    w, p = plan.inputs, plan.pool
    hi = max(2 * p.ttl_s, 1.5 * min(p.ttl_for_target_s, 10 * p.ttl_s if p.ttl_s else 3600.0), 60.0)
    xs = [hi * i / 300 for i in range(301)]
    fig, ax = plt.subplots(figsize=_SIZE)
    ax.plot([x / 60 for x in xs], [100 * w.think_time.cdf(x) for x in xs], label="RAM unlimited: P(T <= TTL)")
    ax.plot(
        [x / 60 for x in xs],
        [100 * hit_rate(w, x, p.capacity_entries, p.entries_per_second) for x in xs],
        label=f"this pool ({p.capacity_entries:,} entries)",
    )
    ax.axvline(p.ttl_s / 60, color="grey", linestyle="--", linewidth=1, label=f"TTL {p.ttl_s / 60:.1f} min")
    if p.characteristic_time_s < hi:
        ax.axvline(p.characteristic_time_s / 60, color="C1", linestyle=":", linewidth=1,
                   label=f"t_C {p.characteristic_time_s / 60:.1f} min (capacity)")  # fmt: skip
    ax.axhline(100 * p.target_hit_rate, color="C3", linestyle=":", linewidth=1, label="target")
    ax.set_xlabel("SWA pool TTL (minutes)")
    ax.set_ylabel("pool hit rate of follow-up turns (%)")
    ax.set_ylim(0, 100)
    ax.set_title(f"{plan.model}: think time {w.think_time.describe()} s", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def plot_prefill(plan: Plan, path: Path) -> Path:
    plt = _pyplot()
    ledger, c = plan.ledger, plan.compute
    xs = [round(x) for x in _geomspace(64, 1048576, 120)]
    off = [ledger.prefill_work(x, window=c.window, decoder_replay=False) for x in xs]
    on = [ledger.prefill_work(x, window=c.window, decoder_replay=True, convention=c.convention) for x in xs]
    fig, ax = plt.subplots(figsize=_SIZE)
    ax.plot(xs, off, label="no decoder replay")
    ax.plot(xs, on, label=f"decoder replay (W = {c.window}, {c.convention} accounting)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens (cold prefill)")
    ax.set_ylabel("layer x token rows")
    ax.grid(True, which="both", alpha=0.3)
    twin = ax.twinx()
    twin.plot(xs, [100 * (1 - b / a) for a, b in zip(off, on, strict=True)], color="C2", linestyle="--",
              label="saving (right axis)")  # fmt: skip
    twin.set_ylabel("saving (%)")
    twin.set_ylim(0, 100)
    handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], fontsize=8, loc="upper left")
    ax.set_title(f"{plan.model}: prefill work", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def write_plots(plan: Plan, directory: str | Path) -> list[Path]:
    """Write the three PNGs into `directory` (created if needed); returns their paths."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    return [
        plot_storage(plan, out / STORAGE_PNG),
        plot_pool(plan, out / POOL_PNG),
        plot_prefill(plan, out / PREFILL_PNG),
    ]
