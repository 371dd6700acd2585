"""Shared fixtures of the training tests: a small corpus with a quarter held out, and one torch
thread (shared CPUs: one thread is faster than two fighting for cores, and keeps the suite light)."""

from __future__ import annotations

import pytest
import torch

from replaykv.train.data import load_corpus


@pytest.fixture(scope="module")
def corpus():  # type: ignore[no-untyped-def]
    return load_corpus(max_files=40, heldout_percent=25)


@pytest.fixture(autouse=True)
def one_thread():  # type: ignore[no-untyped-def]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
