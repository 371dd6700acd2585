"""Byte and work accounting from the presets: the figures the architecture reference (§5) and the
source documents state or imply, each derived from a config, never typed in."""

from __future__ import annotations

from fractions import Fraction

import pytest

from replaykv.model.accounting import ENGINE, REPORT, V4_PACKED_ENTRY, KVLedger, kv_ledger, parameter_count
from replaykv.model.presets import v4_flash, v4_tiny
from replaykv.model.presets_v41 import v41_flash, v41_small, v41_tiny
from replaykv.model.quant import FP4_COMPRESSED_ENTRY, FP8_WINDOW_ENTRY, MXFP4_INDEX_KEY


@pytest.fixture(scope="module")
def v41() -> KVLedger:
    return kv_ledger(v41_flash())


@pytest.fixture(scope="module")
def v4() -> KVLedger:
    return kv_ledger(v4_flash())


def test_entry_layouts_at_flash_dims() -> None:
    assert FP8_WINDOW_ENTRY.bytes_per_entry(512) == 528
    assert FP4_COMPRESSED_ENTRY.bytes_per_entry(512) == 288
    assert MXFP4_INDEX_KEY.bytes_per_entry(128) == 68
    # V4: 448 e4m3 NoPE + 64 BF16 RoPE + 7 ue8m0 scales + 1 pad (§5.3), by formula.
    assert V4_PACKED_ENTRY.bytes_per_entry(512, 64) == 448 + 2 * 64 + 7 + 1 == 584


def test_global_kv_per_token(v41: KVLedger, v4: KVLedger) -> None:
    assert v41.global_bytes_per_token() == 890
    assert v4.global_bytes_per_token() == Fraction(351425, 100)  # 3514.25
    assert v4.global_bytes_per_token() / v41.global_bytes_per_token() == pytest.approx(3.95, abs=0.01)  # ~1/4
    # Its parts (§5.2, §5.3): 3 × 178 + 356 and 21 × 163 + 20 × 4.5625.
    assert [s.ratio for s in v41.sources] == [2, 2, 2, 1]
    assert [s.bytes_per_group for s in v41.sources] == [356] * 4
    assert sum(s.bytes_per_group for s in v4.sources if s.ratio == 4) == 21 * 652
    assert sum(s.bytes_per_group for s in v4.sources if s.ratio == 128) == 20 * 584


def test_global_kv_for_a_length_is_integer_exact(v41: KVLedger) -> None:
    assert v41.global_bytes(131072) == 116_654_080
    assert v41.global_bytes(10**6) == 890_000_000
    assert round(v41.global_bytes(10**6) / 2**20) == 849  # "约 849 MiB"
    steps = [v41.global_bytes(t + 1) - v41.global_bytes(t) for t in range(100, 104)]
    assert steps == [356, 1424, 356, 1424]  # 101 → 102 tokens completes a pair at every r = 2 source
    assert v41.global_bytes(0) == 0
    with pytest.raises(ValueError):
        v41.global_bytes(-1)


def test_window_state(v41: KVLedger, v4: KVLedger) -> None:
    assert v41.window_state_bytes() == 40 * 128 * 528 == 2_703_360
    assert v4.window_state_bytes() == 43 * 128 * 584 == 3_214_336
    assert v41.window_state_bytes_through_cut() == 21 * 128 * 528  # layers 0..20
    assert v4.window_state_bytes_through_cut() == v4.window_state_bytes()  # V4 has no decoder
    assert v41.compressor_tail_bytes() == 3 * 2 * 512 * 4  # three r = 2 sources, one pending row
    assert v41.snapshot_bytes() == v41.window_state_bytes() + v41.compressor_tail_bytes()


def test_decode_reads_at_128k(v41: KVLedger) -> None:
    assert v41.decode_read_bytes(131072) == 38 * (512 * 288 + 128 * 528) + 2 * 128 * 528 == 8_306_688
    # Short contexts read what exists: 10 tokens → 5 pairs at r = 2, 10 entries at r = 1.
    assert v41.decode_read_bytes(10) == 40 * 10 * 528 + 18 * 5 * 288 + 20 * 10 * 288
    # Index scans: 3 Full r = 2 layers (N/2 keys each), layer 20 (N keys), and the 4 Reindex layers
    # scoring only the 2048 × 8 candidate positions.
    assert v41.decode_index_scan_bytes(131072) == (3 * 65536 + 131072 + 4 * 2048 * 8) * 68
    assert v41.decode_index_scan_bytes(1000) == (3 * 500 + 5 * 1000) * 68  # all fit in the candidates


