"""`replaykv accept` end to end on a small model with peaked random weights (so divergences are
large enough to read): the honest candidate passes contracts whose thresholds are written here
first, deliberately broken candidates fail with the right criteria named, an A/A run is exact,
and two live servers (replay off / on) give the same verdicts as the in-process run."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from replaykv.accept.cli import main as accept_main
from replaykv.accept.harness import InProcess, run_contract
from replaykv.model.checkpoint import build_model, save_pretrained
from replaykv.model.init import init_weights
from replaykv.model.presets import get_preset
from replaykv.tokenizer import ByteTokenizer

MATRIX: dict[str, Any] = {
    "tasks": ["passkey", "chain"],
    "cuts": ["end", "boundary"],
    "lengths": [384],
    "suffixes": ["short"],
    "outputs": ["short"],
    "prompts_per_cell": 1,
    "shifts": [-130],
    "chunk_shifts": False,
    "concurrency": [1, 2],
    "load_prompts": 2,
}
# Written before any run of these tests: replay may move each next-token distribution by at most
# 0.2 nats on average (95% upper bound), in the hit state and in the snapshot-miss states.
REPLAY = {
    "name": "replay-budget",
    "stage": "encoder_replay",
    "matrix": MATRIX,
    "criteria": [
        {"name": "states-forced", "metric": "state_reached", "threshold": 1.0},
        {"name": "hit-kl", "metric": "kl_mean", "states": ["hit"], "threshold": 0.2},
        {"name": "miss-kl", "metric": "kl_mean", "states": ["miss", "shift"], "threshold": 0.2},
        {"name": "miss-work", "metric": "prefill_work_ratio", "states": ["miss"], "threshold": 0.5},
    ],
}
# The same criteria without the load passes, for tests that read only the quality verdicts.
QUALITY_ONLY = {**REPLAY, "matrix": {**MATRIX, "concurrency": []}}
# Replay off in both arms: every state must reproduce the cold path exactly.
AA = {
    "name": "a-a",
    "stage": "baseline",
    "matrix": {**MATRIX, "concurrency": []},
    "criteria": [
        {"name": "states-forced", "metric": "state_reached", "threshold": 1.0},
        {"name": "exact", "metric": "exact_match", "threshold": 1.0, "statistic": "point"},
        {"name": "kl", "metric": "kl_mean", "threshold": 1e-9, "statistic": "point"},
    ],
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny V4.1 preset with wider random weights and a sharpened head (peaked outputs)."""
    out = tmp_path_factory.mktemp("peaked")
    m = init_weights(build_model(get_preset("tiny")), seed=0, std=0.05)
    with torch.no_grad():
        m.lm_head.weight.mul_(8.0)
    save_pretrained(m, out)
    ByteTokenizer().save(out)
    return out


def contract_file(tmp: Path, body: dict[str, Any]) -> Path:
    path = tmp / f"{body['name']}.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def failing(tmp: Path, model_dir: Path, body: dict[str, Any], fault: str | None = None) -> list[str]:
    rep = run_contract(contract_file(tmp, body), tmp / "report", InProcess(str(model_dir), fault=fault))
    return sorted(rep["failing"])


