"""The launch contract: what to run, what to measure and what must hold, frozen before the run.

A contract is a YAML file (see ``replaykv/accept/contracts/example.yaml``) parsed into frozen
dataclasses. Its digest (SHA-256 over the canonical JSON of the parsed contract) is written into
every report, so a threshold changed after a run shows up as a different digest.

    stage        the rollout stage the candidate is at; it fixes the candidate's replay switches
                 (baseline: replay off in both arms, an A/A check; decoder_replay; measure_pool:
                 decoder replay with the SWA pool's hit rate as a gate; encoder_replay: both)
    matrix       the cells: tasks x cut positions x context lengths x uncached suffixes x
                 output lengths (one factor at a time around the first value of each, or the
                 full product), prompts per cell, shifted cuts, concurrency levels, repeats
    sampling     temperature (0 = greedy, one run; > 0 needs repeats) and seed
    criteria     named pass/fail rules over the metrics (:data:`METRICS`), each with its state,
                 task and suffix filters, a threshold and the statistic compared to it

Not for: running anything (see :mod:`replaykv.accept.run`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

STAGES = {
    # stage: (encoder bounded replay, decoder bounded replay) of the candidate
    "baseline": (False, False),
    "decoder_replay": (False, True),
    "measure_pool": (False, True),
    "encoder_replay": (True, True),
}
"""The rollout order of the source document: replay off, then decoder replay, then measure the
SWA pool's hit rate, then encoder replay. The baseline arm always has both switches off."""

STATES = ("cold", "hit", "miss", "shift")
"""The four cache states of every prompt: cold full prefill; global KV and window snapshot both
hit; global hit with the snapshot missing; the same global hit at a shifted cut point."""

CUTS = ("end", "start", "window_before", "window_after", "boundary")
"""Where the cached prefix ends: where the uncached suffix begins (end); 64 tokens in (start);
just before and after position W (window_before / window_after: W - 1, W + 1); so that the
evidence ends just before the bounded-replay span [H - W, H) (boundary)."""

SUFFIXES = ("short", "empty", "long", "image")
"""The uncached suffix at cut "end": the last `short_suffix` tokens (a short dialogue turn: the
question), none (the whole prompt was cached: a hit at S - 1, since the last token is always
computed), the last `long_suffix` tokens (a long tool result plus the question), or an image and
text: after the answered first turn, a user turn holding a generated picture and a short question
about it. The image suffix needs a model with a vision tower (the harness refuses it before it
starts otherwise) and is scored by agreement with the baseline, not by task success."""

OUTPUTS = ("short", "long", "multi_turn")
"""short: the answer (stops at its end); long: `long_tokens` generated with end-of-text ignored;
multi_turn: a second turn (the first turn's reference answer, then a follow-up question) whose
cached prefix is the first turn."""

METRICS = {
    # name: (direction, default statistic) — "<=" passes when the statistic is at most the threshold
    "success_drop": ("<=", "upper95"),
    "new_failures": ("<=", "point"),
    "validity_drop": ("<=", "upper95"),
    "kl_mean": ("<=", "upper95"),
    "kl_first": ("<=", "upper95"),
    "top1_agreement": (">=", "lower95"),
    "exact_match": (">=", "lower95"),
    "prefill_work_ratio": ("<=", "point"),
    "pool_miss_rate": ("<=", "point"),
    "ttft_p99_ratio": ("<=", "point"),
    "e2e_p99_ratio": ("<=", "point"),
    "state_reached": (">=", "point"),
}
"""What a criterion can gate on (candidate against baseline, paired per prompt):

success_drop      baseline success rate minus candidate success rate (bootstrap interval;
                  the exact McNemar p-value is reported beside it)
new_failures      prompts the baseline solves and the candidate does not (a count)
validity_drop     the same for structured-output validity (extract: a JSON object, 4 fields)
kl_mean           KL(baseline cold || candidate) per generated token, averaged over the tokens
                  both arms generated from the same context (up to the first divergent one)
kl_first          the same KL at the first generated token only (the prefill state itself)
top1_agreement    share of compared tokens whose most likely token is the same
exact_match       share of outputs identical to the baseline's
prefill_work_ratio  candidate layer x token prefill work over a cold full prefill's
pool_miss_rate    SWA pool lookups that found no snapshot, over the candidate's run
ttft_p99_ratio, e2e_p99_ratio  candidate / baseline latency percentile (the load runs)
state_reached     share of requests whose reported path is the one the state forces
"""


TASK_METRICS = ("success_drop", "new_failures", "validity_drop")
"""The metrics of task outcomes, which image cases do not have (no trained model reads images)."""


