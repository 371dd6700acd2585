"""The multimodal loading condition ρ < (B_IO / B_GPU) · C (`replaykv plan --loading`): the formula
on hand-computed inputs, the tower's FLOPs against the tower module's own weights, the source's
conclusion (small models are held up by storage, large ones are not), the invariance to sequence
length and device count, the measured path (run, never timed) and the command line."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math

import pytest
import torch

from replaykv.model.accounting import parameter_count
from replaykv.model.presets_v41 import v41_flash, v41_small, v41_small_vision, v41_tiny_vision
from replaykv.model.vision import DeepseekV41VisionConfig, VisionTower
from replaykv.plan.cli import main
from replaykv.plan.loading import (
    DataMix,
    Hardware,
    evaluate,
    loading_condition,
    loading_report,
    parse_bandwidth,
    parse_flops,
    token_cost,
    tower_flops,
)
from replaykv.plan.measure import measure_loader, measure_matmul

# The same hardware for every model: 2 GB/s of storage and 900 TFLOP/s per accelerator.
NODE = Hardware(io_bandwidth=2e9, accelerator_flops=900e12)


def test_condition_on_hand_computed_inputs() -> None:
    # threshold = 2e9 / 1e15 × 1e9 = 2,000 bytes per token
    hw = Hardware(2e9, 1e15)
    v = loading_condition(100.0, 1e9, hw)
    assert v.threshold_bytes_per_token == pytest.approx(2000.0)
    assert v.holds and v.margin == pytest.approx(20.0)
    assert v.crossover_compute_per_token == pytest.approx(100 * 1e15 / 2e9)  # 5e7 FLOP
    slow = loading_condition(5000.0, 1e9, hw)
    assert not slow.holds and slow.margin == pytest.approx(0.4)
    assert not loading_condition(2000.0, 1e9, hw).holds  # strictly below the threshold
    # Seconds per token: loading 100 / 2e9 against compute 1e9 / 1e15.
    load, compute = v.step_seconds(1.0)
    assert load == pytest.approx(5e-8) and compute == pytest.approx(1e-6)


def test_token_cost_and_crossovers_on_hand_computed_inputs() -> None:
    # Half the tokens are image positions, 100 per image of 10,000 stored bytes; text 4 B/token.
    mix = DataMix(image_fraction=0.5, image_bytes=10_000, image_size=None, image_positions=100)
    cost = token_cost(v41_small(), mix)
    active = parameter_count(v41_small()).active_matmul
    assert cost.image_bytes_per_position == 100.0
    assert cost.raw_bytes_per_token == pytest.approx(0.5 * 100 + 0.5 * 4)  # 52 B
    # No pixel size, no canvas: the tower's work is unknown and left out of C.
    assert cost.tower_flops_per_image is None and cost.tower_flops_per_position == 0
    assert cost.compute_per_token == 6 * active
    case = evaluate(cost, NODE)
    threshold = 2e9 / 900e12 * 6 * active
    assert case.verdict.threshold_bytes_per_token == pytest.approx(threshold)
    assert case.crossover_active_params == pytest.approx(52 * 900e12 / 2e9 / 6)
    assert case.largest_image_bytes == pytest.approx((threshold - 0.5 * 4) * 100 / 0.5)
    # Text only: ρ is the text bytes, C the text model's.
    text = token_cost(v41_small(), DataMix(image_fraction=0.0, text_bytes_per_token=1.0))
    assert text.raw_bytes_per_token == 1.0 and text.image_positions is None
    assert evaluate(text, NODE).largest_image_bytes is None


def test_tower_flops_by_hand() -> None:
    # patch 2, width 8, MLP 16, 2 layers, unshuffle 2; canvas 4 × 6 px -> 2 × 3 = 6 patches, a 1 × 2
    # grid; text width 10. Multiply-adds: patch embedding 6·12·8 = 576; per layer 6·(4·64 + 2·8·16)
    # + 2·36·8 = 3,648; aligner 2·(4·8·10 + 100) = 840.
    vision = DeepseekV41VisionConfig(
        hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, patch_size=2,
        downsample_ratio=2,
    )  # fmt: skip
    macs = 576 + 2 * 3648 + 840
    assert tower_flops(vision, (4, 6), 10, passes=1.0) == 2 * macs
    assert tower_flops(vision, (4, 6), 10) == 6 * macs


def test_tower_flops_match_the_tower_module() -> None:
    """The linear part of the count equals the tower module's own matmul weights × rows."""
    config = v41_small_vision()
    vision = config.vision_config
    assert vision is not None
    cost = token_cost(config, DataMix(image_size=(1024, 768)))
    assert cost.image_canvas is not None and cost.image_patches is not None
    h, w = cost.image_canvas
    rows, cols = h // vision.patch_size, w // vision.patch_size
    patches = rows * cols
    r = vision.downsample_ratio
    grid = math.ceil(rows / r) * math.ceil(cols / r)
    with torch.device("meta"):
        tower = VisionTower(vision, config.hidden_size)
    per_patch = tower.patch_embed.weight.numel() + sum(
        m.weight.numel() for m in tower.layers.modules() if isinstance(m, torch.nn.Linear)
    )
    per_grid_cell = tower.aligner_fc1.weight.numel() + tower.aligner_fc2.weight.numel()
    attention = vision.num_hidden_layers * 2 * patches * patches * vision.hidden_size
    expected = 6 * (patches * per_patch + grid * per_grid_cell + attention)
    assert cost.image_patches == patches
    assert cost.tower_flops_per_image == expected
    assert cost.tower_flops_per_position == pytest.approx(expected / cost.image_positions)  # type: ignore[operator]


