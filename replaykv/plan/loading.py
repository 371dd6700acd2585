"""The multimodal data-loading condition ρ < (B_IO / B_GPU) · C: ρ of a data mix, C of a model, the verdict.

Loading keeps up with training while reading a token's data takes less time than computing on
it: ρ / B_IO < C / B_GPU, i.e. ρ < (B_IO / B_GPU) · C, with

* ρ raw bytes of training data per token, averaged over the data mix: an image position costs
  its image's stored bytes (JPEG, PNG, ...) divided by the image's positions, a text token
  `text_bytes_per_token` (about 4 bytes of UTF-8 per token; 1 for a byte vocabulary);
* C training FLOPs per token: 6 × the text model's active matmul parameters (2 FLOPs per
  multiply-add forward, twice that backward), plus, on image positions, the vision tower's
  FLOPs per image divided by the image's positions (:func:`tower_flops`);
* B_IO storage read bandwidth and B_GPU compute throughput, both per accelerator.

Both sides are per token, so the tokens per device (sequence length × batch) and the number of
devices cancel: the calculator takes neither (:meth:`Verdict.step_seconds` shows it for a step).
A model with little compute per token is held up by storage first.

Not counted in C: the text model's attention scores and every elementwise op (norms,
activations, softmax, RoPE). Leaving compute out only lowers C, so a verdict "holds" stays
true when they are added.

:func:`loading_report` evaluates the condition on given hardware figures and on the rates
measured here (:mod:`replaykv.plan.measure`); :func:`format_loading` prints it.

Not for: measuring (:mod:`replaykv.plan.measure`), the rest of the capacity plan
(:mod:`replaykv.plan.planner`) or the command line (:mod:`replaykv.plan.cli`).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

from replaykv.model.accounting import AnyConfig, parameter_count, released_vision
from replaykv.model.config_v41 import DeepseekV41Config
from replaykv.model.vision import DeepseekV41VisionConfig
from replaykv.plan.measure import Measured, measure
from replaykv.plan.workload import parse_image_size, parse_size

TOWER_MODES = {"train": 3.0, "frozen": 1.0, "none": 0.0}
"""Tower FLOPs counted per image, in forward passes: trained (forward + backward = 3 forwards),
frozen (forward only), none (not counted: C is the text model's alone)."""

# Given hardware, per accelerator (assumptions the output states).
DEFAULT_IO_BANDWIDTH = 2e9  # bytes/s: a GPU node's NVMe or parallel file system shared by its accelerators
DEFAULT_ACCELERATOR_FLOPS = 900e12  # FLOP/s: dense bf16 matmul of an H200-class accelerator
ASSUMED_HARDWARE = (
    "B_IO: storage read bandwidth per accelerator (a GPU node's local NVMe or parallel file system "
    "shared by its accelerators); B_GPU: dense bf16 matmul peak of an H200-class accelerator. A "
    "training step reaches a fraction of the peak, which lowers B_GPU and only eases the condition."
)


# ---------------------------------------------------------------------------------------------
# Units
# ---------------------------------------------------------------------------------------------

_SI = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15, "e": 1e18}
_FLOPS = re.compile(
    r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*([kKmMgGtTpPeE]?)\s*(?:flop/?s|flops)?\s*$", re.I
)


def parse_bandwidth(value: str | float) -> float:
    """Bytes/s from ``2GB/s``, ``2GB``, ``1.5GiB/s``, ``2e9`` or a number."""
    text = value if isinstance(value, (int, float)) else re.sub(r"(?i)\s*/s\s*$", "", str(value))
    return parse_size(text)


