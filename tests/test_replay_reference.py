"""Bounded and decoder replay against a naive reference written from the semantics of
docs/architecture.md and architecture reference §13, not through `plan_prefill` / `execute`.

The reference drives the model layer by layer on one cache view, setting each call's positions
and window floor by hand:

    earlier request   [0, cut)       every layer (decoder replay on: the encoder layers only;
                                     the decoder's window entries are dropped with the snapshot)
    snapshot lost     every window ring overwritten with large random values
    replay + new      [s, S)         the encoder (decoder replay off: every layer), floor
                                     s = max(0, cut - W), rows [s, cut) read-only (no global KV
                                     written), rows [cut, S) writing
    decoder replay    [d, S)         the decoder layers, floor d = max(0, S - W), on the
                                     encoder's output and index selections of those rows

Quantisers off, float32; the project's bounded path must match to 1e-5 on every row it computes.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from replaykv.cache.views import allocate_view
from replaykv.engine.scenario import score_after_cut
from replaykv.model.spec import ModelSpec
from replaykv.model.step import Selection
from replaykv.model.v41 import DeepseekV41ForCausalLM
from replaykv.replay import ReplayFlags
from tests.engine.conftest import reference_greedy
from tests.test_replay import S, W, ids_for, tiny_model

TOL = 1e-5


@pytest.fixture(scope="module")
def model() -> DeepseekV41ForCausalLM:
    return tiny_model(kv_quant=False)


def naive_bounded(
    model: DeepseekV41ForCausalLM,
    ids: list[int],
    cut: int,
    decoder: bool,
    spans: Sequence[tuple[int, torch.Tensor]] = (),
) -> torch.Tensor:
    """Logits [S - cut, vocab] of the follow-up after a lost snapshot (rows not computed: NaN).
    `spans`: image spans (first position, span vectors), placed on every row embedded: the
    earlier request's, the replayed and the new ones."""
    cfg = model.config
    assert cfg.sliding_window == W
    n = len(ids)
    x = torch.tensor([ids])
    every = range(cfg.num_hidden_layers)
    encoder, dec_layers = range(cfg.decoder_cut + 1), range(cfg.decoder_cut + 1, cfg.num_hidden_layers)
    view = allocate_view(ModelSpec.from_config(cfg), 1, n, torch.device("cpu"), torch.float32)

    def at(position: int, floor: int) -> None:
        view.positions = torch.tensor([position])
        view.window_floor = torch.tensor([floor])

    with torch.no_grad():
        at(0, 0)
        model.run_layers(
            model.embed(x[:, :cut], spans, 0), encoder if decoder else every, model.step(view, cut), view
        )
        gen = torch.Generator().manual_seed(1)
        for layer in view.layers:
            layer.window.copy_(torch.randn(layer.window.shape, generator=gen) * 1e3)

        s = max(0, cut - W)
        at(s, s)
        selection = Selection()
        step = model.step(view, n - s, write_global=True, global_from=cut - s)
        state = model.run_layers(
            model.embed(x[:, s:], spans, s), encoder if decoder else every, step, view, selection
        )
        out = torch.full((n - cut, cfg.vocab_size), float("nan"))
        if not decoder:
            out[:] = model.head(state.rows(cut - s, n - s))[0]
            return out
        d = max(0, n - W)
        at(d, d)
        step = model.step(view, n - d, write_global=False)
        state = model.run_layers(
            state.rows(d - s, n - s), dec_layers, step, view, selection.rows(d - s, n - s)
        )
        logits = model.head(state)[0]
        lo = max(cut, d)
        out[lo - cut :] = logits[lo - d :]
        return out


