"""The image-and-text suffix: generated pictures, image cases (span positions, cuts that never
split a span, no task score), the early refusal on a model without a vision tower, and
contracts that vary the suffix over text and image on `v41-tiny-vision`, run end to end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from replaykv.accept.cases import ImageSetup, build_cases, outcome
from replaykv.accept.cli import main as accept_main
from replaykv.accept.contract import ContractError, load_contract, parse_contract
from replaykv.accept.harness import Endpoints, InProcess, run_contract
from replaykv.model.checkpoint import build_model, save_pretrained
from replaykv.model.init import init_weights
from replaykv.model.presets import get_preset
from replaykv.model.presets_v41 import v41_tiny_vision
from replaykv.pictures import KINDS, draw_picture
from replaykv.tokenizer import ByteTokenizer

CONTRACTS = Path(__file__).resolve().parents[2] / "replaykv" / "accept" / "contracts"
MATRIX: dict[str, Any] = {
    "tasks": ["passkey"],
    "cuts": ["end"],
    "lengths": [320],
    "suffixes": ["short", "image"],
    "outputs": ["short"],
    "prompts_per_cell": 2,
    "shifts": [-130, 20],  # +20 moves the cut of an image case past its picture
    "short_suffix": 48,  # text cases keep more than W uncached tokens at the +20 shift
    "chunk_shifts": False,
    "concurrency": [1],
    "load_prompts": 2,
    "max_answer_tokens": 24,
}
# Written before any run of these tests: replay off in both arms reproduces the cold path exactly
# with pictures in the prompt; replay on moves each next-token distribution by at most 0.2 nats
# on average (95% upper bound), text and image cases alike and image cases on their own.
AA = {
    "name": "a-a-images",
    "stage": "baseline",
    "matrix": MATRIX,
    "criteria": [
        {"name": "states-forced", "metric": "state_reached", "threshold": 1.0},
        {"name": "exact", "metric": "exact_match", "threshold": 1.0, "statistic": "point"},
        {"name": "image-exact", "metric": "exact_match", "suffixes": ["image"], "threshold": 1.0,
         "statistic": "point"},
        {"name": "kl", "metric": "kl_mean", "threshold": 1e-9, "statistic": "point"},
    ],
}  # fmt: skip
REPLAY = {
    "name": "replay-images",
    "stage": "encoder_replay",
    "matrix": MATRIX,
    "criteria": [
        {"name": "states-forced", "metric": "state_reached", "threshold": 1.0},
        {"name": "miss-kl", "metric": "kl_mean", "states": ["miss", "shift"], "threshold": 0.2},
        {"name": "image-kl", "metric": "kl_mean", "suffixes": ["image"], "threshold": 0.2},
        {"name": "text-success", "metric": "success_drop", "threshold": 1.0},
    ],
}
BASE: dict[str, Any] = {"name": "t", "stage": "encoder_replay",
                        "criteria": [{"name": "kl", "metric": "kl_mean", "threshold": 0.1}]}  # fmt: skip


def contract_file(tmp: Path, body: dict[str, Any]) -> Path:
    path = tmp / f"{body['name']}.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


@pytest.fixture(scope="module")
def heldout() -> Any:
    from replaykv.train.data import load_corpus

    return load_corpus(splits=("heldout",))["heldout"]


@pytest.fixture(scope="module")
def vision_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`v41-tiny-vision` with wider random weights and a sharpened head (peaked outputs)."""
    out = tmp_path_factory.mktemp("peaked-vision")
    m: Any = init_weights(build_model(get_preset("v41-tiny-vision")), seed=0, std=0.05)
    with torch.no_grad():
        m.lm_head.weight.mul_(8.0)
    save_pretrained(m, out)
    ByteTokenizer().save(out)
    return out


def test_pictures_are_drawn_from_the_seed_alone() -> None:
    a = draw_picture(np.random.default_rng([7, 1]))
    b = draw_picture(np.random.default_rng([7, 1]))
    assert np.array_equal(a.pixels, b.pixels) and (a.kind, a.question, a.answer) == (
        b.kind,
        b.question,
        b.answer,
    )
    drawn = [draw_picture(np.random.default_rng([0, i]), kind) for i, kind in enumerate(KINDS)]
    for p in drawn:
        assert p.pixels.dtype == np.uint8 and p.pixels.ndim == 3 and p.pixels.shape[2] == 3
        assert p.pixels.std() > 5  # something is drawn on the background
        assert p.question.endswith("?") and p.answer
    assert drawn[0].answer.isdigit() and drawn[1].answer.split()[-1] in ("circle", "square", "triangle")
    with pytest.raises(ValueError, match="unknown picture kind"):
        draw_picture(np.random.default_rng(0), "video")


