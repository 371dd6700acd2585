"""The fidelity study as Markdown tables and a plot of KL against distance from the cut.

Reads the JSON `replaykv fidelity` writes; `render` returns the Markdown (the header names the
engine commit, the model digest, the command and the run time), `plot_decay` writes the PNG.
Not for: measuring (see :mod:`replaykv.fidelity.study`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def _ci(m: dict[str, float], scale: float = 1.0, digits: int = 4) -> str:
    if not m or m.get("n", 0) == 0 or math.isnan(m["median"]):
        return "–"
    f = f"{{:.{digits}g}}"
    return f"{f.format(m['median'] * scale)} [{f.format(m['lower95'] * scale)}, {f.format(m['upper95'] * scale)}]"


def _pct(w: dict[str, float]) -> str:
    if not w.get("n"):
        return "–"
    return f"{100 * w['acc']:.0f}% [{100 * w['lo']:.0f}, {100 * w['hi']:.0f}] ({w['k']}/{w['n']})"


def header(result: dict[str, Any]) -> list[str]:
    env = result["environment"]
    return [
        f"Command: `{result['command']}`; {result['seconds'] / 60:.1f} min on {env.get('cpus')} CPUs "
        f"({env.get('threads')} torch threads). Engine commit `{env.get('commit')}`, replaykv "
        f"{env.get('replaykv')}, torch {env.get('torch')}; model `{result['model']['name']}` (weights sha256 "
        f"`{result['model']['weights_sha256']}`, config digest `{result['model']['config_digest']}`).",
        "",
    ]


def token_tables(tokens: dict[str, Any]) -> list[str]:
    """Per length: the paths at each offset (all families), then per family (all offsets);
    the JSON holds every (family, offset) cell."""
    lines: list[str] = []
    rows = tokens["summary"]
    order = {lab: i for i, lab in enumerate(tokens["spec"]["offsets"])}
    for length in sorted({r["length"] for r in rows}):
        lines += [
            f"#### {length:,}-token prompts",
            "",
            "Medians over prompts [95% bootstrap interval of the median]. KL in nats per row, "
            "KL(exact ‖ path). Top-1: share of rows whose argmax is the exact path's. First divergence: "
            "continuation tokens before the path's greedy output first differs (the continuation's "
            f"length, {tokens['spec']['continuation']}, when it never does); diverged: share of cells "
            "where it did. Offset: the cut's distance after the evidence's end (plain text: after the "
            "prompt's middle; deep: 16 tokens before the prompt's end).",
            "",
        ]
        by_offset = [r for r in rows if r["length"] == length and r["family"] == "all"]
        by_offset.sort(key=lambda r: (order.get(r["offset"], len(order)), r["path"]))
        by_family = [r for r in rows if r["length"] == length and r["offset"] == "all" and r["family"] != "all"]
        for title, key, group in (("offset", "offset", by_offset), ("family", "family", by_family)):
            lines += [
                f"| {title} | path | n | KL prompt rows after cut | KL continuation | top-1 prompt | "
                "top-1 continuation | first divergence | diverged |",
                "|---|---|---:|---|---|---|---|---|---|",
            ]
            for r in group:
                lines.append(
                    f"| {r[key]} | {r['path']} | {r['cells']} | {_ci(r['kl_prompt'])} | "
                    f"{_ci(r['kl_continuation'])} | {_ci(r['top1_prompt'], 100, 3)} | "
                    f"{_ci(r['top1_continuation'], 100, 3)} | {_ci(r['first_divergence'], 1, 3)} | "
                    f"{_pct(r['diverged'])} |"
                )
            lines.append("")
    lines += ["#### KL by distance from the cut (median over cells of each bucket's mean)", ""]
    edges = sorted({int(e) for d in tokens["decay"] for e in d["buckets"]})
    lines.append("| length | path | " + " | ".join(f"≥{e}" for e in edges) + " |")
    lines.append("|---|---|" + "---:|" * len(edges))
    for d in tokens["decay"]:
        vals = [d["buckets"].get(str(e)) for e in edges]
        lines.append(
            f"| {d['length']} | {d['path']} | " + " | ".join("–" if v is None else f"{v:.2g}" for v in vals) + " |"
        )
    return [*lines, ""]


def answer_tables(ans: dict[str, Any]) -> list[str]:
    lines = [
        "Teacher-forced exact match of the reference answer; accuracy [Wilson 95%] (k/n). Paired "
        "difference against the full path: mean [95% paired-bootstrap interval], exact McNemar p.",
        "",
        "| length | task | arm | accuracy | difference vs full | McNemar p |",
        "|---:|---|---|---|---|---:|",
    ]
    for r in ans["table"]:
        vs = r.get("vs_full")
        diff = (
            f"{100 * vs['diff']:+.1f} pts [{100 * vs['lower95']:+.1f}, {100 * vs['upper95']:+.1f}]"
            if vs and not math.isnan(vs["diff"])
            else "–"
        )
        p = f"{vs['p_value']:.3g}" if vs else "–"
        lines.append(f"| {r['length']} | {r['task']} | {r['arm']} | {_pct(r)} | {diff} | {p} |")
    return [*lines, ""]


def drift_tables(drift: dict[str, Any]) -> list[str]:
    lines = [
        "Per turn k: relative error of the stored global KV (compressed entries and index keys of every "
        "group written so far) against one-pass prefill, and KL(one pass ‖ turns) of the turn's last row; "
        "medians over sessions [95% bootstrap interval].",
        "",
        "| turns | snapshot | turn k | global-KV relative error | KL last row | top-1 last row |",
        "|---:|---|---:|---|---|---|",
    ]
    for r in drift["per_turn"]:
        lines.append(
            f"| {r['turns']} | {'hit' if r['keep_snapshot'] else 'missed'} | {r['turn']} | "
            f"{_ci(r['rel_error'])} | {_ci(r['kl'])} | {_ci(r['top1'], 100, 3)} |"
        )
    lines += [
        "",
        "Answer at the last turn (teacher forced), sessions in turns against one pass:",
        "",
        "| turns | snapshot | one pass | in turns | difference | McNemar p |",
        "|---:|---|---|---|---|---:|",
    ]
    for r in drift["answers"]:
        vs = r["vs_one_pass"]
        lines.append(
            f"| {r['turns']} | {'hit' if r['keep_snapshot'] else 'missed'} | {_pct(r['one_pass'])} | "
            f"{_pct(r['in_turns'])} | {100 * vs['diff']:+.1f} pts [{100 * vs['lower95']:+.1f}, "
            f"{100 * vs['upper95']:+.1f}] | {vs['p_value']:.3g} |"
        )
    return [*lines, ""]


def render(result: dict[str, Any]) -> str:
    lines = header(result)
    if "tokens" in result:
        lines += ["### Per-token fidelity", "", *token_tables(result["tokens"])]
    if "answers" in result:
        lines += ["### Answers", "", *answer_tables(result["answers"])]
    if "drift" in result:
        lines += ["### Drift over turns", "", *drift_tables(result["drift"])]
    return "\n".join(lines)


def plot_decay(result: dict[str, Any], path: Path) -> None:
    """KL against distance from the cut, one line per (length, path), log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for d in result["tokens"]["decay"]:
        xs = [max(1, int(e)) for e in d["buckets"]]
        ys = [max(v, 1e-12) for v in d["buckets"].values()]
        ax.plot(xs, ys, marker="o", ms=3, label=f"{d['path']} @ {d['length']}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("distance from the cut (tokens, bucket's left edge)")
    ax.set_ylabel("KL(exact ‖ path), nats per row")
    ax.set_title(f"replay fidelity: {result['model']['name']}")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
