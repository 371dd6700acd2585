"""Workload description for the capacity planner: distributions, sizes, durations.

A :class:`Workload` says what traffic looks like (turn and output lengths, turns per session,
think time between turns, session arrivals, concurrency) and what the fleet has (host RAM and
the SWA-pool fraction, SSD, device memory, machines, retention, pool TTL). It loads from a YAML
or JSON file (:func:`load_workload`) and from command-line style strings:

* a distribution is ``KIND:ARGS`` — ``fixed:512``, ``exponential:45s`` (mean),
  ``lognormal:600:1.0`` (mean, sigma of the log), ``uniform:100:2000`` (low, high),
  ``empirical:10,60,300`` (equally likely values) — or a bare number (fixed); in YAML also a
  mapping ``{dist: lognormal, mean: 600, sigma: 1.0}``;
* a size is a number of bytes with an optional unit: ``512GiB``, ``2TB``, ``1.5e12``;
* a duration is seconds with an optional unit: ``300``, ``5m``, ``72h``, ``1d``;
* an image size is ``WIDTHxHEIGHT`` in pixels (``1024x768``) or a pair ``[1024, 768]``.

Images: `images_per_turn` images in every user turn (the first included), each given by its
pixel size (the model's resize plan turns it into a span of positions) or directly by its
span length `image_tokens`; the planner adds their positions to every turn's input tokens.

Not for: the planning arithmetic (see :mod:`replaykv.plan.planner`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

# ---------------------------------------------------------------------------------------------
# Units
# ---------------------------------------------------------------------------------------------

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50,
}  # fmt: skip
_TIME_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_NUMBER_UNIT = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*([A-Za-z]*)\s*$")


def _split(text: str, what: str) -> tuple[float, str]:
    m = _NUMBER_UNIT.match(text)
    if not m:
        raise ValueError(f"cannot read {what} {text!r}; write a number with an optional unit")
    return float(m.group(1)), m.group(2).lower()


def parse_size(value: str | float | int) -> float:
    """Bytes from ``512GiB``, ``2TB``, ``1e12`` or a number."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    number, unit = _split(str(value), "size")
    if unit not in _SIZE_UNITS:
        raise ValueError(f"unknown size unit {unit!r} in {value!r}; use one of {sorted(_SIZE_UNITS)}")
    return number * _SIZE_UNITS[unit]


