"""Exact resume restores every random generator from a state file loaded onto the training device."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch

from replaykv.train.state import rng_state, set_rng_state

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_rng_state_round_trip_through_map_location(device: str) -> None:
    buf = io.BytesIO()
    torch.save({"rng": rng_state()}, buf)
    expected = (torch.rand(4), np.random.rand(4), random.random())
    for _ in range(3):  # move every generator on
        torch.rand(4), np.random.rand(4), random.random()
    buf.seek(0)
    state = torch.load(buf, map_location=device, weights_only=False)
    set_rng_state(state["rng"])
    again = (torch.rand(4), np.random.rand(4), random.random())
    assert torch.equal(expected[0], again[0])
    assert np.array_equal(expected[1], again[1]) and expected[2] == again[2]
