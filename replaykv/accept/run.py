"""Running a contract: every case through the four cache states in both arms, then the load runs.

Quality pass (one request in flight, so each state is exactly the one forced):
    baseline   cold                      the reference every candidate request is compared with
    candidate  cold                      a cold full prefill under the candidate's switches
               hit                       an earlier request left [0, H) with its window snapshot
               miss                      ... and the snapshot was dropped (the miss strategy runs)
               shift (one per shift)     the miss state with the cut moved to H + d
Forcing a state: drop everything; send the prefix [0, H) as a request of one token (its prefill
commits the global KV and the snapshot at H, as a finished turn does); wait for write-back; for
the miss states drop the SWA pool; then send the whole prompt.

Load pass, per concurrency level: the first `load_prompts` cases in the miss state (the
candidate's replay path; the baseline's exact path), every prefix primed first, then the
follow-ups sent with that many requests in flight: latency percentiles, throughput and outcomes
under load.

Not for: statistics and verdicts (see :mod:`replaykv.accept.criteria`).
"""

from __future__ import annotations

import concurrent.futures
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from tqdm import tqdm

from replaykv.accept.cases import Case, outcome
from replaykv.accept.contract import Contract
from replaykv.accept.targets import Observation, Target


@dataclass
class Record:
    """One measured request."""

    case: str
    cell: dict[str, Any]
    index: int
    arm: str
    state: str
    phase: str
    cut: int
    offset: int
    repeat: int
    expected_path: str | None
    obs: Observation
    outcome: dict[str, Any] = field(default_factory=dict)
    shift: str | None = None
    prompt_tokens: int = 0

    @property
    def reached(self) -> bool | None:
        if self.expected_path is None or self.obs.path is None:
            return None
        return self.obs.path == self.expected_path

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["reached"] = self.reached
        return out


@dataclass
class RunResult:
    records: list[Record]
    resources: dict[str, Any]
    seconds: float
    concurrency: dict[str, int]


def miss_path(encoder_replay: bool, strategy: str = "bounded") -> str:
    """The path a snapshot miss takes: the configured strategy with encoder replay on, else the
    exact rebuild."""
    return strategy if encoder_replay else "exact"