def parse_duration(value: str | float | int) -> float:
    """Seconds from ``300``, ``5m``, ``72h``, ``1d``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    number, unit = _split(str(value), "duration")
    if unit not in _TIME_UNITS:
        raise ValueError(f"unknown time unit {unit!r} in {value!r}; use one of {sorted(_TIME_UNITS)}")
    return number * _TIME_UNITS[unit]


# ---------------------------------------------------------------------------------------------
# Distributions (non-negative quantities: token counts, seconds)
# ---------------------------------------------------------------------------------------------


def _phi(z: float) -> float:
    """Standard normal CDF."""
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


@dataclass(frozen=True)
class Distribution:
    """A non-negative random quantity. Subclasses register under :attr:`kind`."""

    kind: ClassVar[str] = ""
    registry: ClassVar[dict[str, type[Distribution]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.kind:
            Distribution.registry[cls.kind] = cls

    def mean(self) -> float:
        raise NotImplementedError

    def cdf(self, x: float) -> float:
        """P(X <= x)."""
        raise NotImplementedError

    def mean_min(self, cap: float) -> float:
        """E[min(X, cap)] = ∫_0^cap (1 − F(t)) dt (numeric unless a subclass knows better)."""
        if cap <= 0:
            return 0.0
        n = 2000
        h = cap / n
        return h * sum(1.0 - self.cdf((i + 0.5) * h) for i in range(n))

    def quantile(self, p: float) -> float:
        """Smallest x with F(x) >= p (bisection unless a subclass knows better)."""
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"quantile level must lie in [0, 1], got {p}")
        hi = max(self.mean(), 1.0)
        while self.cdf(hi) < p:
            hi *= 2.0
            if hi > 1e18:
                return math.inf
        lo = 0.0
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            if self.cdf(mid) >= p:
                hi = mid
            else:
                lo = mid
        return hi

    def describe(self) -> str:
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        """The mapping :func:`parse_distribution` reads back."""
        out: dict[str, Any] = {"dist": self.kind}
        for k, v in dataclasses.asdict(self).items():
            out["mean" if k == "mean_value" else k] = list(v) if isinstance(v, tuple) else v
        return out


@dataclass(frozen=True)
class Fixed(Distribution):
    kind: ClassVar[str] = "fixed"
    value: float

    def mean(self) -> float:
        return self.value

    def cdf(self, x: float) -> float:
        return 1.0 if x >= self.value else 0.0

    def mean_min(self, cap: float) -> float:
        return min(self.value, max(cap, 0.0))

    def quantile(self, p: float) -> float:
        return self.value

    def describe(self) -> str:
        return f"fixed {self.value:g}"


@dataclass(frozen=True)
class Exponential(Distribution):
    kind: ClassVar[str] = "exponential"
    mean_value: float

    def mean(self) -> float:
        return self.mean_value

    def cdf(self, x: float) -> float:
        return 0.0 if x <= 0 else 1.0 - math.exp(-x / self.mean_value)

    def mean_min(self, cap: float) -> float:
        return 0.0 if cap <= 0 else self.mean_value * (1.0 - math.exp(-cap / self.mean_value))

    def quantile(self, p: float) -> float:
        return math.inf if p >= 1.0 else -self.mean_value * math.log1p(-p)

    def describe(self) -> str:
        return f"exponential, mean {self.mean_value:g}"


@dataclass(frozen=True)
class LogNormal(Distribution):
    """Log-normal with the given mean and σ of the log (μ = ln mean − σ²/2)."""

    kind: ClassVar[str] = "lognormal"
    mean_value: float
    sigma: float

    @property
    def mu(self) -> float:
        return math.log(self.mean_value) - self.sigma**2 / 2

    def mean(self) -> float:
        return self.mean_value

    def cdf(self, x: float) -> float:
        return 0.0 if x <= 0 else _phi((math.log(x) - self.mu) / self.sigma)

    def mean_min(self, cap: float) -> float:
        if cap <= 0:
            return 0.0
        z = (math.log(cap) - self.mu) / self.sigma
        return self.mean_value * _phi(z - self.sigma) + cap * (1.0 - _phi(z))

    def describe(self) -> str:
        return f"lognormal, mean {self.mean_value:g}, sigma {self.sigma:g} (median {math.exp(self.mu):.3g})"


@dataclass(frozen=True)
class Uniform(Distribution):
    kind: ClassVar[str] = "uniform"
    low: float
    high: float

    def mean(self) -> float:
        return 0.5 * (self.low + self.high)

    def cdf(self, x: float) -> float:
        if x < self.low:
            return 0.0
        return 1.0 if x >= self.high else (x - self.low) / (self.high - self.low)

    def describe(self) -> str:
        return f"uniform {self.low:g}..{self.high:g}"


@dataclass(frozen=True)
class Empirical(Distribution):
    """Equally likely observed values."""

    kind: ClassVar[str] = "empirical"
    values: tuple[float, ...]

    def mean(self) -> float:
        return sum(self.values) / len(self.values)

    def cdf(self, x: float) -> float:
        return sum(v <= x for v in self.values) / len(self.values)

    def mean_min(self, cap: float) -> float:
        return sum(min(v, max(cap, 0.0)) for v in self.values) / len(self.values)

    def quantile(self, p: float) -> float:
        ordered = sorted(self.values)
        return ordered[min(len(ordered) - 1, max(0, math.ceil(p * len(ordered)) - 1))]

    def describe(self) -> str:
        return f"empirical, {len(self.values)} values, mean {self.mean():g}"


@dataclass(frozen=True)
class Shifted(Distribution):
    """X + offset for a constant offset >= 0: a turn's input tokens plus the positions of its
    images. Not registered (no file or flag writes it); the planner builds it."""

    inner: Distribution
    offset: float

    def mean(self) -> float:
        return self.inner.mean() + self.offset

    def cdf(self, x: float) -> float:
        return self.inner.cdf(x - self.offset)

    def mean_min(self, cap: float) -> float:
        # E[min(X + c, cap)] = c + E[min(X, cap - c)] when cap > c, else cap.
        if cap <= 0:
            return 0.0
        return cap if cap <= self.offset else self.offset + self.inner.mean_min(cap - self.offset)

    def quantile(self, p: float) -> float:
        return self.inner.quantile(p) + self.offset

    def describe(self) -> str:
        return f"{self.inner.describe()} + {self.offset:g}"


def shifted(d: Distribution, offset: float) -> Distribution:
    """`d` moved right by `offset` (`d` itself when the offset is 0)."""
    if offset < 0 or not math.isfinite(offset):
        raise ValueError(f"a shift must be finite and >= 0, got {offset}")
    return d if offset == 0 else Shifted(d, offset)


def parse_image_size(value: Any) -> tuple[int, int]:
    """(width, height) in pixels from ``1024x768``, ``1024×768`` or a pair."""
    if isinstance(value, (list, tuple)):
        parts = list(value)
    else:
        parts = str(value).lower().replace("×", "x").split("x")
    try:
        if len(parts) != 2:
            raise ValueError
        width, height = (float(p) for p in parts)
    except (TypeError, ValueError):
        raise ValueError(
            f"cannot read image size {value!r}; write WIDTHxHEIGHT in pixels, e.g. 1024x768"
        ) from None
    if width != int(width) or height != int(height) or width < 1 or height < 1:
        raise ValueError(f"an image size needs whole, positive pixel counts; got {value!r}")
    return int(width), int(height)


def _check_distribution(d: Distribution, what: str) -> Distribution:
    params = [v for v in dataclasses.asdict(d).values()]
    flat: list[float] = []
    for p in params:
        flat.extend(p if isinstance(p, tuple) else [p])
    if not flat or any(not math.isfinite(v) or v < 0 for v in flat):
        raise ValueError(f"{what}: parameters must be finite and non-negative, got {d}")
    if isinstance(d, (Exponential, LogNormal)) and d.mean_value <= 0:
        raise ValueError(f"{what}: the mean must be positive")
    if isinstance(d, LogNormal) and d.sigma <= 0:
        raise ValueError(f"{what}: sigma must be positive (use fixed:N for a constant)")
    if isinstance(d, Uniform) and d.high <= d.low:
        raise ValueError(f"{what}: uniform needs low < high, got {d.low:g}..{d.high:g}")
    return d


def parse_distribution(spec: Any, what: str = "distribution", *, duration: bool = False) -> Distribution:
    """A :class:`Distribution` from a string (``lognormal:600:1.0``), a number, or a mapping."""
    num = parse_duration if duration else (lambda v: float(parse_size(v)))
    if isinstance(spec, Distribution):
        return spec
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        return _check_distribution(Fixed(float(spec)), what)
    if isinstance(spec, dict):
        d = dict(spec)
        kind = str(d.pop("dist", d.pop("kind", "fixed"))).lower()
        try:
            if kind == "fixed":
                out: Distribution = Fixed(num(d.pop("value")))
            elif kind in ("exponential", "exp"):
                out = Exponential(num(d.pop("mean")))
            elif kind == "lognormal":
                out = LogNormal(num(d.pop("mean")), float(d.pop("sigma")))
            elif kind == "uniform":
                out = Uniform(num(d.pop("low")), num(d.pop("high")))
            elif kind == "empirical":
                out = Empirical(tuple(num(v) for v in d.pop("values")))
            else:
                raise ValueError(
                    f"{what}: unknown distribution {kind!r}; use one of {sorted(Distribution.registry)}"
                )
        except KeyError as e:
            raise ValueError(f"{what}: {kind} needs the key {e.args[0]!r}") from e
        if d:
            raise ValueError(f"{what}: unknown keys {sorted(d)} for a {kind} distribution")
        return _check_distribution(out, what)
    text = str(spec).strip()
    kind, _, rest = text.partition(":")
    kind = kind.lower()
    if not rest:
        return _check_distribution(Fixed(num(text)), what)
    args = rest.split(":")
    try:
        if kind == "fixed" and len(args) == 1:
            return _check_distribution(Fixed(num(args[0])), what)
        if kind in ("exponential", "exp") and len(args) == 1:
            return _check_distribution(Exponential(num(args[0])), what)
        if kind == "lognormal" and len(args) == 2:
            return _check_distribution(LogNormal(num(args[0]), float(args[1])), what)
        if kind == "uniform" and len(args) == 2:
            return _check_distribution(Uniform(num(args[0]), num(args[1])), what)
        if kind == "empirical" and len(args) == 1:
            return _check_distribution(Empirical(tuple(num(v) for v in args[0].split(","))), what)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from e
    raise ValueError(
        f"{what}: cannot read {text!r}; write fixed:N, exponential:MEAN, lognormal:MEAN:SIGMA, "
        "uniform:LOW:HIGH, empirical:V1,V2,... or a bare number"
    )


# ---------------------------------------------------------------------------------------------
# Workload
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MultimodalLoad:
    """Inputs of the loading condition ρ < (B_IO / B_GPU) · C (first source document).

    ρ raw bytes per token; C compute per token (None = 6 × the model's active matmul parameters,
    the training FLOPs of one token); B_IO storage bandwidth (bytes/s) and B_GPU compute (FLOP/s),
    both per accelerator.
    """

    raw_bytes_per_token: float
    io_bandwidth: float
    gpu_flops: float
    compute_per_token: float | None = None


@dataclass(frozen=True)
class Workload:
    """Traffic and fleet for one plan. Sizes in bytes, times in seconds, rates per hour.

    The defaults describe the coding-agent workload of ``docs/planner.md``: a long first prompt
    (system prompt, tool schemas, task), then tool results and short tool calls, 40 turns, a think
    time that is mostly tool run time with a long human tail. `first_turn_tokens` None means
    "like turn_tokens".
    """

    turn_tokens: Distribution = field(default_factory=lambda: LogNormal(1500.0, 1.2))
    output_tokens: Distribution = field(default_factory=lambda: LogNormal(400.0, 1.0))
    first_turn_tokens: Distribution | None = field(default_factory=lambda: LogNormal(12000.0, 0.5))
    turns_per_session: int = 40
    think_time: Distribution = field(default_factory=lambda: LogNormal(45.0, 1.5))
    sessions_per_hour: float = 60000.0  # whole fleet
    concurrency: int = 64  # contexts resident on one machine's devices at once
    device_context_tokens: int | None = None  # context length for the device question (None = mean session)
    retention: float = 72 * 3600.0
    swa_ttl: float = 300.0
    host_ram: float = 2 * 2**40  # per machine
    pool_fraction: float = 0.10
    ssd: float = 30e12  # per machine
    machines: int = 32
    device_memory: float = 400 * 2**30  # per machine, left to the KV cache after weights
    snapshots_per_turn: int = 2  # window snapshots taken per turn (end of prefill, end of generation)
    target_hit_rate: float = 0.95
    replay_window: int | None = None  # None: the model's sliding_window
    decoder_replay: bool = True
    convention: str = "engine"  # see replaykv.model.accounting.CONVENTIONS
    multimodal: MultimodalLoad | None = None
    images_per_turn: float = 0.0  # images in every user turn, the first included (a mean)
    image_size: tuple[int, int] | None = None  # (width, height) pixels of each image
    image_tokens: int | None = None  # span length of each image (instead of image_size)

    def __post_init__(self) -> None:
        for name in ("turns_per_session", "concurrency", "machines", "snapshots_per_turn"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("sessions_per_hour", "retention", "host_ram", "ssd", "device_memory"):
            v = getattr(self, name)
            if not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be positive, got {v!r}")
        if not math.isfinite(self.swa_ttl) or self.swa_ttl < 0:
            raise ValueError(f"swa_ttl must be >= 0 seconds, got {self.swa_ttl!r}")
        if not 0 < self.pool_fraction <= 1:
            raise ValueError(f"pool_fraction must lie in (0, 1], got {self.pool_fraction}")
        if not 0 < self.target_hit_rate < 1:
            raise ValueError(f"target_hit_rate must lie in (0, 1), got {self.target_hit_rate}")
        if self.replay_window is not None and self.replay_window < 1:
            raise ValueError(f"replay_window must be >= 1 token, got {self.replay_window}")
        if self.device_context_tokens is not None and self.device_context_tokens < 1:
            raise ValueError(f"device_context_tokens must be >= 1, got {self.device_context_tokens}")
        if self.turn_tokens.mean() + self.output_tokens.mean() <= 0:
            raise ValueError("turn_tokens and output_tokens cannot both be zero: a turn must add tokens")
        if self.convention not in ("engine", "report"):
            raise ValueError(f"convention must be 'engine' or 'report', got {self.convention!r}")
        if not math.isfinite(self.images_per_turn) or self.images_per_turn < 0:
            raise ValueError(f"images_per_turn must be >= 0, got {self.images_per_turn!r}")
        if self.image_size is not None and self.image_tokens is not None:
            raise ValueError("give image_size or image_tokens for the workload's images, not both")
        if self.image_size is not None and (len(self.image_size) != 2 or min(self.image_size) < 1):
            raise ValueError(f"image_size must be (width, height) in pixels, got {self.image_size!r}")
        if self.image_tokens is not None and self.image_tokens < 3:
            raise ValueError(f"image_tokens is a span length (at least 3 positions), got {self.image_tokens}")
        if self.images_per_turn > 0 and self.image_size is None and self.image_tokens is None:
            raise ValueError(
                "images_per_turn > 0 needs the images' size: image_size (WIDTHxHEIGHT pixels) or "
                "image_tokens (positions per image)"
            )
        mm = self.multimodal
        if mm is not None:
            for name in ("raw_bytes_per_token", "io_bandwidth", "gpu_flops"):
                v = getattr(mm, name)
                if not math.isfinite(v) or v <= 0:
                    raise ValueError(f"multimodal.{name} must be positive, got {v!r}")
            if mm.compute_per_token is not None and mm.compute_per_token <= 0:
                raise ValueError(f"multimodal.compute_per_token must be positive, got {mm.compute_per_token}")

    @property
    def first_turn(self) -> Distribution:
        return self.first_turn_tokens or self.turn_tokens

    def replace(self, **changes: Any) -> Workload:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Distribution):
                out[f.name] = v.to_dict()
            elif isinstance(v, MultimodalLoad):
                out[f.name] = dataclasses.asdict(v)
            elif isinstance(v, tuple):
                out[f.name] = list(v)
            else:
                out[f.name] = v
        return out


# Field -> parser for values read from a file or a flag.
_DIST_FIELDS = {"turn_tokens": False, "output_tokens": False, "first_turn_tokens": False, "think_time": True}
_SIZE_FIELDS = ("host_ram", "ssd", "device_memory")
_TIME_FIELDS = ("retention", "swa_ttl")
_INT_FIELDS = ("turns_per_session", "concurrency", "machines", "snapshots_per_turn", "replay_window",
               "device_context_tokens", "image_tokens")  # fmt: skip
_FLOAT_FIELDS = ("sessions_per_hour", "pool_fraction", "target_hit_rate", "images_per_turn")
_OPTIONAL_FIELDS = ("first_turn_tokens", "replay_window", "device_context_tokens", "multimodal", "image_size",
                    "image_tokens")  # fmt: skip
_BOOL_FIELDS = ("decoder_replay",)


def _as_int(name: str, v: Any) -> int | None:
    if v is None:
        return None
    f = float(parse_size(v))
    if f != int(f):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    return int(f)


def _as_bool(name: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    text = str(v).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be true or false, got {v!r}")


def workload_from_dict(raw: dict[str, Any], base: Workload | None = None) -> Workload:
    """A :class:`Workload` from a mapping (file contents or flags); missing keys keep `base`'s values."""
    kwargs: dict[str, Any] = {}
    known = {f.name for f in dataclasses.fields(Workload)}
    aliases = {"ttl": "swa_ttl", "think_time_s": "think_time", "turns": "turns_per_session"}
    for key, value in raw.items():
        name = aliases.get(key, key)
        if name not in known:
            raise ValueError(f"unknown workload field {key!r}; known fields: {sorted(known)}")
        if value is None and name not in _OPTIONAL_FIELDS:
            raise ValueError(f"workload field {key!r} needs a value")
        try:
            if value is None:
                kwargs[name] = None
            elif name in _DIST_FIELDS:
                kwargs[name] = parse_distribution(value, name, duration=_DIST_FIELDS[name])
            elif name in _SIZE_FIELDS:
                kwargs[name] = parse_size(value)
            elif name in _TIME_FIELDS:
                kwargs[name] = parse_duration(value)
            elif name in _INT_FIELDS:
                kwargs[name] = _as_int(name, value)
            elif name in _FLOAT_FIELDS:
                kwargs[name] = float(value)
            elif name in _BOOL_FIELDS:
                kwargs[name] = _as_bool(name, value)
            elif name == "multimodal":
                kwargs[name] = _multimodal_from_dict(value)
            elif name == "image_size":
                kwargs[name] = parse_image_size(value)
            else:
                kwargs[name] = str(value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"workload field {key!r}: {e}") from e
    return dataclasses.replace(base or Workload(), **kwargs)


def _multimodal_from_dict(raw: Any) -> MultimodalLoad:
    if not isinstance(raw, dict):
        raise ValueError("multimodal must be a mapping with raw_bytes_per_token, io_bandwidth, gpu_flops")
    d = dict(raw)
    try:
        out = MultimodalLoad(
            raw_bytes_per_token=parse_size(d.pop("raw_bytes_per_token")),
            io_bandwidth=parse_size(d.pop("io_bandwidth")),
            gpu_flops=float(d.pop("gpu_flops")),
            compute_per_token=None
            if d.get("compute_per_token") is None
            else float(d.pop("compute_per_token")),
        )
    except KeyError as e:
        raise ValueError(f"multimodal needs the key {e.args[0]!r}") from e
    d.pop("compute_per_token", None)
    if d:
        raise ValueError(f"unknown multimodal keys {sorted(d)}")
    return out


def load_workload(path: str | Path, base: Workload | None = None) -> Workload:
    """Read a YAML or JSON workload file (see the module docstring for value formats)."""
    p = Path(path)
    text = p.read_text()
    data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{p}: a workload file must hold a mapping of fields, got {type(data).__name__}")
    return workload_from_dict(data, base)
