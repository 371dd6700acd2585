"""The capacity planner (issue 7): the figures the source documents and the architecture reference
state or imply, computed from the presets; the pool model; JSON, plots and the command line."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from replaykv.model.presets import v4_flash
from replaykv.model.presets_v41 import v41_flash, v41_small
from replaykv.plan import Workload, load_model_config, load_workload, parse_distribution, plan
from replaykv.plan.cli import main
from replaykv.plan.planner import format_table
from replaykv.plan.plots import POOL_PNG, PREFILL_PNG, STORAGE_PNG, write_plots
from replaykv.plan.workload import Exponential, Fixed, LogNormal, MultimodalLoad, parse_duration, parse_size

REPO = Path(__file__).resolve().parents[2]

# A workload with constant lengths, so the expected figures are simple closed forms.
FIXED = Workload(
    turn_tokens=Fixed(1000.0), output_tokens=Fixed(200.0), first_turn_tokens=Fixed(4000.0), turns_per_session=10,
    think_time=Exponential(60.0), sessions_per_hour=3600.0, swa_ttl=300.0, retention=72 * 3600.0,
    host_ram=2**40, pool_fraction=0.1, machines=4, ssd=10e12, device_memory=80 * 2**30, concurrency=8,
    snapshots_per_turn=2,
)  # fmt: skip


@pytest.fixture(scope="module")
def p41():  # type: ignore[no-untyped-def]
    return plan(v41_flash(), FIXED, model_name="v41-flash")


@pytest.fixture(scope="module")
def p4():  # type: ignore[no-untyped-def]
    return plan(v4_flash(), FIXED, model_name="v4-flash")


# ------------------------------------------------------------------------------- (1) ledgers, storage


def test_global_kv_per_token_from_the_presets(p41, p4) -> None:  # type: ignore[no-untyped-def]
    assert p4.ledgers.global_bytes_per_token == 3514.25
    assert p41.ledgers.global_bytes_per_token == 890
    assert p41.ledgers.global_bytes_per_token / p4.ledgers.global_bytes_per_token == pytest.approx(
        1 / 4, rel=0.02
    )


def test_window_snapshot_bytes_and_break_even(p41, p4) -> None:  # type: ignore[no-untyped-def]
    assert p41.ledgers.window_state_bytes == 40 * 128 * 528
    assert p4.ledgers.window_state_bytes == 43 * 128 * 584
    assert p41.ledgers.window_state_bytes_through_cut == 21 * 128 * 528
    # Two snapshots per turn (end of prefill and of generation) against 3514.25 B/token: ~1,800 tokens.
    assert p4.ledgers.break_even_turn_tokens == pytest.approx(1800, rel=0.03)
    one = plan(v4_flash(), FIXED.replace(snapshots_per_turn=1)).ledgers.break_even_turn_tokens
    assert one == pytest.approx(p4.ledgers.break_even_turn_tokens / 2)
    # Every fixed 1,200-token turn is below V4-Flash's break-even and none above it.
    assert p4.ledgers.share_of_turns_below_break_even == 1.0
    long_turns = plan(v4_flash(), FIXED.replace(turn_tokens=Fixed(3000.0))).ledgers
    assert long_turns.share_of_turns_below_break_even == 0.0


def test_storage_over_retention(p41) -> None:  # type: ignore[no-untyped-def]
    s, n = p41.storage, FIXED.turns_per_session
    session_tokens = 4000 + 9 * 1000 + 10 * 200
    assert p41.ledgers.mean_session_tokens == session_tokens
    assert s.sessions_retained == pytest.approx(72 * 3600)
    assert s.v41_policy_bytes == pytest.approx(72 * 3600 * 890 * session_tokens)
    extra = n * 2 * 40 * 128 * 528
    assert s.v4_policy_bytes == pytest.approx(72 * 3600 * (890 * session_tokens + extra))
    assert s.v4_over_v41 == pytest.approx(1 + extra / (890 * session_tokens))
    assert s.ssd_bytes == 4 * 10e12
    assert s.v41_policy_max_retention_s == pytest.approx(40e12 / (890 * session_tokens))
    assert s.v41_policy_fits == (s.v41_policy_bytes <= s.ssd_bytes)


# ------------------------------------------------------------------------------- (2) pool


def test_pool_capacity_and_hit_rate_with_ample_ram(p41) -> None:  # type: ignore[no-untyped-def]
    pool = p41.pool
    entry = 40 * 128 * 528 + 3 * 4096
    assert pool.entry_bytes == entry
    assert pool.capacity_entries == int(4 * 0.1 * 2**40 // entry)
    assert pool.capacity_sessions == pool.capacity_entries // 2
    assert pool.entries_per_second == pytest.approx(1.0 * 10 * 2)  # 1 session/s × 10 turns × 2 snapshots
    assert not pool.capacity_limited
    assert pool.hit_rate == pytest.approx(1 - math.exp(-300 / 60))  # P(T <= TTL), T ~ exp(mean 60 s)
    assert pool.ttl_for_target_s == pytest.approx(60 * math.log(20))  # 95 % quantile
    assert pool.active_sessions == pytest.approx(1.0 * 9 * 60)  # Little: arrivals × time between turns


def test_pool_hit_rate_is_limited_by_capacity() -> None:
    small_ram = FIXED.replace(host_ram=2**30, pool_fraction=0.5)  # 4 × 512 MiB of pool
    pool = plan(v41_flash(), small_ram).pool
    t_c = pool.capacity_entries / pool.entries_per_second
    assert pool.capacity_limited and pool.characteristic_time_s == pytest.approx(t_c) and t_c < 300
    assert pool.hit_rate == pytest.approx(1 - math.exp(-t_c / 60))
    assert pool.hit_rate < pool.hit_rate_unlimited
    assert not pool.target_reachable and pool.pool_fraction_for_target > 0.5


# ------------------------------------------------------------------------------- (3) compute


def test_replay_work_per_miss() -> None:
    report = plan(v41_flash(), FIXED.replace(convention="report")).compute
    assert report.bounded_replay_per_miss == 2560  # 20 encoder layers × 128
    assert 10.0 < report.exact_over_bounded < 11.5  # "精确重建约是它的 11 倍"
    engine = plan(v41_flash(), FIXED).compute
    assert engine.bounded_replay_per_miss == 21 * 128 and engine.full_layers == 21
    assert 10.5 < engine.exact_over_bounded < 11.5
    assert plan(v41_flash(), FIXED.replace(decoder_replay=False)).compute.bounded_replay_per_miss == 40 * 128
    # A follow-up turn of 1,000 new tokens costs 21 × 1000 + 19 × 128 rows; a miss adds about a fifth.
    assert engine.mean_turn_prefill == 21 * 1000 + 19 * 128
    assert engine.bounded_over_turn_prefill == pytest.approx(2688 / (21 * 1000 + 19 * 128))
    cached = 4000 + 200 + 8 / 2 * 1200
    assert engine.mean_cached_tokens == cached
    assert engine.full_reprefill_per_miss == 21 * cached + 19 * 128


def test_miss_compute_per_hour(p41) -> None:  # type: ignore[no-untyped-def]
    c, pool = p41.compute, p41.pool
    assert c.follow_up_turns_per_hour == 3600 * 9
    assert c.misses_per_hour == pytest.approx(3600 * 9 * (1 - pool.hit_rate))
    prefill = 3600 * (21 * 4000 + 19 * 128) + 3600 * 9 * (21 * 1000 + 19 * 128)
    assert c.prefill_work_per_hour == pytest.approx(prefill)
    assert c.miss_overhead == pytest.approx(c.misses_per_hour * 2688 / prefill)
    assert c.exact_miss_work_per_hour > c.miss_work_per_hour


def test_decoder_replay_saving_grows_with_prompt_length(p41) -> None:  # type: ignore[no-untyped-def]
    savings = [s["saving"] for s in p41.compute.decoder_replay_saving]
    assert savings == sorted(savings)
    assert savings[-1] == pytest.approx(19 / 40, abs=0.01)  # layers 21-39 of 40 trimmed at long prompts
    assert p41.compute.decoder_replay_saving[0]["prompt_tokens"] == 512


# ------------------------------------------------------------------------------- (4) device, (5) multimodal


def test_device_memory_for_a_million_tokens() -> None:
    d = plan(v41_flash(), FIXED.replace(device_context_tokens=10**6, concurrency=8)).device
    assert d.global_bytes_per_million_tokens == 890_000_000  # "约 890 MB"
    assert round(d.global_bytes_per_million_tokens / 2**20) == 849  # "约 849 MiB"
    assert d.contexts * d.global_bytes_per_context == 8 * 890_000_000  # "8 条 ... 约 7.12 GB"
    assert d.total_bytes == 8 * (890_000_000 + 40 * 128 * 528 + 3 * 4096)
    assert d.fits and d.max_contexts == 80 * 2**30 // (890_000_000 + 40 * 128 * 528 + 3 * 4096)


def test_multimodal_loading_condition() -> None:
    mm = MultimodalLoad(raw_bytes_per_token=5000.0, io_bandwidth=2e9, gpu_flops=1e15, compute_per_token=1e9)
    m = plan(v41_small(), FIXED.replace(multimodal=mm)).multimodal
    assert m is not None
    assert m.threshold_bytes_per_token == pytest.approx(2e9 / 1e15 * 1e9)  # 2,000 bytes per token
    assert m.loading_is_bottleneck and m.margin == pytest.approx(2000 / 5000)
    big = plan(v41_flash(), FIXED.replace(multimodal=MultimodalLoad(5000.0, 2e9, 1e15))).multimodal
    assert big is not None and big.compute_derived and not big.loading_is_bottleneck and big.margin > 1


# ------------------------------------------------------------------------------- workload parsing


def test_units_and_distributions() -> None:
    assert parse_size("2TiB") == 2 * 2**40 and parse_size("30TB") == 30e12 and parse_size(512) == 512
    assert parse_duration("5m") == 300 and parse_duration("72h") == 72 * 3600 and parse_duration("90") == 90
    assert parse_distribution("lognormal:600:1.0") == LogNormal(600.0, 1.0)
    assert parse_distribution("exponential:2m", duration=True) == Exponential(120.0)
    assert parse_distribution(512) == Fixed(512.0)
    ln = LogNormal(30.0, 1.2)
    assert ln.quantile(0.95) == pytest.approx(math.exp(ln.mu + 1.2 * 1.6448536), rel=1e-4)
    # E[min(T, c)] in closed form agrees with the numeric integral of the survival function.
    assert ln.mean_min(100.0) == pytest.approx(super(LogNormal, ln).mean_min(100.0), rel=1e-4)
    for bad in ("lognormal:600", "gamma:3", "uniform:5:1", "exponential:-3"):
        with pytest.raises(ValueError):
            parse_distribution(bad)


def test_workload_file(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(
        "turn_tokens: {dist: lognormal, mean: 800, sigma: 1.1}\n"
        "output_tokens: exponential:400\n"
        "think_time: {dist: empirical, values: [5, 20, 60, 600]}\n"
        "turns: 30\nttl: 10m\nhost_ram: 1TiB\nssd: 8TB\nmultimodal: {raw_bytes_per_token: 2kB,"
        " io_bandwidth: 4GB, gpu_flops: 1.0e+15}\n"
    )
    w = load_workload(path)
    assert w.turn_tokens == LogNormal(800.0, 1.1) and w.turns_per_session == 30
    assert w.swa_ttl == 600 and w.host_ram == 2**40 and w.ssd == 8e12
    assert w.think_time.cdf(60) == 0.75
    assert w.multimodal == MultimodalLoad(2000.0, 4e9, 1e15)
    path.write_text("tunr_tokens: 5\n")
    with pytest.raises(ValueError, match="unknown workload field 'tunr_tokens'"):
        load_workload(path)


# ------------------------------------------------------------------------------- output


def test_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "v4-flash", "--json", "--ttl", "2m", "--turns", "5"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == "v4-flash" and data["family"] == "deepseek_v4"
    assert data["ledgers"]["global_bytes_per_token"] == 3514.25
    assert data["ledgers"]["global_bytes_per_token_exact"] == "14057/4"
    assert data["pool"]["ttl_s"] == 120 and data["workload"]["turns_per_session"] == 5
    assert set(data) >= {"ledgers", "storage", "pool", "compute", "device", "multimodal", "workload"}


def test_table_output(p41) -> None:  # type: ignore[no-untyped-def]
    text = format_table(p41)
    for section in ("1. Ledgers", "2. SWA pool", "3. Replay compute", "4. Device memory"):
        assert section in text
    assert "890" in text and "2,703,360 B" in text


def test_plots_are_written(tmp_path: Path, p41) -> None:  # type: ignore[no-untyped-def]
    paths = write_plots(p41, tmp_path / "img")
    assert [p.name for p in paths] == [STORAGE_PNG, POOL_PNG, PREFILL_PNG]
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and 5_000 < len(data) < 200_000


def test_cli_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "v41-small", "--plots", str(tmp_path)]) == 0
    assert (tmp_path / STORAGE_PNG).exists()
    assert main(["--model", "no-such-model"]) == 2
    assert "neither a preset" in capsys.readouterr().err
    assert main(["--think-time", "gamma:3"]) == 2
    assert main(["--pool-fraction", "1.5"]) == 2
    assert main(["--frobnicate"]) == 2
    assert main(["--help"]) == 0
    released = tmp_path / "config.json"
    from tests.model.test_config_v41 import released_composite

    released.write_text(json.dumps(released_composite()))
    assert main(["--model", str(released)]) == 2
    assert "Engram is not supported yet" in capsys.readouterr().err
    assert main(["--model", str(tmp_path), "--backbone-only", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ledgers"]["global_bytes_per_token"] == 890


def test_model_configs_load_from_presets_and_files(tmp_path: Path) -> None:
    assert load_model_config("v41-flash") == v41_flash()
    (tmp_path / "config.json").write_text(json.dumps(v41_small().to_dict(composite=True)))
    assert load_model_config(str(tmp_path)) == v41_small()
    (tmp_path / "v4.json").write_text(json.dumps(v4_flash().to_dict()))
    assert load_model_config(str(tmp_path / "v4.json")) == v4_flash().replace(kv_quant=False)


def test_no_published_result_is_a_constant_in_the_code() -> None:
    published = re.compile(r"(?<![\d.])(890|3514|2560|2,560|849|1800|1,800|8306688|2703360|3214336)(?![\d])")
    files = [
        *sorted((REPO / "replaykv" / "plan").glob("*.py")),
        REPO / "replaykv" / "model" / "accounting.py",
    ]
    for path in files:
        hits = [line for line in path.read_text().splitlines() if published.search(line)]
        assert not hits, f"{path.name}: {hits}"


# ------------------------------------------------------------------------------- images


def test_images_grow_every_ledger_exactly_by_their_tokens(p41) -> None:  # type: ignore[no-untyped-def]
    # One 544² image per turn with the released image path: 39 patches a side -> 13 × 13 grid
    # -> 13 × 14 + 2 = 184 positions in every turn, 10 turns a session.
    with_images = plan(v41_flash(), FIXED.replace(images_per_turn=1.0, image_size=(544, 544)))
    im = with_images.images
    assert im is not None and im.per_image["positions"] == 184 and im.per_image["patches"] == 39 * 39
    extra_tokens = 10 * 184
    assert with_images.ledgers.mean_session_tokens == p41.ledgers.mean_session_tokens + extra_tokens
    assert with_images.ledgers.mean_turn_tokens == p41.ledgers.mean_turn_tokens + 184
    extra_bytes = 72 * 3600 * 890 * extra_tokens  # sessions retained × g × image positions
    s0, s1 = p41.storage, with_images.storage
    assert s1.v41_policy_bytes - s0.v41_policy_bytes == pytest.approx(extra_bytes, rel=1e-12)
    assert s1.v4_policy_bytes - s0.v4_policy_bytes == pytest.approx(
        extra_bytes, rel=1e-12
    )  # snapshots unchanged
    assert im.storage_bytes == pytest.approx(extra_bytes, rel=1e-12)
    assert im.global_bytes_per_session == 890 * extra_tokens
    assert im.share_of_session_tokens == pytest.approx(extra_tokens / (15000 + extra_tokens))
    assert im.feature_bytes_per_session == 10 * 184 * 5120 * 2
    # The device question's context is the mean session, images included.
    d0, d1 = p41.device, with_images.device
    assert d1.context_tokens == d0.context_tokens + extra_tokens
    assert d1.global_bytes_per_context == v41_flash_global(d0.context_tokens + extra_tokens)
    # A follow-up turn's prefill runs the image's rows too.
    assert with_images.compute.mean_turn_prefill == 21 * (1000 + 184) + 19 * 128
    assert "1c. Images" in format_table(with_images) and "1c. Images" not in format_table(p41)


def v41_flash_global(tokens: int) -> int:
    from replaykv.model.accounting import kv_ledger

    return kv_ledger(v41_flash()).global_bytes(tokens)


def test_images_by_span_length_and_a_fractional_rate() -> None:
    w = FIXED.replace(images_per_turn=0.5, image_tokens=1000, turn_tokens=LogNormal(800.0, 1.0))
    p = plan(v41_flash(), w)
    assert p.images is not None and p.images.per_image["patches"] is None
    assert p.images.positions_per_turn == 500 and p.ledgers.mean_turn_tokens == 800 + 500 + 200
    # The shifted turn length keeps E[min(X + c, W)] exact: c = 500 >= W = 128 here.
    assert p.compute.mean_turn_prefill == pytest.approx(21 * 1300 + 19 * 128)


def test_shifted_distribution() -> None:
    from replaykv.plan.workload import Shifted, shifted

    ln = LogNormal(300.0, 1.0)
    s = shifted(ln, 50.0)
    assert isinstance(s, Shifted) and shifted(ln, 0.0) is ln
    assert s.mean() == pytest.approx(350.0) and s.cdf(50.0) == 0.0 and s.cdf(350.0) == ln.cdf(300.0)
    assert s.quantile(0.9) == pytest.approx(ln.quantile(0.9) + 50.0)
    assert s.mean_min(30.0) == 30.0
    assert s.mean_min(200.0) == pytest.approx(super(Shifted, s).mean_min(200.0), rel=1e-4)
    with pytest.raises(ValueError):
        shifted(ln, -1.0)


def test_images_in_files_flags_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "w.yaml"
    path.write_text("images_per_turn: 2\nimage_size: 1024x768\n")
    w = load_workload(path)
    assert w.images_per_turn == 2 and w.image_size == (1024, 768) and w.image_tokens is None
    assert w.to_dict()["image_size"] == [1024, 768]
    # A flag replaces the file's way of giving the image.
    assert main(["--model", "v41-flash", "--workload", str(path), "--image-tokens", "300", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["images"]["per_image"]["positions"] == 300 and data["images"]["positions_per_turn"] == 600
    # The vision tower of a config that has one.
    assert main(["--model", "v41-tiny-vision", "--image-size", "84x84", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (
        data["images"]["per_image"]["positions"] == 8
        and data["images"]["vision"] == "the config's vision_config"
    )
    assert main(["--images-per-turn", "1"]) == 2
    assert "image_size" in capsys.readouterr().err
    assert main(["--model", "v4-flash", "--image-size", "544x544"]) == 2
    assert "DeepSeek-V4.1" in capsys.readouterr().err
    assert main(["--image-size", "544"]) == 2
    assert "WIDTHxHEIGHT" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not both"):
        FIXED.replace(image_size=(10, 10), image_tokens=50)
