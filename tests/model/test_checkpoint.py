"""Loading a config.json: `--kv-quant` applied before validation, and shapes the KV quantisers
cannot take loaded unquantised with a warning that names the reason (as transformers runs them)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from replaykv.model.checkpoint import (
    INDEX_FILE,
    WEIGHTS_FILE,
    build_model,
    load_config,
    load_model,
    read_state_dict,
    save_pretrained,
    weight_files,
)
from replaykv.model.config_v41 import DeepseekV41Config
from replaykv.model.init import init_weights
from replaykv.model.presets_v41 import v41_tiny

REPO = Path(__file__).resolve().parents[2]


def _checkpoint(directory: Path, **changes: object) -> Path:
    config = v41_tiny().replace(kv_quant=False, **changes)
    save_pretrained(init_weights(build_model(config), seed=0), directory)
    return directory


def test_a_width_the_quantisers_cannot_take_loads_unquantised_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model_dir = _checkpoint(tmp_path, head_dim=40)
    assert "kv_quant" not in json.loads((model_dir / "config.json").read_text())
    with caplog.at_level(logging.WARNING, logger="replaykv.model.config_v41"):
        config = load_config(model_dir)
    assert isinstance(config, DeepseekV41Config) and config.head_dim == 40 and not config.kv_quant
    assert any(
        "without the KV quantisers" in r.message and "head_dim (40) is not a multiple of 32" in r.message
        for r in caplog.records
    ), caplog.text
    assert not load_config(model_dir, kv_quant=False).kv_quant
    with pytest.raises(ValueError, match=r"kv_quant is on but head_dim \(40\) is not a multiple of 32"):
        load_config(model_dir, kv_quant=True)
    assert load_model(model_dir).config.head_dim == 40


def test_a_config_that_asks_for_no_quantisation_gets_none(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model_dir = _checkpoint(tmp_path)
    raw = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**raw, "kv_quant": False}))
    with caplog.at_level(logging.WARNING, logger="replaykv.model.config_v41"):
        assert not load_config(model_dir).kv_quant
    assert "config.json sets kv_quant false" in caplog.text
    assert load_config(model_dir, kv_quant=True).kv_quant
    (model_dir / "config.json").write_text(json.dumps(raw))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="replaykv.model.config_v41"):
        assert load_config(model_dir).kv_quant  # a quantisable width, nothing asked: quantised
    assert not caplog.records


@pytest.mark.parametrize("flag", [[], ["--kv-quant", "off"]])
def test_the_command_line_loads_it(tmp_path: Path, flag: list[str]) -> None:
    model_dir = _checkpoint(tmp_path / "model", head_dim=40)
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([256, 72, 105, 33]))
    out = tmp_path / "logits.npy"
    cmd = [sys.executable, "-m", "replaykv", "score", "--model", str(model_dir), "--input-ids", str(ids)]
    done = subprocess.run(
        [*cmd, "--out", str(out), *flag], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert np.load(out).shape == (4, 512)
    if not flag:
        assert "head_dim (40) is not a multiple of 32" in done.stderr
    refused = subprocess.run(
        [*cmd, "--out", str(out), "--kv-quant", "on"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert refused.returncode != 0 and "kv_quant is on but head_dim (40)" in refused.stderr


def test_a_checkpoint_saved_in_shards_keeps_each_under_the_size_and_loads_the_same_weights(
    tmp_path: Path,
) -> None:
    model = init_weights(build_model(v41_tiny().replace(kv_quant=False)), seed=0)
    save_pretrained(model, tmp_path / "one")
    limit = 1 << 20
    save_pretrained(model, tmp_path / "sharded", shard_bytes=limit)
    shards = weight_files(tmp_path / "sharded")
    total = (tmp_path / "one" / WEIGHTS_FILE).stat().st_size
    assert len(shards) >= -(-total // limit) >= 2 and not (tmp_path / "sharded" / WEIGHTS_FILE).exists()
    assert all(f.stat().st_size <= limit for f in shards), [f.stat().st_size for f in shards]
    one, sharded = read_state_dict(tmp_path / "one"), read_state_dict(tmp_path / "sharded")
    assert one.keys() == sharded.keys() and all((one[k] == sharded[k]).all() for k in one)
    loaded = load_model(tmp_path / "sharded", dtype="float32")
    assert all((a == b).all() for a, b in zip(loaded.state_dict().values(), model.state_dict().values(), strict=True))
    # Saving again as one file leaves one checkpoint in the directory, not two.
    save_pretrained(model, tmp_path / "sharded")
    assert weight_files(tmp_path / "sharded") == [tmp_path / "sharded" / WEIGHTS_FILE]
    assert not (tmp_path / "sharded" / INDEX_FILE).exists()
    assert sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors")) == [WEIGHTS_FILE]
    with pytest.raises(ValueError, match="does not fit a shard"):
        save_pretrained(model, tmp_path / "tiny_shards", shard_bytes=64 << 10)