def parse_flops(value: str | float) -> float:
    """FLOP/s from ``900e12``, ``900T``, ``900 TFLOP/s``, ``0.9P`` or a number."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    m = _FLOPS.match(str(value))
    if not m:
        raise ValueError(f"cannot read a FLOP/s figure from {value!r}; write e.g. 900e12, 900T or 900TFLOP/s")
    return float(m.group(1)) * _SI[m.group(2).lower()]


def fmt_si(value: float, unit: str) -> str:
    """``2.00 GB/s``, ``900 TFLOP/s``, ``94.9 GFLOP``: three significant digits and an SI prefix."""
    if not math.isfinite(value):
        return f"unbounded {unit}"
    if value == 0:
        return f"0 {unit}"
    for prefix, scale in (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}".rstrip()
    return f"{value:.3g} {unit}".rstrip()


# ---------------------------------------------------------------------------------------------
# The data mix and what a token costs
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataMix:
    """What the training data is made of, per token.

    `image_fraction` of the tokens are image positions; each image is stored in `image_bytes`
    bytes and takes `image_positions` positions, or, given its pixel size `image_size`
    (width, height), as many as the model's resize plan gives (and then the tower's work is
    known). The other tokens are text at `text_bytes_per_token` raw bytes each.
    """

    image_fraction: float = 0.3
    image_bytes: float = 150e3  # a 1024x768 photo as a JPEG
    image_size: tuple[int, int] | None = (1024, 768)
    image_positions: int | None = None
    text_bytes_per_token: float = 4.0  # UTF-8 text; 1 for a byte vocabulary

    def __post_init__(self) -> None:
        if not (math.isfinite(self.image_fraction) and 0.0 <= self.image_fraction <= 1.0):
            raise ValueError(
                f"the image fraction is the share of tokens that are image positions, in [0, 1]; "
                f"got {self.image_fraction!r}"
            )
        if not math.isfinite(self.text_bytes_per_token) or self.text_bytes_per_token < 0:
            raise ValueError(f"text bytes per token must be >= 0, got {self.text_bytes_per_token!r}")
        if self.image_fraction == 0:
            return
        if not math.isfinite(self.image_bytes) or self.image_bytes <= 0:
            raise ValueError(f"bytes per stored image must be positive, got {self.image_bytes!r}")
        if self.image_size is not None and self.image_positions is not None:
            raise ValueError("give the images' pixel size or their positions per image, not both")
        if self.image_size is None and self.image_positions is None:
            raise ValueError("images need a pixel size (WIDTHxHEIGHT) or positions per image")
        if self.image_size is not None and (len(self.image_size) != 2 or min(self.image_size) < 1):
            raise ValueError(f"image size must be (width, height) in pixels, got {self.image_size!r}")
        if self.image_positions is not None and self.image_positions < 3:
            raise ValueError(
                f"positions per image is a span length (at least 3: start, one row, end); got {self.image_positions}"
            )


def tower_flops(
    vision: DeepseekV41VisionConfig, canvas: tuple[int, int], text_hidden: int, *, passes: float = 3.0
) -> float:
    """FLOPs of the vision tower on one image whose canvas is `canvas` (height, width) pixels.

    Multiply-adds of one forward pass, P = patches of the canvas, d the tower's width, I its MLP
    width, r the pixel-unshuffle ratio, H the text width:

    * patch embedding P · 3p² · d;
    * per layer P · (4d² + 2dI) (qkv, output projection, MLP) plus 2 · P² · d (scores and values,
      every patch attends to every patch of its image);
    * aligner, per LLM token of the grid, r²d · H + H².

    FLOPs = 2 × multiply-adds × `passes` (3: forward and backward of a trained tower).
    """
    p, d, r = vision.patch_size, vision.hidden_size, vision.downsample_ratio
    rows, cols = canvas[0] // p, canvas[1] // p
    patches = rows * cols
    grid = math.ceil(rows / r) * math.ceil(cols / r)
    per_layer = patches * (4 * d * d + 2 * d * vision.intermediate_size) + 2 * patches * patches * d
    macs = patches * 3 * p * p * d + vision.num_hidden_layers * per_layer
    macs += grid * (r * r * d * text_hidden + text_hidden * text_hidden)
    return 2.0 * macs * passes


@dataclass(frozen=True)
class TokenCost:
    """ρ and C of one model under one :class:`DataMix` (see the module docstring)."""

    model: str
    mix: DataMix
    tower: str  # a TOWER_MODES key
    vision: str | None  # where the image path's settings came from (None: no images)
    image_positions: int | None  # per image
    image_canvas: tuple[int, int] | None  # (height, width) pixels the tower reads
    image_patches: int | None
    image_bytes_per_position: float
    raw_bytes_per_token: float  # ρ
    active_matmul_params: int
    text_flops_per_token: float  # 6 × active matmul parameters
    tower_flops_per_image: float | None  # None: unknown (no pixel size)
    tower_flops_per_position: float  # 0 when not counted
    compute_per_token: float  # C


def token_cost(
    config: AnyConfig, mix: DataMix, *, tower: str = "train", model_name: str | None = None
) -> TokenCost:
    """ρ and C of `config` (a V4.1 config reads images; a V4 one only text) under `mix`."""
    if tower not in TOWER_MODES:
        raise ValueError(f"unknown tower mode {tower!r}; choose one of {sorted(TOWER_MODES)}")
    active = parameter_count(config).active_matmul
    text_flops = 6.0 * active
    f = mix.image_fraction
    positions = canvas = patches = None
    per_image_tower: float | None = None
    bytes_per_position = 0.0
    source = None
    if f > 0:
        if not isinstance(config, DeepseekV41Config):
            raise ValueError(
                f"images need a DeepSeek-V4.1 config; {type(config).__name__} reads text only "
                "(give an image fraction of 0)"
            )
        vision = config.vision_config
        source = "the config's vision_config"
        if vision is None:
            vision, source = released_vision(), "released defaults (the config has no vision_config)"
        if mix.image_size is not None:
            from replaykv.images import image_span_length, plan_resize

            gh, gw, ch, cw = plan_resize(mix.image_size[0], mix.image_size[1], vision)
            positions, canvas = image_span_length(gh, gw), (ch, cw)
            patches = (ch // vision.patch_size) * (cw // vision.patch_size)
            per_image_tower = tower_flops(vision, canvas, config.hidden_size, passes=TOWER_MODES[tower])
        else:
            positions = mix.image_positions
        assert positions is not None
        bytes_per_position = mix.image_bytes / positions
    tower_per_position = (per_image_tower or 0.0) / positions if positions else 0.0
    return TokenCost(
        model=model_name or type(config).__name__,
        mix=mix,
        tower=tower,
        vision=source,
        image_positions=positions,
        image_canvas=canvas,
        image_patches=patches,
        image_bytes_per_position=bytes_per_position,
        raw_bytes_per_token=f * bytes_per_position + (1 - f) * mix.text_bytes_per_token,
        active_matmul_params=active,
        text_flops_per_token=text_flops,
        tower_flops_per_image=per_image_tower,
        tower_flops_per_position=tower_per_position,
        compute_per_token=text_flops + f * tower_per_position,
    )


# ---------------------------------------------------------------------------------------------
# The condition
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hardware:
    """Per-accelerator rates: storage read bandwidth (bytes/s) and compute (FLOP/s)."""

    io_bandwidth: float
    accelerator_flops: float
    source: str = "given"

    def __post_init__(self) -> None:
        for name in ("io_bandwidth", "accelerator_flops"):
            v = getattr(self, name)
            if not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name.replace('_', ' ')} must be positive, got {v!r}")


@dataclass(frozen=True)
class Verdict:
    """ρ < (B_IO / B_GPU) · C for one ρ, C and hardware."""

    raw_bytes_per_token: float  # ρ
    compute_per_token: float  # C
    io_bandwidth: float  # B_IO
    accelerator_flops: float  # B_GPU
    threshold_bytes_per_token: float  # (B_IO / B_GPU) · C: the largest ρ that holds (strictly below)
    holds: bool
    margin: float  # threshold / ρ (> 1: headroom; < 1: loading holds training up)
    crossover_compute_per_token: float  # ρ · B_GPU / B_IO: the smallest C that holds (strictly above)

    def step_seconds(self, tokens_per_device: float) -> tuple[float, float]:
        """(loading, compute) seconds of a step of `tokens_per_device` tokens on each device.

        Both grow with the tokens alike, so their ratio (and the verdict) depends on neither the
        sequence length, the batch nor the number of devices.
        """
        return (
            tokens_per_device * self.raw_bytes_per_token / self.io_bandwidth,
            tokens_per_device * self.compute_per_token / self.accelerator_flops,
        )


def loading_condition(raw_bytes_per_token: float, compute_per_token: float, hardware: Hardware) -> Verdict:
    """The verdict for ρ bytes and C FLOPs per token on `hardware`."""
    rho, c = raw_bytes_per_token, compute_per_token
    if not math.isfinite(rho) or rho < 0:
        raise ValueError(f"raw bytes per token must be >= 0, got {rho!r}")
    if not math.isfinite(c) or c <= 0:
        raise ValueError(f"compute per token must be positive, got {c!r}")
    threshold = hardware.io_bandwidth / hardware.accelerator_flops * c
    return Verdict(
        raw_bytes_per_token=rho,
        compute_per_token=c,
        io_bandwidth=hardware.io_bandwidth,
        accelerator_flops=hardware.accelerator_flops,
        threshold_bytes_per_token=threshold,
        holds=rho < threshold,
        margin=threshold / rho if rho > 0 else math.inf,
        crossover_compute_per_token=rho * hardware.accelerator_flops / hardware.io_bandwidth,
    )


@dataclass(frozen=True)
class Case:
    """One hardware's figures for a :class:`TokenCost`: the verdict and what it implies."""

    hardware: Hardware
    verdict: Verdict
    # Smallest active matmul parameter count for which the condition holds, the mix and tower
    # unchanged: (C* − f · tower per position) / 6; <= 0 when the tower's work alone suffices.
    crossover_active_params: float
    # Largest stored bytes per image that holds, text unchanged (None without images;
    # <= 0 when the text alone fails).
    largest_image_bytes: float | None


