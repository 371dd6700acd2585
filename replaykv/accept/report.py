"""The acceptance report: JSON for machines, Markdown and HTML for people, with plots.

Files written to the output directory:
    report.json   everything: contract + digest, environment, both arms, verdicts with margins,
                  per-cell and load tables, ledger traffic and every request record
    report.md     the verdicts, tables and plots (PNG files beside it)
    report.html   the same, self-contained (plots embedded)
    accuracy_vs_offset.png, kl_vs_offset.png, latency.png

Not for: computing anything (see :mod:`replaykv.accept.criteria`).
"""

from __future__ import annotations

import base64
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from markdown_it import MarkdownIt

from replaykv.accept.criteria import Pair


def _fmt(v: Any, digits: int = 4) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
            return f"{v:.2e}"
        return f"{v:.{digits}g}"
    return str(v)


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def plots(pairs: list[Pair], records: list[Any], out: Path) -> list[str]:
    """Accuracy and KL against the cut offset (candidate miss / shift states), and latency
    distributions of the load runs. Returns the file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    miss = [p for p in pairs if p.cand.state in ("miss", "shift")]
    # task success only where it is scored (image cases are not)
    scored = [p for p in miss if p.cand.outcome.get("success", False) is not None]
    if scored:
        bins: dict[int, list[Pair]] = defaultdict(list)
        for p in scored:
            bins[int(p.cand.offset // 64) * 64].append(p)
        xs = sorted(bins)
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.plot(xs, [sum(bool(p.cand.outcome.get("success")) for p in bins[x]) / len(bins[x]) for x in xs],
                "o-", label="candidate (snapshot missing)")  # fmt: skip
        ax.plot(xs, [sum(bool(p.base.outcome.get("success")) for p in bins[x]) / len(bins[x]) for x in xs],
                "s--", label="baseline cold")  # fmt: skip
        ax.set_xlabel("cut - evidence end (tokens, bins of 64)")
        ax.set_ylabel("task success")
        ax.set_ylim(-0.05, 1.05)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "accuracy_vs_offset.png", dpi=110)
        plt.close(fig)
        names.append("accuracy_vs_offset.png")
    if miss:
        fig, ax = plt.subplots(figsize=(6, 3.2))
        pts = [(p.cand.offset, p.kl) for p in miss if not math.isnan(p.kl)]
        if pts:
            ax.scatter([x for x, _ in pts], [max(y, 1e-9) for _, y in pts], s=10, alpha=0.6)
            ax.set_yscale("log")
        ax.set_xlabel("cut - evidence end (tokens)")
        ax.set_ylabel("KL(baseline cold || candidate) per token")
        fig.tight_layout()
        fig.savefig(out / "kl_vs_offset.png", dpi=110)
        plt.close(fig)
        names.append("kl_vs_offset.png")
    load: dict[str, list[float]] = defaultdict(list)
    for r in records:
        if r.phase.startswith("load:") and r.obs.error is None:
            load[f"{r.phase[5:]}\n{r.arm}"].append(r.obs.latency_s)
    if load:
        fig, ax = plt.subplots(figsize=(6, 3.2))
        keys = sorted(load)
        ax.boxplot([load[k] for k in keys], tick_labels=keys)
        ax.set_ylabel("end-to-end latency (s)")
        ax.tick_params(axis="x", labelsize=7)
        fig.tight_layout()
        fig.savefig(out / "latency.png", dpi=110)
        plt.close(fig)
        names.append("latency.png")
    return names


def _table(rows: list[dict[str, Any]], cols: list[str]) -> list[str]:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return lines


def markdown(report: dict[str, Any], images: list[str]) -> str:
    c = report["contract"]
    lines = [
        f"# Acceptance report: {c['name']}",
        "",
        f"**Verdict: {'PASS' if report['passed'] else 'FAIL'}** — stage `{c['stage']}`, "
        f"{report['passed_count']}/{len(report['criteria'])} criteria pass"
        + ("" if report["passed"] else f"; failing: {', '.join(report['failing'])}"),
        "",
        f"- contract digest `{report['contract_digest']}` (file sha256 `{report['contract_file_sha256']}`)",
        f"- baseline: `{json.dumps(report['arms']['baseline'])}`",
        f"- candidate: `{json.dumps(report['arms']['candidate'])}`",
        f"- environment: `{json.dumps(report['environment'])}`",
        f"- {report['cases']} cases, {len(report['records'])} measured requests, {report['seconds']:.0f} s",
        "",
        "## Criteria (written before the run)",
        "",
    ]
    crit_rows = [
        {
            "criterion": v["name"],
            "metric": v["metric"],
            "states": ",".join(v["states"]) or "all",
            "suffixes": ",".join(v.get("suffixes", [])) or "all",
            "statistic": v["statistic"],
            "value": v["value"],
            "rule": f"{v['direction']} {v['threshold']:g}",
            "margin": v["margin"],
            "pass": v["passed"],
            "n": v["stats"].get("n"),
            "McNemar p": v["stats"].get("p_value"),
            "note": v["note"],
        }
        for v in report["criteria"]
    ]
    cols = [
        "criterion",
        "metric",
        "states",
        "suffixes",
        "statistic",
        "value",
        "rule",
        "margin",
        "pass",
        "n",
        "McNemar p",
        "note",
    ]
    lines += _table(crit_rows, cols)
    lines += ["", "## Ledgers (quality pass)", ""]
    res_rows = [{"arm": arm, **vals} for arm, vals in report["resources"].items()]
    if res_rows:
        lines += _table(res_rows, list(res_rows[0]))
    if report["load"]:
        lines += ["", "## Load runs (snapshot-miss state)", ""]
        lines += _table(report["load"], list(report["load"][0]))
    lines += ["", "## Per cell (candidate state against the baseline's cold path)", ""]
    if report["cells"]:
        lines += _table(report["cells"], list(report["cells"][0]))
    if report.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in report["notes"]]
    if images:
        lines += ["", "## Plots", ""] + [f"![{name}]({name})" for name in images]
    return "\n".join(lines) + "\n"


def html_page(md_text: str, out: Path, images: list[str]) -> str:
    """A self-contained HTML page of the Markdown (CommonMark with tables, by markdown-it-py; raw
    HTML in the text is escaped), each plot in `images` embedded as a data URI."""
    for name in images:
        data = base64.b64encode((out / name).read_bytes()).decode()
        md_text = md_text.replace(f"]({name})", f"](data:image/png;base64,{data})")
    body = MarkdownIt("commonmark", {"html": False}).enable("table").render(md_text)
    style = (
        "body{font-family:sans-serif;max-width:1200px;margin:2em auto}"
        "table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ccc;padding:2px 6px}"
    )
    return f"<!doctype html><html><head><meta charset='utf-8'><style>{style}</style></head><body>{body}</body></html>\n"


def write(report: dict[str, Any], pairs: list[Pair], records: list[Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    images = plots(pairs, records, out)
    (out / "report.json").write_text(json.dumps(_json_safe(report), indent=1) + "\n")
    md_text = markdown(report, images)
    (out / "report.md").write_text(md_text)
    (out / "report.html").write_text(html_page(md_text, out, images))