def test_small_model_is_held_up_by_storage_and_large_one_is_not() -> None:
    """The source's conclusion on its own terms: one data mix (30 % image positions, 1024×768
    images of 150 kB, 4 B per text token), one hardware (2 GB/s, 900 TFLOP/s); only the model,
    and with it C, changes."""
    mix = DataMix()
    small = evaluate(token_cost(v41_small_vision(), mix), NODE)
    large = evaluate(token_cost(v41_flash(), mix), NODE)
    assert not small.verdict.holds and small.verdict.margin == pytest.approx(0.953, abs=0.001)
    assert large.verdict.holds and large.verdict.margin == pytest.approx(2463, rel=1e-3)
    assert small.verdict.compute_per_token < small.verdict.crossover_compute_per_token
    assert large.verdict.compute_per_token > large.verdict.crossover_compute_per_token
    # C as the source counts it (the text model's 6 × active parameters alone): the same flip.
    small_text = evaluate(token_cost(v41_small(), mix, tower="none"), NODE)
    large_text = evaluate(token_cost(v41_flash(), mix, tower="none"), NODE)
    assert not small_text.verdict.holds and small_text.verdict.margin == pytest.approx(0.859, abs=0.001)
    assert large_text.verdict.holds and large_text.verdict.margin == pytest.approx(2255, rel=1e-3)
    # Both sides of the crossover: v41-small's active parameters are below it, v41-flash's above.
    assert parameter_count(v41_small()).active_matmul < small_text.crossover_active_params
    assert parameter_count(v41_flash()).active_matmul > large_text.crossover_active_params
    # A trained full-size tower does enough work per image position that images never wait.
    assert evaluate(token_cost(v41_small(), mix), NODE).crossover_active_params <= 0


def test_the_condition_has_no_sequence_length_or_device_count() -> None:
    inputs = [
        *inspect.signature(token_cost).parameters,
        *inspect.signature(loading_condition).parameters,
        *(f.name for f in dataclasses.fields(DataMix)),
        *(f.name for f in dataclasses.fields(Hardware)),
    ]
    for word in ("seq", "length", "devices", "batch", "world", "cluster"):
        assert not [name for name in inputs if word in name], inputs
    # A step's loading and compute time both scale with the tokens on each device, so their
    # ratio is the same for any sequence length × batch and any number of devices.
    v = evaluate(token_cost(v41_small_vision(), DataMix()), NODE).verdict
    ratios = set()
    for seq_len in (1024, 8192, 131072):
        for batch in (1, 16):
            for devices in (1, 8, 1024):
                load, compute = v.step_seconds(seq_len * batch * 1024 / devices)
                ratios.add(round(compute / load, 12))
    assert ratios == {round(v.margin, 12)}


def test_units() -> None:
    assert (
        parse_bandwidth("2GB/s") == 2e9 and parse_bandwidth("1GiB/s") == 2**30 and parse_bandwidth(5e8) == 5e8
    )
    assert parse_flops("900e12") == 900e12 and parse_flops("900T") == pytest.approx(900e12)
    assert parse_flops("0.9 PFLOP/s") == pytest.approx(900e12) and parse_flops("2GFLOPS") == pytest.approx(
        2e9
    )
    with pytest.raises(ValueError, match="FLOP/s"):
        parse_flops("fast")


