"""`replaykv generate` on a saved tiny model: the printed continuation is the greedy one, each
token checked against a teacher-forced scoring of the sequence so far (no decode loop)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from replaykv.cli import main
from replaykv.engine.oneshot import score
from replaykv.model.checkpoint import build_model, load_model, save_pretrained
from replaykv.model.init import init_weights
from replaykv.model.presets import get_preset
from replaykv.tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset with wider random weights and a sharpened head, so greedy picks are clear."""
    out = tmp_path_factory.mktemp("gen")
    m = init_weights(build_model(get_preset("tiny")), seed=1, std=0.05)
    with torch.no_grad():
        m.lm_head.weight.mul_(8.0)
    save_pretrained(m, out)
    ByteTokenizer().save(out)
    return out


def test_generate_prints_the_greedy_continuation(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompt = "The window slides"
    assert main(["generate", "--model", str(model_dir), "--prompt", prompt, "--max-tokens", "6"]) == 0
    out = capsys.readouterr().out
    found = re.search(r"output: (.*)  \(token ids \[([0-9, ]*)\]\)", out)
    assert found is not None, out
    new = [int(t) for t in found.group(2).split(", ")]
    assert len(new) == 6 and "RANDOM" not in out and f"prompt: {prompt!r}" in out
    tok = ByteTokenizer()
    assert found.group(1) == repr(tok.decode(new))
    ids = tok.encode(prompt, bos=True)
    model = load_model(model_dir)
    for j, token in enumerate(new):
        logits = score(model, ids + new[:j])[-1]
        assert token == int(logits.argmax()), j
        top2 = torch.topk(logits, 2).values
        assert float(top2[0] - top2[1]) > 1e-3  # a clear pick, so the check cannot pass by a tie


def test_generate_with_a_chunked_prefill_gives_the_same_tokens(
    model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = []
    for chunk in ("0", "5"):
        args = ["generate", "--model", str(model_dir), "--prompt", "abcdefghijklmnop", "--max-tokens", "4"]
        assert main([*args, "--chunk", chunk]) == 0
        runs.append(re.findall(r"token ids (\[.*\])", capsys.readouterr().out))
    assert runs[0] == runs[1] and len(runs[0]) == 1