class Runner:
    """Runs a contract against two targets (baseline and candidate)."""

    def __init__(self, contract: Contract, baseline: Target, candidate: Target, cases: list[Case],
                 expected_miss: dict[str, str | None], log: Callable[[str], None] | None = None,
                 progress: bool = False) -> None:  # fmt: skip
        self.contract = contract
        self.arms = {"baseline": baseline, "candidate": candidate}
        self.cases = cases
        self.expected_miss = expected_miss
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.progress = progress

    # -------------------------------------------------------------- one request in a forced state
    def _send(self, t: Target, case: Case, prompt: tuple[int, ...], repeat: int) -> Observation:
        s = self.contract.sampling
        return t.generate(
            prompt, case.max_tokens, case.ignore_eos, s.temperature, s.seed + repeat, s.logprobs,
            case.images_before(len(prompt)),
        )  # fmt: skip

    def _prime(self, t: Target, case: Case, cut: int) -> None:
        """An earlier request that leaves [0, cut) cached (global KV + snapshot), with the images
        of that prefix."""
        obs = t.generate(case.prompt[:cut], 1, True, 0.0, 0, 0, case.images_before(cut))
        if obs.error:
            raise RuntimeError(f"{t.name}: priming {case.id} at {cut} failed: {obs.error}")

    def forced(self, arm: str, case: Case, state: str, cut: int, repeat: int) -> Observation:
        t = self.arms[arm]
        t.flush_all()
        if state != "cold":
            self._prime(t, case, cut)
            if state == "hit":
                t.flush_writeback()
            else:
                t.flush_pool()
        return self._send(t, case, case.prompt, repeat)

    def _record(self, arm: str, case: Case, state: str, phase: str, cut: int, repeat: int,
                obs: Observation, shift: str | None = None) -> Record:  # fmt: skip
        expected = {"cold": "cold", "hit": "hit"}.get(state, self.expected_miss.get(arm))
        return Record(
            case=case.id,
            cell=asdict(case.cell),
            index=case.index,
            arm=arm,
            state=state,
            phase=phase,
            cut=cut,
            offset=cut - case.evidence[1],
            repeat=repeat,
            expected_path=expected,
            obs=obs,
            outcome=outcome(case, obs.ids)
            if obs.error is None
            else {"success": False if case.cell.scored else None, "valid": None},
            shift=shift,
            prompt_tokens=len(case.prompt),
        )

    # -------------------------------------------------------------- passes
    def quality(self) -> list[Record]:
        """Every case in every state, `repeats` times: a tqdm bar over its requests with
        ``progress``, else a log line every 10 cases."""
        out: list[Record] = []
        reps = self.contract.matrix.repeats
        total = sum(reps * (4 + len(case.shifts)) for case in self.cases)
        bar = tqdm(total=total, disable=not self.progress, desc="accept quality", unit="req")
        t0 = time.perf_counter()
        for n, case in enumerate(self.cases):
            for r in range(reps):
                out.append(self._record("baseline", case, "cold", "quality", 0, r,
                                        self.forced("baseline", case, "cold", 0, r)))  # fmt: skip
                for state in ("cold", "hit", "miss"):
                    cut = 0 if state == "cold" else case.cut
                    obs = self.forced("candidate", case, state, cut, r)
                    out.append(self._record("candidate", case, state, "quality", cut, r, obs))
                for label, cut in case.shifts:
                    obs = self.forced("candidate", case, "shift", cut, r)
                    out.append(self._record("candidate", case, "shift", "quality", cut, r, obs, label))
                bar.update(4 + len(case.shifts))
            if not self.progress and ((n + 1) % 10 == 0 or n + 1 == len(self.cases)):
                self.log(
                    f"accept: quality pass {n + 1}/{len(self.cases)} cases ({time.perf_counter() - t0:.0f} s)"
                )
        bar.close()
        return out

    def levels(self) -> dict[str, int]:
        b = self.contract.max_batch
        named = {"normal": max(2, b // 2), "saturated": 2 * b}
        return {
            str(c): (named[c] if isinstance(c, str) else int(c)) for c in self.contract.matrix.concurrency
        }

    def load(self) -> list[Record]:
        out: list[Record] = []
        cases = self.cases[: self.contract.matrix.load_prompts]
        for label, c in self.levels().items():
            for arm, t in self.arms.items():
                t.flush_all()
                for case in cases:
                    self._prime(t, case, case.cut)
                t.flush_pool()
                with concurrent.futures.ThreadPoolExecutor(max_workers=c) as pool:
                    futures = [pool.submit(self._send, t, case, case.prompt, 0) for case in cases]
                    obs = [f.result() for f in futures]
                for case, o in zip(cases, obs, strict=True):
                    out.append(self._record(arm, case, "miss", f"load:{label}", case.cut, 0, o))
            self.log(f"accept: load pass at concurrency {label} ({c}) done")
        return out

    def run(self) -> RunResult:
        t0 = time.perf_counter()
        before = {arm: t.cache_stats() for arm, t in self.arms.items()}
        records = self.quality()
        after = {arm: t.cache_stats() for arm, t in self.arms.items()}
        records += self.load()
        resources = {arm: _resources(before[arm], after[arm]) for arm in self.arms}
        return RunResult(records, resources, time.perf_counter() - t0, self.levels())


def _get(d: Any, *path: str) -> float:
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return 0.0
        d = d[p]
    return float(d) if isinstance(d, (int, float)) else 0.0


def _resources(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Ledger traffic of the quality pass, from the engine's cache statistics (zeros when the
    target reports none)."""

    def delta(*path: str) -> float:
        return _get(after, *path) - _get(before, *path)

    lookups = delta("swa_pool", "lookups")
    return {
        "global_kv_bytes_written": delta("writes", "chunk_bytes") + delta("writes", "tail_bytes"),
        "swa_kv_bytes_written": delta("writes", "snapshot_pool_bytes"),
        "snapshot_store_bytes_written": delta("writes", "snapshot_store_bytes"),
        "pool_lookups": lookups,
        "pool_found": delta("swa_pool", "found"),
        "write_drops": delta("writes", "dropped"),
        "reported": bool(after),
    }