def evaluate(cost: TokenCost, hardware: Hardware) -> Case:
    """The condition for `cost` on `hardware`, with its crossovers."""
    v = loading_condition(cost.raw_bytes_per_token, cost.compute_per_token, hardware)
    f = cost.mix.image_fraction
    params = (v.crossover_compute_per_token - f * cost.tower_flops_per_position) / 6.0
    largest = None
    if f > 0 and cost.image_positions:
        text_part = (1 - f) * cost.mix.text_bytes_per_token
        largest = (v.threshold_bytes_per_token - text_part) * cost.image_positions / f
    return Case(hardware, v, params, largest)


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadingReport:
    """Everything `replaykv plan --loading` prints."""

    cost: TokenCost
    given: Case
    measured: Measured | None
    measured_case: Case | None

    def to_dict(self) -> dict[str, Any]:
        c = self.cost
        out: dict[str, Any] = {
            "model": c.model,
            "mix": asdict(c.mix),
            "cost": {k: v for k, v in asdict(c).items() if k not in ("model", "mix")},
            "given": _case_dict(self.given),
            "assumptions": ASSUMED_HARDWARE,
            "measured": None,
        }
        if self.measured is not None and self.measured_case is not None:
            m = self.measured
            loader = asdict(m.loader)
            loader.update(
                bytes_per_second=m.loader.bytes_per_second,
                images_per_second=m.loader.images_per_second,
                mean_image_bytes=m.loader.mean_image_bytes,
            )
            out["measured"] = {
                "seconds": m.seconds,
                "loader": loader,
                "matmul": [asdict(r) for r in m.matmul],
                **_case_dict(self.measured_case),
            }
        return _finite(out)


