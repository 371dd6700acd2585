"""One contract run end to end: targets, cases, passes, verdicts, report.

In-process (``model_dir`` or a preset): two engines in this process with everything equal but
the replay switches the contract's stage gives the candidate (the baseline has both off); each
has its own store directory and memory pool. Endpoint mode: two OpenAI-compatible servers that
were started with the switches to compare (and replaykv's admin endpoints); the harness checks
that the candidate takes the path its stage implies (criterion metric ``state_reached``).

Image cases (suffix ``image``) need a model with a vision tower and run in process only (a
token-id completion carries no images); a contract that asks for them otherwise is refused
before any engine starts.

Not for: argument parsing (see :mod:`replaykv.accept.cli`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replaykv.accept import report as report_mod
from replaykv.accept.cases import ImageSetup, build_cases
from replaykv.accept.contract import Contract, ContractError, load_contract
from replaykv.accept.criteria import cell_table, load_table, pair_up, verdicts
from replaykv.accept.run import Runner, miss_path
from replaykv.accept.targets import EndpointTarget, InProcessTarget, Target


@dataclass(frozen=True)
class InProcess:
    """Both arms in this process: the model (directory, else preset with random weights) and the
    engine settings they share."""

    model_dir: str | None = None
    preset: str = "small"
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    fault: str | None = None  # injected into the candidate only


@dataclass(frozen=True)
class Endpoints:
    baseline_url: str
    candidate_url: str
    api_key: str = "none"
    admin_key: str | None = None
    window: int = 128


def _environment() -> dict[str, Any]:
    import torch

    import replaykv

    commit = None
    root = Path(replaykv.__file__).resolve().parent.parent
    if (root / ".git").exists():
        try:
            commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                                    text=True, timeout=10).stdout.strip() or None  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            commit = None
    return {
        "replaykv": getattr(replaykv, "__version__", "unknown"),
        "commit": commit,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
    }


def _image_setup(contract: Contract, target: InProcess | Endpoints) -> ImageSetup | None:
    """The model's image setup when the matrix has image cases; refuses them (ContractError)
    on a model without a vision tower or in endpoint mode. Reads only the model's config."""
    if "image" not in contract.matrix.suffixes:
        return None
    if isinstance(target, Endpoints):
        raise ContractError(
            "matrix.suffixes has 'image', but endpoint mode sends token-id completions, which carry "
            "no images; run image cases in process (--model DIR or --preset with a vision tower)"
        )
    if target.model_dir is not None:
        from replaykv.model.checkpoint import load_config

        config: Any = load_config(target.model_dir)
        name = target.model_dir
    else:
        from replaykv.model.presets import get_preset

        config, name = get_preset(target.preset), f"preset {target.preset}"
    setup = ImageSetup.from_config(config)
    if setup is None:
        raise ContractError(
            f"matrix.suffixes has 'image', but the model ({name}) has no vision tower (its config has "
            "no vision_config); use a vision model (e.g. --preset v41-tiny-vision) or remove 'image' "
            "from matrix.suffixes"
        )
    return setup


def _in_process(
    contract: Contract, where: InProcess, tmp: Path
) -> tuple[Target, Target, int, dict[str, str | None]]:
    from replaykv.engine.config import EngineConfig

    m = contract.matrix
    context = max(m.lengths) + max(m.long_tokens, m.max_answer_tokens) + 16
    common: dict[str, Any] = {
        "model_dir": where.model_dir,
        "preset": where.preset,
        "seed": where.seed,
        "device": where.device,
        "dtype": where.dtype,
        "max_batch": contract.max_batch,
        "max_context": context,
        "max_queue": 4 * contract.max_batch + 64,
        "chunk_size": contract.chunk_size,
        "swa_pool": "memory",
    }
    enc, dec = contract.candidate_switches
    base_cfg = EngineConfig(**common, store_dir=str(tmp / "baseline"), enable_encoder_swa_bounded_replay=False,
                            enable_decoder_swa_bounded_replay=False)  # fmt: skip
    cand_cfg = dataclasses.replace(
        base_cfg, store_dir=str(tmp / "candidate"), enable_encoder_swa_bounded_replay=enc,
        enable_decoder_swa_bounded_replay=dec, fault=where.fault,
    )  # fmt: skip
    baseline = InProcessTarget("baseline", base_cfg)
    candidate = InProcessTarget("candidate", cand_cfg)
    window = int(baseline.engine.spec.sliding_window)
    expected: dict[str, str | None] = {
        "baseline": "exact",
        "candidate": miss_path(enc, cand_cfg.swa_miss_strategy),
    }
    return baseline, candidate, window, expected