def test_persistent_bytes_and_break_even(v41: KVLedger, v4: KVLedger) -> None:
    # Two snapshots per turn (end of prefill, end of generation): "每轮存两处约 6.3 MB".
    assert 2 * v4.window_state_bytes() == pytest.approx(6.3e6, rel=0.03)
    be = v4.break_even_turn_tokens(2)
    assert be == Fraction(2 * 3_214_336) / Fraction(351425, 100)
    assert 1750 < be < 1900  # "两者相等点约 1800 token"
    assert 900 < v4.break_even_turn_tokens(1) < 930
    assert v41.persistent_bytes_per_token("v41", 1000) == 890
    assert v4.persistent_bytes_per_token("v4", int(be) + 1) < 2 * v4.global_bytes_per_token()
    assert v4.persistent_bytes_per_token("v4", int(be)) > 2 * v4.global_bytes_per_token()
    with pytest.raises(ValueError, match="policy"):
        v4.persistent_bytes_per_token("v5", 100)


def test_replay_work(v41: KVLedger) -> None:
    # The report's accounting: 20 encoder layers × 128 = 2,560 layer × tokens; exact ≈ 10.5-11×.
    assert v41.bounded_replay_work(convention=REPORT) == 20 * 128 == 2560
    exact = v41.exact_replay_work(convention=REPORT)
    assert exact == 20 * 128 + 127 * 20 * 19 // 2
    assert 10.0 < exact / 2560 < 11.5
    # replaykv / vLLM / SGLang run layers 0..20 on every row.
    assert v41.bounded_replay_work(convention=ENGINE) == 21 * 128
    assert 10.5 < v41.exact_replay_work(convention=ENGINE) / (21 * 128) < 11.5
    # Without decoder replay all 40 windows persist across requests.
    assert v41.bounded_replay_work(decoder_replay=False) == 40 * 128
    # History shorter than the window bounds every layer's rows.
    assert v41.exact_replay_work(cached_tokens=100, convention=REPORT) == 20 * 100
    assert v41.bounded_replay_work(cached_tokens=100, convention=REPORT) == 20 * 100


def test_prefill_work_and_decoder_replay_saving(v41: KVLedger, v4: KVLedger) -> None:
    assert v41.prefill_work(8192, decoder_replay=False) == 40 * 8192
    assert v41.prefill_work(8192, convention=REPORT) == 20 * 8192 + 20 * 128  # calc-B's count
    assert v41.prefill_work(8192) == 21 * 8192 + 19 * 128
    assert v41.prefill_work(100) == 40 * 100  # shorter than the window: nothing to trim
    saving = 1 - v41.prefill_work(8192) / v41.prefill_work(8192, decoder_replay=False)
    assert 0.45 < saving < 0.5  # "nearly halves"
    assert v4.prefill_work(8192) == 43 * 8192  # V4 has no decoder


def test_small_preset_size_and_every_preset_accounts() -> None:
    count = parameter_count(v41_small())
    assert count.total <= 15_000_000
    assert count.active < count.total
    for config in (v41_tiny(), v41_small(), v4_tiny()):
        ledger = kv_ledger(config)
        assert ledger.global_bytes_per_token() > 0
        assert (
            ledger.window_state_bytes()
            == ledger.num_layers * config.sliding_window * ledger.window_entry_bytes
        )


def test_v41_parameter_formula_matches_the_flash_shape() -> None:
    count = parameter_count(v41_flash())
    # Routed experts dominate: 40 layers × 384 experts × 3 × 2304 × 5120.
    routed = 40 * 384 * 3 * 2304 * 5120
    assert routed < count.total < routed * 1.03
    assert count.total - count.active == 40 * (384 - 6) * 3 * 2304 * 5120
