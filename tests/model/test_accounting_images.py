"""What an image costs in each ledger (V4.1-Flash with the released image path's settings), with
the expected figures worked out here from the span layout, the resize plan's rules and the
entry layouts, not read back from the code under test."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from replaykv.model.accounting import image_ledger, kv_ledger, released_vision
from replaykv.model.presets import v4_flash
from replaykv.model.presets_v41 import v41_flash, v41_tiny, v41_tiny_vision
from replaykv.model.vision import DeepseekV41VisionConfig

# V4.1-Flash: 4 KV sources (three at r = 2, one at r = 1), each entry 288 B (FP4 compressed, 512
# dims) + a 68 B index key (MXFP4, 128 dims); window entries 528 B (FP8), 40 layers, W = 128,
# text hidden 5120. The released image path: patch 14, 3 × 3 pixel-unshuffle, at most 1024
# positions per image, at least 544² pixels.
FLASH_GLOBAL_PER_TOKEN = Fraction(3 * (288 + 68), 2) + (288 + 68)  # 890
FLASH_WINDOW_ROW = 528 * 40  # one position in every layer's window
HIDDEN = 5120


def span(rows: int, cols: int) -> int:
    return rows * (cols + 1) + 2  # [IMAGE_START] + ([IMAGE] × cols + [NEWLINE]) × rows + [IMAGE_END]


def test_released_vision_defaults() -> None:
    v = released_vision()
    assert (v.patch_size, v.downsample_ratio, v.max_image_tokens, v.min_pixels) == (14, 3, 1024, 544 * 544)
    assert v.num_hidden_layers == 32 and v == DeepseekV41VisionConfig()


def test_an_image_at_the_position_budget_on_flash() -> None:
    # A large square image shrinks to the largest square grid whose span fits 1024 positions:
    # 31 × 32 + 2 = 994 fits, 32 × 33 + 2 = 1058 does not; the canvas is 31 cells of 42 pixels.
    im = image_ledger(v41_flash(), size=(4096, 4096), vision=released_vision())
    assert span(31, 31) == 994 <= 1024 < span(32, 32)
    assert im.grid == (31, 31) and im.canvas == (31 * 42, 31 * 42) and im.positions == 994
    assert im.patches == (1302 // 14) ** 2 == 93 * 93 == 8649
    assert im.patch_rows == 8649 * 32
    assert im.global_kv_bytes == 994 * FLASH_GLOBAL_PER_TOKEN == 884_660
    assert im.persistent_bytes == im.global_kv_bytes
    # 994 positions fill the whole window of every layer when the prefix ends on the image.
    assert im.window_bytes == 128 * FLASH_WINDOW_ROW == 2_703_360
    assert im.window_bytes == kv_ledger(v41_flash()).window_state_bytes()
    assert im.feature_bytes == 994 * HIDDEN * 2 == 10_178_560


def test_a_minimum_size_image_on_flash() -> None:
    # 544² pixels: sides round up to whole patches, 39 × 14 = 546; 39 patches group into
    # ceil(39 / 3) = 13 tokens per side; 13 × 14 + 2 = 184 positions.
    im = image_ledger(v41_flash(), size=(544, 544), vision=released_vision())
    assert im.canvas == (546, 546) and im.grid == (13, 13) and im.positions == span(13, 13) == 184
    assert im.patches == 39 * 39 == 1521
    assert im.global_kv_bytes == 184 * 890 == 163_760
    assert im.window_bytes == min(184, 128) * FLASH_WINDOW_ROW
    assert im.feature_bytes == 184 * HIDDEN * 2 == 1_884_160
    # A smaller image is scaled up to the minimum pixel count: the same span.
    assert image_ledger(v41_flash(), size=(100, 100), vision=released_vision()).positions == 184


def test_the_exact_global_kv_of_a_placed_span_is_within_one_group_per_source() -> None:
    ledger = kv_ledger(v41_flash())
    im = image_ledger(v41_flash(), size=(544, 544), vision=released_vision())
    for start in (0, 1, 1000, 1001):
        exact = ledger.global_bytes(start + im.positions) - ledger.global_bytes(start)
        assert abs(exact - im.global_kv_bytes) < sum(s.bytes_per_group for s in ledger.sources)


def test_short_spans_grids_and_position_counts() -> None:
    # A span shorter than the window occupies only its own positions of each layer's window.
    im = image_ledger(v41_flash(), grid=(1, 2), vision=released_vision())
    assert im.positions == 5 and im.window_bytes == 5 * FLASH_WINDOW_ROW
    assert im.canvas == (42, 84) and im.patches == 3 * 6
    by_count = image_ledger(v41_flash(), positions=500, vision=released_vision())
    assert by_count.patches is None and by_count.patch_rows is None and by_count.grid is None
    assert by_count.global_kv_bytes == 500 * 890 and by_count.feature_bytes == 500 * HIDDEN * 2


def test_a_vision_config_in_the_model_is_used() -> None:
    cfg = v41_tiny_vision()
    assert cfg.vision_config is not None
    im = image_ledger(cfg, size=(84, 84))  # the tiny tower's minimum: a 2 × 2 grid
    assert im.grid == (2, 2) and im.positions == 8 and im.tower_layers == 2
    assert im.feature_bytes == 8 * cfg.hidden_size * 2
    assert (
        im.window_bytes
        == min(8, cfg.sliding_window) * kv_ledger(cfg).window_entry_bytes * cfg.num_hidden_layers
    )
    assert math.isclose(float(im.global_kv_bytes), 8 * float(kv_ledger(cfg).global_bytes_per_token()))


@pytest.mark.parametrize(
    ("config", "kwargs", "needle"),
    [
        (v41_tiny(), {"size": (84, 84)}, "no vision_config"),
        (v4_flash(), {"size": (84, 84)}, "DeepSeek-V4.1"),
        (v41_tiny_vision(), {"size": (84, 84), "positions": 8}, "exactly one"),
        (v41_tiny_vision(), {}, "exactly one"),
        (v41_tiny_vision(), {"positions": 2}, "at least 3"),
        (v41_tiny_vision(), {"grid": (0, 3)}, "at least one row"),
    ],
)
def test_errors_say_what_to_change(config: object, kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        image_ledger(config, **kwargs)  # type: ignore[arg-type]