def test_honest_candidate_passes_and_the_report_is_complete(
    tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = contract_file(tmp_path, REPLAY)
    code = accept_main(["--contract", str(path), "--model", str(model_dir), "--out", str(tmp_path / "r")])
    assert code == 0
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    quality = sum(r["phase"] == "quality" for r in rep["records"])
    err = capsys.readouterr().err
    assert "accept quality: 100%" in err and f"{quality}/{quality} [" in err, err[-500:]  # the tqdm bar
    assert "accept: quality pass" not in err
    assert rep["passed"] and rep["failing"] == []
    states = {(r["arm"], r["state"]) for r in rep["records"] if r["phase"] == "quality"}
    assert states == {("baseline", "cold"), ("candidate", "cold"), ("candidate", "hit"),
                      ("candidate", "miss"), ("candidate", "shift")}  # fmt: skip
    assert {r["phase"] for r in rep["records"]} == {"quality", "load:1", "load:2"}
    assert rep["resources"]["candidate"]["global_kv_bytes_written"] > 0
    for name in ("report.md", "report.html", "accuracy_vs_offset.png", "kl_vs_offset.png", "latency.png"):
        assert (tmp_path / "r" / name).stat().st_size > 0
    assert rep["contract_digest"] in (tmp_path / "r" / "report.md").read_text()
    for arm in ("baseline", "candidate"):  # the served model named by weights and config
        ident = rep["arms"][arm]
        assert len(ident["weights_sha256"]) == 64 and ident["config_digest"]
        assert ident["weights_sha256"] in (tmp_path / "r" / "report.md").read_text()
    # a threshold changed after the run is visible
    assert accept_main(["--verify-report", str(tmp_path / "r" / "report.json"), "--contract", str(path)]) == 0
    changed = json.loads(json.dumps(REPLAY))
    changed["criteria"][2]["threshold"] = 5.0
    assert accept_main(["--verify-report", str(tmp_path / "r" / "report.json"),
                        "--contract", str(contract_file(tmp_path, changed))]) == 1  # fmt: skip


@pytest.mark.parametrize(
    ("fault", "named"),
    [("window_untruncated", ["miss-kl"]), ("drop_global_kv", ["hit-kl", "miss-kl"])],
)
def test_broken_candidates_fail_with_the_right_criteria(
    tmp_path: Path, model_dir: Path, fault: str, named: list[str]
) -> None:
    code = accept_main(["--contract", str(contract_file(tmp_path, QUALITY_ONLY)), "--model", str(model_dir),
                        "--out", str(tmp_path / "cli"), "--inject-fault", fault])  # fmt: skip
    assert code == 1
    report = json.loads((tmp_path / "cli" / "report.json").read_text())
    assert sorted(report["failing"]) == named and {r["phase"] for r in report["records"]} == {"quality"}


def test_a_a_run_is_exact_and_catches_a_dropped_global_kv(tmp_path: Path, model_dir: Path) -> None:
    assert failing(tmp_path, model_dir, AA) == []
    assert failing(tmp_path, model_dir, AA, "drop_global_kv") == ["exact", "kl"]


@pytest.fixture
def servers(model_dir: Path, tmp_path: Path) -> Iterator[list[Any]]:
    from replaykv.engine.engine import Engine
    from replaykv.server.settings import load_settings
    from tests.server.conftest import LiveServer

    started = []
    off = ["--disable-encoder-swa-bounded-replay", "--disable-decoder-swa-bounded-replay"]
    on = ["--enable-encoder-swa-bounded-replay", "--enable-decoder-swa-bounded-replay"]
    for i, flags in enumerate((off, on)):
        store = str(tmp_path / f"store{i}")
        settings = load_settings(
            ["--model", str(model_dir), "--admin-key", "adm", "--cache-dir", store, *flags], environ={}
        )
        started.append(LiveServer(Engine(settings.engine_config()), settings.server()).start())
    yield started
    for live in started:
        live.stop()
        live.engine.shutdown()


def test_endpoint_mode_gives_the_in_process_verdicts(
    tmp_path: Path, model_dir: Path, servers: list[Any]
) -> None:
    body = json.loads(json.dumps(REPLAY))
    # a criterion the honest candidate fails, so that agreement is not only on passes
    body["criteria"].append({"name": "miss-exact", "metric": "exact_match", "states": ["miss", "shift"],
                             "threshold": 1.0, "statistic": "point"})  # fmt: skip
    path = contract_file(tmp_path, body)
    local = run_contract(path, tmp_path / "local", InProcess(str(model_dir)))
    base, cand = servers
    code = accept_main(["--contract", str(path), "--out", str(tmp_path / "remote"), "--baseline-url", base.url,
                        "--candidate-url", cand.url, "--admin-key", "adm", "--window", "8"])  # fmt: skip
    remote = json.loads((tmp_path / "remote" / "report.json").read_text())
    assert [(v["name"], v["passed"]) for v in remote["criteria"]] == [
        (v["name"], v["passed"]) for v in local["criteria"]
    ]
    assert local["failing"] == ["miss-exact"] and code == 1
    for arm in ("baseline", "candidate"):  # a replaykv endpoint names the same weights and config
        assert remote["arms"][arm]["weights_sha256"] == local["arms"][arm]["weights_sha256"]
        assert remote["arms"][arm]["config_digest"] == local["arms"][arm]["config_digest"]
    for a, b in zip(local["criteria"], remote["criteria"], strict=True):
        assert a["value"] == pytest.approx(b["value"], rel=1e-3, abs=1e-6), a["name"]