class ContractError(ValueError):
    """The contract file is not valid (the message names the field)."""


@dataclass(frozen=True)
class Matrix:
    tasks: tuple[str, ...] = ("passkey", "multihop", "chain", "code_edit", "extract", "tool")
    cuts: tuple[str, ...] = ("end", "boundary", "window_before", "window_after", "start")
    lengths: tuple[int, ...] = (1024,)
    suffixes: tuple[str, ...] = ("short", "empty", "long")
    outputs: tuple[str, ...] = ("short", "long", "multi_turn")
    design: str = "one_at_a_time"  # or "factorial"
    prompts_per_cell: int = 2
    shifts: tuple[int, ...] = (-130, 130)  # tokens the cut moves for the "shift" state
    chunk_shifts: bool = True  # also move the cut across the nearest chunk boundary
    concurrency: tuple[int | str, ...] = (1, "normal", "saturated")
    load_prompts: int = 12  # cases sent at each concurrency level
    repeats: int = 1
    short_suffix: int = 24
    long_suffix: int = 280
    long_tokens: int = 48
    max_answer_tokens: int = 96


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    seed: int = 0
    logprobs: int = 20  # alternatives per token for the KL estimate (OpenAI's maximum)


@dataclass(frozen=True)
class Criterion:
    name: str
    metric: str
    threshold: float
    states: tuple[str, ...] = ()  # empty: every state the metric applies to
    tasks: tuple[str, ...] = ()  # empty: every task
    suffixes: tuple[str, ...] = ()  # empty: every uncached suffix (e.g. [image]: image cases only)
    statistic: str = ""  # point | upper95 | lower95 ("" = the metric's default)

    @property
    def direction(self) -> str:
        return METRICS[self.metric][0]

    @property
    def stat(self) -> str:
        return self.statistic or METRICS[self.metric][1]