def _case_dict(case: Case) -> dict[str, Any]:
    return {
        "hardware": asdict(case.hardware),
        "verdict": asdict(case.verdict),
        "crossover_active_params": case.crossover_active_params,
        "largest_image_bytes": case.largest_image_bytes,
    }


def _finite(obj: Any) -> Any:
    """JSON has no infinity: write it as null; tuples as lists; int keys as strings."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def loading_report(
    config: AnyConfig,
    mix: DataMix,
    hardware: Hardware,
    *,
    tower: str = "train",
    model_name: str | None = None,
    measure_seconds: float | None = 1.0,
    device: str = "cpu",
    matmul_sizes: tuple[int, ...] | None = None,
) -> LoadingReport:
    """ρ, C and the verdict on the given `hardware` and, unless `measure_seconds` is None, on the
    rates measured here (loader on pictures of the mix's pixel size, matmul on `device`)."""
    cost = token_cost(config, mix, tower=tower, model_name=model_name)
    measured = case = None
    if measure_seconds is not None:
        vision = getattr(config, "vision_config", None) or released_vision()
        measured = measure(
            vision, image_size=mix.image_size, seconds=measure_seconds, device=device, sizes=matmul_sizes
        )
        rates = Hardware(
            measured.io_bandwidth, measured.accelerator_flops, f"measured ({measured.best_matmul.device})"
        )
        case = evaluate(cost, rates)
    return LoadingReport(cost, evaluate(cost, hardware), measured, case)


def _margin(m: float) -> str:
    return "unbounded" if not math.isfinite(m) else f"{m:,.0f}x" if m >= 100 else f"{m:.3g}x"


def _case_rows(case: Case, cost: TokenCost) -> list[tuple[str, str]]:
    v, f = case.verdict, cost.mix.image_fraction
    word = "HOLDS: loading keeps up" if v.holds else "FAILS: loading holds training up"
    params, tower = case.crossover_active_params, f * cost.tower_flops_per_position
    rows = [
        ("B_IO / B_GPU", f"{fmt_si(v.io_bandwidth, 'B/s')} / {fmt_si(v.accelerator_flops, 'FLOP/s')}"),
        (
            "condition rho < (B_IO / B_GPU) * C",
            f"{v.raw_bytes_per_token:,.1f} B < {v.io_bandwidth:.3g} / {v.accelerator_flops:.3g} "
            f"x {v.compute_per_token:.3g} = {v.threshold_bytes_per_token:,.1f} B",
        ),
        ("verdict", f"{word} (margin {_margin(v.margin)})"),
        ("largest rho that holds", f"{v.threshold_bytes_per_token:,.1f} B per token"),
    ]
    if case.largest_image_bytes is not None:
        rows.append((
            "  = stored bytes per image up to",
            "none (the text alone fails)" if case.largest_image_bytes <= 0 else fmt_si(case.largest_image_bytes, "B"),
        ))  # fmt: skip
    rows.append(
        ("crossover: smallest C that holds", f"{fmt_si(v.crossover_compute_per_token, 'FLOP')} per token")
    )
    if params <= 0:
        size = f"any size: the tower's {fmt_si(tower, 'FLOP')} per token alone suffices"
    else:
        size = f"{fmt_si(params, '')} active matmul parameters (this model {fmt_si(cost.active_matmul_params, '')})"
        if tower:
            size += f", the tower's {fmt_si(tower, 'FLOP')} per token kept"
    rows.append(("  = a text model of at least", size))
    return rows


def format_loading(report: LoadingReport) -> str:
    """The report as a readable terminal table."""
    c, mix = report.cost, report.cost.mix
    f = mix.image_fraction
    sections: list[tuple[str, list[tuple[str, str]]]] = []
    rows: list[tuple[str, str]] = []
    if f > 0:
        what = f"{mix.image_size[0]}x{mix.image_size[1]} px, " if mix.image_size else ""
        canvas = (
            f" (canvas {c.image_canvas[1]}x{c.image_canvas[0]}, {c.image_patches:,} patches)"
            if c.image_canvas
            else ""
        )
        rows += [
            ("image positions", f"{100 * f:.3g} % of tokens"),
            ("one image", f"{what}{fmt_si(mix.image_bytes, 'B')} stored, {c.image_positions:,} positions{canvas}"),
            ("image settings", c.vision or ""),
        ]  # fmt: skip
    rows.append(("text", f"{100 * (1 - f):.3g} % of tokens, {mix.text_bytes_per_token:g} B per token"))
    sections.append(("Data mix", rows))
    rho_terms = f"{f:g} x {c.image_bytes_per_position:,.1f} + {1 - f:g} x {mix.text_bytes_per_token:g}"
    tower = {
        "train": "trained tower: forward + backward",
        "frozen": "frozen tower: forward only",
        "none": "tower not counted",
    }[c.tower]
    rows = [
        ("rho (raw bytes per token)", f"{c.raw_bytes_per_token:,.1f} B = {rho_terms}"),
        (
            "C text (6 x active matmul params)",
            f"{fmt_si(c.text_flops_per_token, 'FLOP')} = 6 x {c.active_matmul_params:,}",
        ),
    ]
    if f > 0:
        if c.tower_flops_per_image is None and c.tower != "none":
            rows.append(("C tower", "not counted: no pixel size, so no canvas (give --image-size)"))
        else:
            rows.append((
                f"C tower ({tower})",
                f"{fmt_si(c.tower_flops_per_position, 'FLOP')} per image position"
                + (f" ({fmt_si(c.tower_flops_per_image, 'FLOP')} per image)" if c.tower_flops_per_image else ""),
            ))  # fmt: skip
    rows.append(("C (compute per token)", f"{fmt_si(c.compute_per_token, 'FLOP')}"))
    rows.append(("not in C", "text attention scores, elementwise ops (a lower bound: 'holds' stays true)"))
    sections.append(("Per token", rows))
    sections.append(("Given hardware (per accelerator; assumed, see --io-bandwidth, --accelerator-flops)",
                     _case_rows(report.given, c)))  # fmt: skip
    if report.measured is not None and report.measured_case is not None:
        m = report.measured
        ld = m.loader
        size = f"{ld.image_size[0]}x{ld.image_size[1]}" if ld.image_size else "as drawn"
        rows = [
            (
                "loader (read + decode + resize plan)",
                f"{fmt_si(ld.bytes_per_second, 'B/s')}, {ld.images_per_second:.3g} images/s "
                f"({ld.images} loads of {ld.files} files, {size}, mean {fmt_si(ld.mean_image_bytes, 'B')})",
            ),
            ("  by format", ", ".join(f"{k} {fmt_si(v, 'B/s')}" for k, v in sorted(ld.by_format.items()))),
        ]
        rows += [
            (f"torch.mm {r.dtype} on {r.device}", f"{fmt_si(r.flops_per_second, 'FLOP/s')} (n = {r.size})")
            for r in m.matmul
        ]
        rows += _case_rows(report.measured_case, c)
        title = f"Measured on this machine (~{m.seconds:g} s each; --measure-seconds for longer)"
        sections.append((title, rows))
    lines = [f"replaykv plan --loading: {c.model}"]
    for title, section in sections:
        lines += ["", title]
        width = max(len(label) for label, _ in section)
        lines += [f"  {label.ljust(width)}  {value}" for label, value in section]
    lines += ["", "Assumed: " + ASSUMED_HARDWARE]
    return "\n".join(lines)


def data_mix_from_args(
    *,
    image_fraction: str | float | None,
    image_bytes: str | float | None,
    image_size: str | tuple[int, int] | None,
    image_positions: str | int | None,
    text_bytes: str | float | None,
) -> DataMix:
    """A :class:`DataMix` from command-line strings; None keeps the default (an image given by
    positions drops the default pixel size)."""
    base = DataMix()
    try:
        fraction = base.image_fraction if image_fraction is None else float(image_fraction)
    except ValueError:
        raise ValueError(f"--image-fraction: expected a number in [0, 1], got {image_fraction!r}") from None
    size = base.image_size if image_size is None else parse_image_size(image_size)
    positions = None
    if image_positions is not None:
        value = parse_size(image_positions)
        if value != int(value):
            raise ValueError(f"positions per image must be a whole number, got {image_positions!r}")
        positions = int(value)
        if image_size is None:
            size = None
    return DataMix(
        image_fraction=fraction,
        image_bytes=base.image_bytes if image_bytes is None else parse_size(image_bytes),
        image_size=size,
        image_positions=positions,
        text_bytes_per_token=base.text_bytes_per_token if text_bytes is None else parse_size(text_bytes),
    )