def test_bad_mixes_and_hardware_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        DataMix(image_fraction=1.5)
    with pytest.raises(ValueError, match="not both"):
        DataMix(image_size=(1024, 768), image_positions=500)
    with pytest.raises(ValueError, match="positive"):
        DataMix(image_bytes=0)
    with pytest.raises(ValueError, match="must be positive"):
        Hardware(0.0, 1e15)
    with pytest.raises(ValueError, match="tower mode"):
        token_cost(v41_small(), DataMix(), tower="half")
    from replaykv.model.presets import v4_flash

    with pytest.raises(ValueError, match="reads text only"):
        token_cost(v4_flash(), DataMix())
    assert token_cost(v4_flash(), DataMix(image_fraction=0.0)).raw_bytes_per_token == 4.0


def test_measured_path_runs_and_gives_positive_rates() -> None:
    vision = v41_tiny_vision().vision_config
    assert vision is not None
    loader = measure_loader(vision, image_size=(112, 112), seconds=0.02, pictures=1)
    assert loader.images >= loader.files == 2 and loader.bytes_read > 0
    assert loader.bytes_per_second > 0 and set(loader.by_format) == {"png", "jpg"}
    rates = measure_matmul(seconds=0.02, sizes=(32, 64))
    assert {r.dtype for r in rates} >= {"float32"} and all(r.flops_per_second > 0 for r in rates)
    report = loading_report(
        v41_tiny_vision(), DataMix(image_size=(112, 112)), NODE, measure_seconds=0.02, matmul_sizes=(32,)
    )
    assert report.measured is not None and report.measured_case is not None
    assert report.measured_case.hardware.io_bandwidth > 0
    assert report.measured_case.hardware.accelerator_flops > 0
    assert json.loads(json.dumps(report.to_dict()))["measured"]["loader"]["bytes_per_second"] > 0


def test_cli_prints_the_condition_and_the_verdicts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--loading", "--model", "v41-small-vision", "--no-measure"]) == 0
    out = capsys.readouterr().out
    assert "condition rho < (B_IO / B_GPU) * C" in out
    assert "FAILS: loading holds training up (margin 0.953x)" in out
    assert "Measured on this machine" not in out
    args = [
        "--loading",
        "--model",
        "v41-flash",
        "--no-measure",
        "--io-bandwidth",
        "1GB/s",
        "--accelerator-flops",
        "1P",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "1 GB/s / 1 PFLOP/s" in out and "HOLDS: loading keeps up" in out
    args = ["--loading", "--model", "v41-tiny-vision", "--image-size", "112x112", "--measure-seconds", "0.02",
            "--measure-device", "cpu"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Measured on this machine" in out and out.count("verdict") == 2
    assert "torch.mm float32 on cpu" in out and "loader (read + decode + resize plan)" in out
    assert main(["--loading", "--model", "v41-small", "--no-measure", "--image-tokens", "300", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["mix"]["image_positions"] == 300 and data["mix"]["image_size"] is None
    assert data["given"]["verdict"]["holds"] in (True, False) and data["measured"] is None
    from replaykv.cli import main as replaykv_main

    assert replaykv_main(["plan", "--loading", "--no-measure", "--image-fraction", "0"]) == 0
    assert "100 % of tokens, 4 B per token" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--image-fraction", "1.5"], "in [0, 1]"),
        (["--image-fraction", "half"], "--image-fraction"),
        (["--image-bytes", "0"], "must be positive"),
        (["--image-bytes", "lots"], "size"),
        (["--io-bandwidth", "fast"], "size"),
        (["--accelerator-flops", "-1"], "must be positive"),
        (["--tower", "half"], "--tower"),
        (["--image-size", "1024x"], "WIDTHxHEIGHT"),
        (["--image-size", "1024x768", "--image-tokens", "500"], "not both"),
        (["--image-tokens", "2"], "at least 3"),
        (["--model", "v4-flash"], "reads text only"),
        (["--model", "no-such-model"], "neither a preset"),
        (["--ttl", "5m"], "--loading does not use --ttl"),
        (["--measure-seconds", "2"], "--no-measure leaves nothing"),
    ],
)
def test_cli_bad_inputs_exit_2(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--loading", "--no-measure", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_cli_loading_flags_need_loading(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--image-fraction", "0.3"]) == 2
    assert "add --loading" in capsys.readouterr().err
    assert main(["--loading", "--measure-seconds", "0"]) == 2
    assert "--measure-seconds must lie in (0, 600]" in capsys.readouterr().err
