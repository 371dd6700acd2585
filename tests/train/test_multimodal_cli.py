"""`replaykv train --contrastive` through the CLI's `main`: a one-step run of the tiny recipe in two
gloo processes writes its report and a loadable export with the tower; options the stage does not
read are refused by name with exit status 2."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import replaykv
from replaykv.model.checkpoint import load_model
from replaykv.train import cli
from replaykv.train.recipes import get_recipe


def test_contrastive_run_writes_report_and_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "clip"
    argv = ["--recipe", "tiny", "--out", str(out), "--contrastive", "--steps", "1", "--pairs", "2"]
    assert cli.main([*argv, "--threads", "1", "--blocking-gathers"]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith("tiny contrastive (v41-tiny-vision): 1 steps, 2 processes x 2 pairs")
    assert "median exposed gather (blocking): image " in summary and " ms, text " in summary
    report = json.loads((out / "contrastive.json").read_text())
    assert report["args"]["preset"] == "v41-tiny-vision"
    assert report["args"]["overlap"] is False and report["args"]["processes"] == 2
    assert len(report["steps"]) == 1 and report["steps"][0]["loss"] > 0
    model = load_model(out)
    assert model.model.vision is not None
    assert (out / "vision" / "vision.safetensors").is_file()
    assert (out / "vision" / "projections.safetensors").is_file()


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--pipeline-stages", "2"], "--pipeline-stages"),
        (["--ship"], "--ship"),
        (["--bar"], "--bar"),
        (["--resume"], "--resume"),
        (["--resume", "--context-parallel", "2"], "--resume, --context-parallel"),
        (["--kernels", "fused"], "--kernels"),  # given explicitly, even at its default
    ],
)
def test_options_the_stage_does_not_read_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], named: str
) -> None:
    argv = ["--recipe", "tiny", "--out", str(tmp_path), "--contrastive", *extra]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {named} not implemented with --contrastive"]


def test_contrastive_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    base = ["--recipe", "tiny", "--out", str(tmp_path)]
    cases = [
        (["--processes", "2", "--blocking-gathers"], "error: --processes, --blocking-gathers apply only with --contrastive"),
        (["--contrastive", "--device", "mps"], "error: --device mps: the contrastive stage takes auto, cpu or cuda (one GPU per process)"),
        (["--contrastive", "--init", str(tmp_path / "none")], f"error: --init {tmp_path / 'none'}: not a model directory (no config.json)"),
    ]  # fmt: skip
    if not torch.cuda.is_available():
        cases.append(
            (["--contrastive", "--device", "cuda"], "error: --device cuda: no CUDA device is available")
        )
    for extra, message in cases:
        assert cli.main([*base, *extra]) == 2
        assert capsys.readouterr().err.strip() == message
    shipped = Path(replaykv.__file__).parent / "weights" / "small"
    assert cli.main([*base, "--contrastive", "--init", str(shipped)]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .startswith(
            f"error: --init {shipped}: its weights do not fit preset 'v41-tiny-vision' of recipe 'tiny' ("
        )
    )
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert cli.main([*base, "--contrastive", "--processes", "2"]) == 2
    assert capsys.readouterr().err.strip() == "error: --processes 2, but torchrun started 4 processes"
    monkeypatch.delenv("WORLD_SIZE")
    flash = dataclasses.replace(get_recipe("tiny"), preset="v41-flash")
    monkeypatch.setattr(cli, "get_recipe", lambda name: flash)
    assert cli.main([*base, "--contrastive"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "error: --contrastive: recipe 'tiny' trains preset 'v41-flash', which has no vision"
    )
    assert "v41-small-vision, v41-tiny-vision" in err
