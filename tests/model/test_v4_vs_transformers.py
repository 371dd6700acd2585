"""DeepSeek-V4: replaykv against transformers' own forward (an independent implementation)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from replaykv.cache.views import advance, allocate_view
from replaykv.model import native
from replaykv.model.checkpoint import load_model
from replaykv.model.spec import ModelSpec
from tests.model.hf_reference import SCHEDULES, hf_logits, save_hf_model


def test_the_pinned_transformers_is_installed() -> None:
    import transformers  # a declared test dependency: missing, this file fails at once

    assert transformers.__version__ == "5.24.0"


TOL = 1e-4
SEQ = 200


@pytest.fixture(scope="module", params=sorted(SCHEDULES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    directory = tmp_path_factory.mktemp(request.param)
    hf = save_hf_model(request.param, directory, seed=len(request.param))
    ours = load_model(directory)
    torch.manual_seed(1)
    ids = torch.randint(0, hf.config.vocab_size, (1, SEQ))
    return directory, hf, ours, ids, hf_logits(hf, ids)


def run_chunks(model, ids: torch.Tensor, chunks: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    view = allocate_view(ModelSpec.from_config(model.config), ids.shape[0], ids.shape[1])
    outs, pos = [], 0
    with torch.no_grad():
        for c in chunks:
            outs.append(model(ids[:, pos : pos + c], view))
            advance(view, c)
            pos += c
    assert pos == ids.shape[1]
    return torch.cat(outs, dim=1)


def test_one_shot_prefill(pair) -> None:  # type: ignore[no-untyped-def]
    _, _, ours, ids, ref = pair
    diff = (run_chunks(ours, ids, [SEQ]) - ref).abs().max().item()
    assert diff <= TOL, diff


def test_ragged_chunked_prefill(pair) -> None:  # type: ignore[no-untyped-def]
    _, _, ours, ids, ref = pair
    chunks = [1, 3, 17, 5, 63, 2, 41, 9, 59]  # not aligned to 4, 8, 16 or 128
    diff = (run_chunks(ours, ids, chunks) - ref).abs().max().item()
    assert diff <= TOL, diff


def test_prefill_then_64_decode_steps(pair) -> None:  # type: ignore[no-untyped-def]
    _, _, ours, ids, ref = pair
    out = run_chunks(ours, ids, [SEQ - 64] + [1] * 64)
    diff = (out - ref).abs().max().item()
    assert diff <= TOL, diff
    assert torch.equal(out, run_chunks(ours, ids, [SEQ]))  # and the one-shot rows, bit for bit


def test_index_scores_in_slices_against_transformers(pair, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The torch path of the indexer (CUDA, or the CPU without the native kernel) scores its
    entries in slices (attention.INDEX_SLICE); slices of 7 entries (up to 8 per block here) give
    the one-piece logits bit for bit, one shot and with decode, and match transformers."""
    import replaykv.model.attention as attention

    _, _, ours, ids, ref = pair
    decode = [SEQ - 16] + [1] * 16
    with native.disabled():
        whole, whole_decode = run_chunks(ours, ids, [SEQ]), run_chunks(ours, ids, decode)
        assert (whole - ref).abs().max().item() <= TOL
        monkeypatch.setattr(attention, "INDEX_SLICE", 7)
        assert torch.equal(run_chunks(ours, ids, [SEQ]), whole)
        sliced = run_chunks(ours, ids, decode)
    assert torch.equal(sliced, whole_decode) and (sliced - ref).abs().max().item() <= TOL


def test_batch_rows_at_different_positions(pair) -> None:  # type: ignore[no-untyped-def]
    """Two rows, one 37 tokens ahead of the other, decoded together in one batch."""
    _, hf, ours, ids, ref = pair
    torch.manual_seed(2)
    other = torch.randint(0, hf.config.vocab_size, (1, SEQ))
    ref_other = hf_logits(hf, other)
    view = allocate_view(ModelSpec.from_config(ours.config), 2, SEQ)
    with torch.no_grad():
        # Row 0 prefills 120 tokens, row 1 prefills 83 (run as two single-row views sharing tensors).
        lead, lag = 120, 83
        out0 = ours(ids[:, :lead], _row_view(view, 0))
        out1 = ours(other[:, :lag], _row_view(view, 1))
        view.positions[0], view.positions[1] = lead, lag
        rows0, rows1 = [out0], [out1]
        for step in range(SEQ - lead):
            batch_ids = torch.stack([ids[0, lead + step], other[0, lag + step]])[:, None]
            out = ours(batch_ids, view)
            advance(view, 1)
            rows0.append(out[:1])
            rows1.append(out[1:])
    got0 = torch.cat(rows0, dim=1)
    got1 = torch.cat(rows1, dim=1)
    assert (got0 - ref[:, : got0.shape[1]]).abs().max().item() <= TOL
    assert (got1 - ref_other[:, : got1.shape[1]]).abs().max().item() <= TOL


def _row_view(view, row: int):  # type: ignore[no-untyped-def]
    """A single-row view aliasing row `row` of a batch view's tensors."""
    from replaykv.model.cache_view import CacheView, CompressorCarry, LayerCacheView

    def sl(t):  # type: ignore[no-untyped-def]
        return None if t is None else t[row : row + 1]

    layers = []
    for lc in view.layers:
        layers.append(
            LayerCacheView(
                window=lc.window[row : row + 1],
                entries=sl(lc.entries),
                carry=None if lc.carry is None else CompressorCarry(sl(lc.carry.kv), sl(lc.carry.gate)),
                index_keys=sl(lc.index_keys),
                index_carry=None
                if lc.index_carry is None
                else CompressorCarry(sl(lc.index_carry.kv), sl(lc.index_carry.gate)),
            )
        )
    return CacheView(positions=view.positions[row : row + 1].clone(), layers=layers)


def test_score_cli_matches_transformers(pair, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    directory, _, _, ids, ref = pair
    inp = tmp_path / "ids.json"
    inp.write_text(json.dumps(ids[0].tolist()))
    out = tmp_path / "logits.npy"
    cmd = [sys.executable, "-m", "replaykv", "score", "--model", str(directory), "--input-ids", str(inp),
           "--out", str(out), "--chunk", "37"]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    logits = np.load(out)
    assert logits.dtype == np.float32 and logits.shape == tuple(ref.shape[1:])
    assert np.abs(logits - ref[0].numpy()).max() <= TOL
