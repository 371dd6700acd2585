"""bench/bench_kernels.py counts what each layer call dispatches: checked on layers whose operators are
known, and on a V4.1 model whose layer roles it groups."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_kernels import by_role, count_layers

from replaykv.cache.views import allocate_view
from replaykv.model.presets_v41 import get_preset_v41
from replaykv.model.spec import ModelSpec
from replaykv.model.v41 import DeepseekV41ForCausalLM


class _Three(nn.Module):
    """Three top-level operators (mul, add, sum), and a scalar read when `read` is set."""

    def __init__(self, read: bool) -> None:
        super().__init__()
        self.read = read

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (x * 2 + 1).sum()
        if self.read:
            y.item()
        return x


def test_counts_the_operators_and_scalar_reads_of_each_layer_call() -> None:
    layers = nn.ModuleList([_Three(read=False), _Three(read=True)])
    model = SimpleNamespace(model=SimpleNamespace(layers=layers))
    x = torch.ones(4)

    def run() -> None:
        for layer in layers:
            layer(x)

    counts = count_layers(model, run, torch.device("cpu"))  # type: ignore[arg-type]
    assert counts[0] == {"ops": 3, "cuda_kernels": 0, "host_reads": 0}
    assert counts[1] == {"ops": 4, "cuda_kernels": 0, "host_reads": 1}  # .item() is an operator too


def test_groups_every_layer_of_a_v41_model_by_its_role() -> None:
    model = DeepseekV41ForCausalLM(get_preset_v41("v41-tiny")).eval()
    view = allocate_view(ModelSpec.from_config(model.config), 1, 64)
    ids = torch.randint(0, model.config.vocab_size, (1, 64))
    with torch.inference_mode():
        counts = count_layers(model, lambda: model(ids, view, logits_rows="last"), torch.device("cpu"))
    roles = by_role(model, counts)
    layers = sorted(i for r in roles.values() for i in r["layers"])
    assert layers == list(range(model.config.num_hidden_layers))
    assert set(roles) == {model.config.layer_role(i) for i in layers}
    assert all(c["ops"] > 50 for c in counts.values())