class NaiveConversation:
    """The same reference over a whole conversation with decoder replay on: one cache view kept
    across turns, each turn's SWA snapshot lost before the next, greedy decoding row by row.

    Turn t has prompt P_t (the previous prompt, its output but the last token, new user tokens)
    and continues after ``cut`` rows computed by the earlier turns (their global KV kept, as a
    store would keep it; the windows overwritten with noise). Encoder layers: floor s =
    max(0, cut − W) on the replay and on every decoded row; rows [s, cut) read-only. Decoder
    layers: rows [d, P_t), d = max(0, P_t − W), then each decoded row, floor d. The first turn is
    a cold prefill (cut 0, floor 0)."""

    def __init__(self, model: DeepseekV41ForCausalLM, capacity: int) -> None:
        cfg = model.config
        self.model, self.window = model, cfg.sliding_window
        self.encoder = range(cfg.decoder_cut + 1)
        self.decoder = range(cfg.decoder_cut + 1, cfg.num_hidden_layers)
        self.view = allocate_view(ModelSpec.from_config(cfg), 1, capacity, torch.device("cpu"), torch.float32)
        self.rows = 0  # rows whose global KV the view holds
        self.noise = torch.Generator().manual_seed(1)

    def _at(self, position: int, floor: int) -> None:
        self.view.positions = torch.tensor([position])
        self.view.window_floor = torch.tensor([floor])

    def _rows(
        self, ids: list[int], start: int, enc_floor: int, dec_start: int, global_from: int
    ) -> torch.Tensor:
        """Encoder over ids[start:], decoder over ids[dec_start:]: logits of the decoder's rows."""
        m, n, x = self.model, len(ids), torch.tensor([ids])
        selection = Selection()
        self._at(start, enc_floor)
        step = m.step(self.view, n - start, write_global=True, global_from=global_from)
        state = m.run_layers(m.embed(x[:, start:]), self.encoder, step, self.view, selection)
        self._at(dec_start, self.dec_floor)
        step = m.step(self.view, n - dec_start, write_global=False)
        rows = (dec_start - start, n - start)
        state = m.run_layers(state.rows(*rows), self.decoder, step, self.view, selection.rows(*rows))
        return m.head(state)[0]

    def turn(self, prompt: list[int], cut: int, n_out: int) -> list[int]:
        assert cut == self.rows, "the turn must continue where the last one ended"
        with torch.no_grad():
            if cut:
                for layer in self.view.layers:
                    layer.window.copy_(torch.randn(layer.window.shape, generator=self.noise) * 1e3)
            s, p = max(0, cut - self.window), len(prompt)
            self.dec_floor = max(0, p - self.window)
            logits = self._rows(prompt, s, s, self.dec_floor, cut - s)
            out = [int(logits[-1].argmax())]
            ids = list(prompt)
            while len(out) < n_out:
                ids.append(out[-1])
                out.append(int(self._rows(ids, len(ids) - 1, s, len(ids) - 1, 0)[-1].argmax()))
        self.rows = len(ids)
        return out


@pytest.mark.parametrize("decoder", [False, True], ids=["decoder-replay-off", "decoder-replay-on"])
@pytest.mark.parametrize("cut", [3, W, W + 1, 21, S - W - 1, S - 2])
def test_bounded_replay_matches_the_naive_reference(
    model: DeepseekV41ForCausalLM, cut: int, decoder: bool
) -> None:
    ids = ids_for(100 + cut)
    flags = ReplayFlags(enable_decoder_swa_bounded_replay=decoder)
    got, plan = score_after_cut(model, ids, cut, flags, keep_snapshot=False)
    assert plan.path == "bounded"
    want = naive_bounded(model, ids, cut, decoder)
    assert torch.equal(torch.isnan(got), torch.isnan(want)), "the paths computed different rows"
    rows = ~torch.isnan(want[:, 0])
    assert int(rows.sum()) == (S - cut if not decoder else min(S - cut, W))
    assert (got[rows] - want[rows]).abs().max().item() <= TOL


def test_the_conversation_reference_starts_as_a_cold_greedy_run(model: DeepseekV41ForCausalLM) -> None:
    """A check of the conversation reference: its first turn is the cold path with decoder
    replay on, run through the project's own prefill and decode loop."""
    ids = ids_for(9)
    got = NaiveConversation(model, len(ids) + 6).turn(ids, 0, 6)
    assert got == reference_greedy(model, ids, 6, decoder_replay=True)


def test_the_reference_is_a_cold_prefill_only_without_a_floor(model: DeepseekV41ForCausalLM) -> None:
    """A check of the reference itself: with the cut inside the first W tokens the floor is 0 and
    the replay rebuilds the whole window, so it equals a cold prefill; further in, the floor cuts
    the windows and the answer moves."""
    ids = ids_for(7)
    off = ReplayFlags(enable_decoder_swa_bounded_replay=False)
    cold, _ = score_after_cut(model, ids, 0, off, keep_snapshot=True)
    for cut, equal in ((3, True), (W - 2, True), (40, False)):
        got = naive_bounded(model, ids, cut, decoder=False)
        gap = (got[-1] - cold[-1]).abs().max().item()
        assert (gap <= TOL) is equal, (cut, gap)