def test_image_cases_place_their_span_after_the_first_turn(heldout: Any) -> None:
    cfg = v41_tiny_vision()
    setup = ImageSetup.from_config(cfg)
    assert setup is not None and setup.image_token_id == cfg.image_token_id
    c = parse_contract({**BASE, "matrix": {**MATRIX, "cuts": ["end", "boundary"], "design": "factorial"}})
    cases = build_cases(c, heldout, window=cfg.sliding_window, images=setup)
    image_cases = [x for x in cases if x.cell.suffix == "image"]
    assert len(image_cases) == 4 and all(not x.images for x in cases if x.cell.suffix != "image")
    for x in image_cases:
        (im,) = x.images
        assert set(x.prompt[im.start : im.end]) == {cfg.image_token_id}
        assert cfg.image_token_id not in x.prompt[: im.start] + x.prompt[im.end :]
        assert im.image.span_length == im.end - im.start and x.picture is not None
        # the image turn: <|user|> span question <|end|> <|assistant|>, after the answered first turn
        assert x.prompt[im.start - 1] == ByteTokenizer().special_ids["<|user|>"]
        assert x.prompt[im.start - 1 - len(x.sample.answer) : im.start - 1] == x.sample.answer
        tail = bytes(t for t in x.prompt[im.end :] if t < 256).decode()
        assert tail == x.picture.question
        if x.cell.cut == "end":
            assert x.cut == im.start - 1  # the whole image turn is uncached
        for cut in (x.cut, *(h for _, h in x.shifts)):
            assert not im.start < cut < im.end  # never inside the span
        assert x.images_before(im.end) == x.images and x.images_before(im.end - 1) == ()
        assert outcome(x, []) == {"success": None, "valid": None}  # not scored
    assert any(
        h > im.end for x in image_cases for _, h in x.shifts for im in x.images
    )  # a prefix with the image
    # The same contract and seed draw the same pictures.
    again = build_cases(c, heldout, window=cfg.sliding_window, images=setup)
    assert [x.images[0].image.digest for x in again if x.images] == [
        x.images[0].image.digest for x in image_cases
    ]


def test_image_suffix_without_a_vision_tower_is_refused_early(
    tmp_path: Path, heldout: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = contract_file(tmp_path, REPLAY)
    import replaykv.accept.harness as harness

    def no_engine(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("an engine was started before the contract was refused")

    monkeypatch.setattr(harness, "InProcessTarget", no_engine)
    with pytest.raises(ContractError, match=r"'image'.*preset tiny.*no vision tower"):
        run_contract(path, tmp_path / "r", InProcess(preset="tiny"))
    with pytest.raises(ContractError, match="endpoint mode"):
        run_contract(path, tmp_path / "r", Endpoints("http://127.0.0.1:9", "http://127.0.0.1:9"))
    assert accept_main(["--contract", str(path), "--preset", "small", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "matrix.suffixes has 'image'" in err and "v41-tiny-vision" in err
    with pytest.raises(ContractError, match="no vision tower"):
        build_cases(parse_contract({**BASE, "matrix": MATRIX}), heldout, window=8)
    with pytest.raises(ContractError, match="not scored for task success"):
        parse_contract({**BASE, "criteria": [{"name": "s", "metric": "success_drop", "suffixes": ["image"],
                                              "threshold": 0.1}]})  # fmt: skip
    assert "image" not in parse_contract(BASE).matrix.suffixes  # not asked for by default


def test_bundled_contracts() -> None:
    example = load_contract(CONTRACTS / "example.yaml")
    assert "image" not in example.matrix.suffixes  # runs on the text model
    image = load_contract(CONTRACTS / "image.yaml")
    assert set(image.matrix.suffixes) == {"short", "image"}
    assert any(c.suffixes == ("image",) for c in image.criteria)


def test_text_and_image_contracts_run_end_to_end(tmp_path: Path, vision_dir: Path) -> None:
    aa = run_contract(contract_file(tmp_path, AA), tmp_path / "aa", InProcess(str(vision_dir)))
    assert aa["passed"], aa["failing"]
    rep = run_contract(contract_file(tmp_path, REPLAY), tmp_path / "replay", InProcess(str(vision_dir)))
    assert rep["passed"], [(v["name"], v["value"]) for v in rep["criteria"]]
    image_records = [r for r in rep["records"] if r["cell"]["suffix"] == "image"]
    assert {r["state"] for r in image_records} == {"cold", "hit", "miss", "shift"}
    assert all(r["outcome"]["success"] is None for r in image_records)
    for r in image_records:
        assert r["obs"]["error"] is None
        assert r["obs"]["extra"]["image_tokens"] > 0  # the request carried its picture
    assert any(r["obs"]["extra"]["images_encoded"] == 1 for r in image_records)
    crit = {v["name"]: v for v in rep["criteria"]}
    assert crit["image-kl"]["stats"]["n"] > 0 and crit["text-success"]["stats"]["n"] > 0
    # success counts text cases only: image pairs carry no outcome
    assert crit["text-success"]["stats"]["n"] == sum("/short/short#" in p["case"] for p in rep["pairs"])
    cells = {(c["cell"], c["state"]) for c in rep["cells"]}
    assert ("passkey/end/320/image/short", "shift") in cells
    md = (tmp_path / "replay" / "report.md").read_text()
    assert (
        "scored by agreement with the baseline" in md
        and json.loads((tmp_path / "replay" / "report.json").read_text())["notes"]
    )


def test_a_dropped_global_kv_fails_the_image_criteria(tmp_path: Path, vision_dir: Path) -> None:
    rep = run_contract(
        contract_file(tmp_path, REPLAY), tmp_path / "r", InProcess(str(vision_dir), fault="drop_global_kv")
    )
    assert {"miss-kl", "image-kl"} <= set(rep["failing"])