def run_contract(
    contract_path: str | Path, out: str | Path, target: InProcess | Endpoints, progress: bool = False
) -> dict[str, Any]:
    """Run a contract and write its report to `out`; returns the report (``passed`` is the verdict).
    `progress`: a tqdm bar over the quality pass's requests on stderr."""
    from replaykv.train.data import load_corpus

    t0 = time.perf_counter()
    contract_path = Path(contract_path)
    contract = load_contract(contract_path)
    images = _image_setup(contract, target)  # before any engine starts
    out = Path(out)
    with tempfile.TemporaryDirectory(prefix="replaykv-accept-") as tmp:
        if isinstance(target, InProcess):
            baseline, candidate, window, expected = _in_process(contract, target, Path(tmp))
        else:
            baseline = EndpointTarget("baseline", target.baseline_url, target.api_key, target.admin_key)
            candidate = EndpointTarget("candidate", target.candidate_url, target.api_key, target.admin_key)
            window = target.window
            expected = {"baseline": "exact", "candidate": miss_path(contract.candidate_switches[0])}
        try:
            heldout = load_corpus(splits=("heldout",))["heldout"]
            cases = build_cases(contract, heldout, window, images)
            if not cases:
                raise ValueError("the matrix produced no runnable case (lengths too short for the tasks?)")
            runner = Runner(contract, baseline, candidate, cases, expected, progress=progress)
            result = runner.run()
            arms = {"baseline": baseline.describe(), "candidate": candidate.describe()}
        finally:
            baseline.close()
            candidate.close()
    pairs = pair_up(result.records)
    crit = verdicts(contract, pairs, result.records)
    failing = [v["name"] for v in crit if not v["passed"]]
    notes = []
    if images is not None:
        notes.append(
            "image cases (suffix 'image') are scored by agreement with the baseline's cold path "
            "(KL, top-1 agreement, exact outputs), not by task success: no trained model reads images"
        )
    rep: dict[str, Any] = {
        "contract": contract.to_dict(),
        "contract_digest": contract.digest(),
        "contract_file_sha256": hashlib.sha256(contract_path.read_bytes()).hexdigest(),
        "environment": _environment(),
        "arms": arms,
        "window": window,
        "passed": not failing,
        "passed_count": len(crit) - len(failing),
        "failing": failing,
        "criteria": crit,
        "cells": cell_table(pairs),
        "load": load_table(result.records),
        "concurrency_levels": result.concurrency,
        "resources": result.resources,
        "notes": notes,
        "cases": len(cases),
        "seconds": time.perf_counter() - t0,
        "pairs": [
            {
                "case": p.cand.case,
                "state": p.cand.state,
                "shift": p.cand.shift,
                "repeat": p.cand.repeat,
                "kl": p.kl,
                "kl_first": p.kl_first,
                "top1": p.top1,
                "exact": p.exact,
                "first_divergence": p.first_divergence,
                "compared_tokens": p.compared,
            }
            for p in pairs
        ],
        "records": [r.to_dict() for r in result.records],
    }
    report_mod.write(rep, pairs, result.records, out)
    return rep


def verify_report(report_path: str | Path, contract_path: str | Path) -> tuple[bool, str]:
    """Whether a report was produced under this exact contract (its digest frozen in the report)."""
    import json

    rep = json.loads(Path(report_path).read_text())
    digest = load_contract(contract_path).digest()
    if rep.get("contract_digest") == digest:
        return True, f"the report was produced under this contract ({digest[:16]})"
    return False, (
        f"the contract changed since the run: report digest {str(rep.get('contract_digest'))[:16]}, "
        f"contract now {digest[:16]}"
    )