@dataclass(frozen=True)
class Contract:
    name: str
    stage: str
    matrix: Matrix
    sampling: Sampling
    criteria: tuple[Criterion, ...]
    description: str = ""
    chunk_size: int = 256  # the engines' chunk size (for chunk-boundary shifts)
    max_batch: int = 4  # "normal" concurrency is max_batch // 2, "saturated" 2 * max_batch
    bootstrap: int = 2000

    @property
    def candidate_switches(self) -> tuple[bool, bool]:
        return STAGES[self.stage]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def digest(self) -> str:
        """SHA-256 of the canonical JSON of the parsed contract (frozen into every report)."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()


def _tuple(value: Any, name: str) -> tuple[Any, ...]:
    if isinstance(value, (list, tuple)):
        return tuple(value)
    raise ContractError(f"{name} must be a list, got {value!r}")


def _check_subset(values: tuple[Any, ...], allowed: tuple[str, ...], name: str) -> None:
    bad = [v for v in values if v not in allowed]
    if bad:
        raise ContractError(f"{name}: unknown {bad}; choose from {list(allowed)}")


def _build(cls: Any, raw: Any, name: str) -> Any:
    if raw is None:
        return cls()
    if not isinstance(raw, dict):
        raise ContractError(f"{name} must be a mapping, got {raw!r}")
    fields = cls.__dataclass_fields__
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ContractError(f"{name}: unknown field(s) {unknown}; known: {sorted(fields)}")
    kwargs = {}
    for key, value in raw.items():
        tuple_field = isinstance(fields[key].default, tuple)
        kwargs[key] = _tuple(value, f"{name}.{key}") if tuple_field else value
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ContractError(f"{name}: {e}") from e


def parse_contract(raw: Any) -> Contract:
    """A validated :class:`Contract` from parsed YAML (raises ContractError naming the field)."""
    from replaykv.accept.cases import ACCEPT_TASKS as TASKS

    if not isinstance(raw, dict):
        raise ContractError("a contract is a YAML mapping")
    known = {
        "name",
        "stage",
        "matrix",
        "sampling",
        "criteria",
        "description",
        "chunk_size",
        "max_batch",
        "bootstrap",
    }
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ContractError(f"unknown top-level field(s) {unknown}; known: {sorted(known)}")
    for key in ("name", "stage", "criteria"):
        if key not in raw:
            raise ContractError(f"the contract needs '{key}'")
    stage = raw["stage"]
    if stage not in STAGES:
        raise ContractError(f"stage: {stage!r} is not one of {list(STAGES)}")
    matrix = _build(Matrix, raw.get("matrix"), "matrix")
    _check_subset(matrix.tasks, TASKS, "matrix.tasks")
    _check_subset(matrix.cuts, CUTS, "matrix.cuts")
    _check_subset(matrix.suffixes, SUFFIXES, "matrix.suffixes")
    _check_subset(matrix.outputs, OUTPUTS, "matrix.outputs")
    if matrix.design not in ("one_at_a_time", "factorial"):
        raise ContractError("matrix.design must be one_at_a_time or factorial")
    for name in ("tasks", "cuts", "lengths", "suffixes", "outputs"):
        if not getattr(matrix, name):
            raise ContractError(f"matrix.{name} must not be empty")
    if any(not isinstance(n, int) or n < 256 for n in matrix.lengths):
        raise ContractError(f"matrix.lengths must be integers >= 256, got {list(matrix.lengths)}")
    for c in matrix.concurrency:
        if not (c in ("normal", "saturated") or (isinstance(c, int) and c >= 1)):
            raise ContractError(
                f"matrix.concurrency: {c!r} is not a positive integer, 'normal' or 'saturated'"
            )
    for name in (
        "prompts_per_cell",
        "load_prompts",
        "repeats",
        "short_suffix",
        "long_suffix",
        "long_tokens",
        "max_answer_tokens",
    ):
        if not isinstance(getattr(matrix, name), int) or getattr(matrix, name) < 1:
            raise ContractError(f"matrix.{name} must be a positive integer")
    if any(not isinstance(s, int) or s == 0 for s in matrix.shifts):
        raise ContractError("matrix.shifts must be non-zero integers (tokens the cut moves)")
    sampling = _build(Sampling, raw.get("sampling"), "sampling")
    if sampling.temperature < 0:
        raise ContractError("sampling.temperature must be >= 0")
    if sampling.temperature > 0 and matrix.repeats < 2:
        raise ContractError("sampling.temperature > 0 is random: set matrix.repeats >= 2")
    if not 0 <= sampling.logprobs <= 20:
        raise ContractError("sampling.logprobs must be in [0, 20]")
    crit_raw = raw["criteria"]
    if not isinstance(crit_raw, list) or not crit_raw:
        raise ContractError("criteria must be a non-empty list (write the pass criteria before the run)")
    criteria = []
    for i, c in enumerate(crit_raw):
        crit = _build(Criterion, c, f"criteria[{i}]")
        if not isinstance(crit.threshold, (int, float)):
            raise ContractError(f"criteria[{i}].threshold must be a number, got {crit.threshold!r}")
        crit = dataclasses.replace(crit, threshold=float(crit.threshold))
        if crit.metric not in METRICS:
            raise ContractError(f"criteria[{i}].metric: {crit.metric!r} is not one of {sorted(METRICS)}")
        _check_subset(crit.states, STATES, f"criteria[{i}].states")
        _check_subset(crit.tasks, TASKS, f"criteria[{i}].tasks")
        _check_subset(crit.suffixes, SUFFIXES, f"criteria[{i}].suffixes")
        if set(crit.suffixes) == {"image"} and crit.metric in TASK_METRICS:
            raise ContractError(
                f"criteria[{i}]: image cases are not scored for task success ({crit.metric}); judge them "
                "by agreement with the baseline (kl_mean, kl_first, top1_agreement, exact_match)"
            )
        if crit.statistic not in ("", "point", "upper95", "lower95"):
            raise ContractError(f"criteria[{i}].statistic must be point, upper95 or lower95")
        criteria.append(crit)
    names = [c.name for c in criteria]
    if len(set(names)) != len(names):
        raise ContractError("criteria names must be unique")
    extra = {k: raw[k] for k in ("chunk_size", "max_batch", "bootstrap") if k in raw}
    for key, value in extra.items():
        if not isinstance(value, int) or value < 1:
            raise ContractError(f"{key} must be a positive integer")
    return Contract(
        name=str(raw["name"]),
        stage=stage,
        matrix=matrix,
        sampling=sampling,
        criteria=tuple(criteria),
        description=str(raw.get("description", "")),
        **extra,
    )


def load_contract(path: str | Path) -> Contract:
    """Read and validate a contract file."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        raise ContractError(f"{path}: not valid YAML: {e}") from e
    return parse_contract(raw)


EXAMPLE = Path(__file__).with_name("contracts") / "example.yaml"
"""The shipped example contract."""


__all__ = [
    "CUTS",
    "EXAMPLE",
    "METRICS",
    "OUTPUTS",
    "STAGES",
    "STATES",
    "SUFFIXES",
    "Contract",
    "ContractError",
    "Criterion",
    "Matrix",
    "Sampling",
    "load_contract",
    "parse_contract",
]
