"""`replaykv accept`: run an acceptance contract in process or against two endpoints.

    replaykv accept                                   # the shipped example contract, bundled model
    replaykv accept --contract my.yaml --model DIR --out report/
    replaykv accept --contract my.yaml --baseline-url http://a:30000 --candidate-url http://b:30000 \\
        --admin-key KEY
    replaykv accept --verify-report report/report.json --contract my.yaml

Exit status: 0 when every criterion passes, 1 when one fails, 2 for unusable input.
Parsing only; the work is in :mod:`replaykv.accept.harness`. Not for: library logic.
"""

from __future__ import annotations

import argparse
import sys

from replaykv.accept.contract import EXAMPLE, ContractError, load_contract
from replaykv.cli_parser import ArgumentParser
from replaykv.replay import FAULTS


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="replaykv accept", description="Run an acceptance contract.")
    p.add_argument("--contract", default=str(EXAMPLE), help="contract YAML (default: the shipped example)")
    p.add_argument("--out", default="accept-report", help="report directory (report.json, .md, .html)")
    g = p.add_argument_group("in process (default)")
    g.add_argument(
        "--model", default=None, help="checkpoint directory (default: the bundled model, else --preset)"
    )
    g.add_argument(
        "--preset", default=None, help="preset with random weights (default: the bundled model, else 'small')"
    )
    g.add_argument("--seed", type=int, default=0, help="seed of a preset's random weights")
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    g.add_argument("--inject-fault", default=None, choices=FAULTS, help="break the candidate on purpose")
    e = p.add_argument_group("endpoints")
    e.add_argument("--baseline-url", default=None, help="OpenAI-compatible server with replay off")
    e.add_argument("--candidate-url", default=None, help="the same deployment with the stage's replay on")
    e.add_argument("--api-key", default="none")
    e.add_argument("--admin-key", default=None, help="bearer key of both servers' /admin endpoints")
    e.add_argument("--window", type=int, default=128, help="the model's sliding window (endpoint mode)")
    p.add_argument("--no-progress", action="store_true", help="log a line every 10 cases instead of a progress bar")
    p.add_argument("--verify-report", default=None, help="check that REPORT was produced under --contract")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from replaykv.accept.harness import Endpoints, InProcess, run_contract, verify_report
    from replaykv.accept.targets import TargetError

    try:
        if args.verify_report:
            ok, msg = verify_report(args.verify_report, args.contract)
            print(msg)
            return 0 if ok else 1
        load_contract(args.contract)  # a bad contract is reported before anything starts
        if bool(args.baseline_url) != bool(args.candidate_url):
            print("error: endpoint mode needs both --baseline-url and --candidate-url", file=sys.stderr)
            return 2
        if args.baseline_url:
            if args.inject_fault:
                print(
                    "error: --inject-fault is for in-process runs (start the server with it)", file=sys.stderr
                )
                return 2
            target: InProcess | Endpoints = Endpoints(
                args.baseline_url, args.candidate_url, args.api_key, args.admin_key, args.window
            )
        else:
            from replaykv.server.settings import model_to_load

            found = model_to_load(args.model, args.preset is not None)
            model, preset = (str(found) if found is not None else None), args.preset or "small"
            if model is None:
                print(
                    f"replaykv accept: using preset {preset!r} with RANDOM weights "
                    "(divergences are meaningful, task success is not)",
                    file=sys.stderr,
                )
            target = InProcess(model, preset, args.seed, args.device, args.dtype, args.inject_fault)
        rep = run_contract(args.contract, args.out, target, progress=not args.no_progress)
    except (ContractError, TargetError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for v in rep["criteria"]:
        mark = "PASS" if v["passed"] else "FAIL"
        print(f"{mark}  {v['name']}: {v['metric']} {v['statistic']} = {v['value']:.4g} "
              f"({v['direction']} {v['threshold']:g}, margin {v['margin']:.4g}) {v['note']}")  # fmt: skip
    verdict = "PASS" if rep["passed"] else f"FAIL ({', '.join(rep['failing'])})"
    print(f"{verdict}: {rep['cases']} cases in {rep['seconds']:.0f} s; report in {args.out}/report.html")
    return 0 if rep["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
