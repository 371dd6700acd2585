"""One pipeline stage of a V4.1 model: its layers, the extended payload in and out, the shadow
indexers, and the shared state of each micro-batch.

A stage's forward takes the payload its boundary defines (:class:`~replaykv.train.pipeline.plan.Boundary`)
as a flat tuple of tensors and returns the next boundary's payload (the last stage returns the
logits and the token ids, for the loss). Per micro-batch it allocates a cache view, fills in the
groups whose sources are upstream (the received entries and index keys, or both rebuilt from
received latents, the keys through its shadow indexers), runs its layers under
:class:`~replaykv.train.paths.CacheGuard`, and captures the latents its own sources pool where a
later stage needs them.

The indexer KL of the stage's index layers (:class:`~replaykv.train.distill.IndexerDistillation`)
is not part of the pipeline's loss, which only the last stage computes: it is attached to the
stage's first floating output by :class:`AuxLoss`, whose backward feeds it a gradient of
`scale` when the output's gradient arrives, so each stage's KL contributes exactly as in a
single-process step.

:class:`SharedStateTrace` tags every tensor of a micro-batch's shared state (cache view,
rebuilt entries and keys, selections, captured latents) and counts the bytes still alive after
each forward and backward: a micro-batch's count must fall to zero once its backward has run.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from replaykv.cache.views import allocate_view
from replaykv.model.attention_v41 import AttentionV41, IndexerV41, publish_groups
from replaykv.model.cache_view import CacheView
from replaykv.model.compressor import scatter_entries
from replaykv.model.config_v41 import DeepseekV41Config
from replaykv.model.layers import RMSNorm
from replaykv.model.spec import ModelSpec
from replaykv.model.step import Residual, Selection
from replaykv.model.v41 import DecoderLayerV41, DeepseekV41ForCausalLM
from replaykv.train.context import ContextShards
from replaykv.train.distill import IndexerDistillation
from replaykv.train.paths import CacheGuard
from replaykv.train.pipeline.plan import Boundary, StagePlan
from replaykv.train.setup import RouterBalance


def attention(model: DeepseekV41ForCausalLM, layer: int) -> AttentionV41:
    """Layer `layer`'s attention block (the layer must be on this stage)."""
    block = model.model.layers[layer]
    if not isinstance(block, DecoderLayerV41):
        raise KeyError(f"layer {layer} is not held by this stage")
    return block.self_attn


def key_parameters(indexer: IndexerV41 | ShadowIndexer) -> list[torch.Tensor]:
    """The parameters of an index source's key side (what shadow indexers replicate)."""
    assert indexer.k_proj is not None and indexer.k_norm is not None
    return [indexer.k_proj.weight, indexer.k_norm.weight]


class AuxLoss(torch.autograd.Function):
    """y = x in forward; in backward, `aux` receives gradient `scale` beside x's gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_shape = aux.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=grad.dtype, device=grad.device), None


class ShadowIndexer(nn.Module):
    """A replica of a KV source indexer's key side (`k_proj`, `k_norm`): enough to rebuild the
    group's index keys from its latents on a stage that does not hold the source."""

    def __init__(self, source: IndexerV41) -> None:
        super().__init__()
        assert source.k_proj is not None and source.k_norm is not None
        self.quant = source.quant
        self.k_proj = type(source.k_proj)(source.k_proj.weight.shape[1], source.k_proj.weight.shape[0])
        self.k_norm = RMSNorm(source.k_norm.weight.shape[0], source.k_norm.eps)
        self.load_state_dict({"k_proj.weight": source.k_proj.weight, "k_norm.weight": source.k_norm.weight})

    def keys(self, latents: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # Same function as the source's (IndexerV41.keys reads only k_proj, k_norm and quant).
        # Latents are detached as under indexer distillation: the keys feed only the discrete
        # top-k and the KL, which trains the indexer and never the compressor.
        return IndexerV41.keys(self, latents.detach(), cos, sin)  # type: ignore[arg-type]


class SharedStateTrace:
    """Bytes of each micro-batch's shared state still alive (weak references: a tensor counts
    until the last reference to it goes, whoever holds it: the stage, autograd's saved tensors,
    the schedule's caches)."""

    def __init__(self) -> None:
        self._alive: dict[int, dict[int, int]] = {}  # micro-batch -> {storage key: bytes}
        self.events: list[dict[str, Any]] = []

    def track(self, micro: int, tensors: list[torch.Tensor]) -> None:
        alive = self._alive.setdefault(micro, {})
        for t in tensors:
            storage = t.untyped_storage()  # one Python object per storage, kept while it lives
            key = id(storage)
            if key in alive or storage.nbytes() == 0:
                continue
            alive[key] = storage.nbytes()
            weakref.finalize(storage, _forget, alive, key)

    def alive_bytes(self, micro: int) -> int:
        return sum(self._alive.get(micro, {}).values())

    def record(self, event: str, micro: int) -> None:
        self.events.append(
            {
                "event": event,
                "micro_batch": micro,
                "bytes": {m: self.alive_bytes(m) for m in sorted(self._alive)},
            }
        )


def _forget(alive: dict[int, int], key: int) -> None:
    alive.pop(key, None)


class StageModule(nn.Module):
    """Stage `stage` of `plan` holding only its own parameters of `model` (others are dropped),
    plus shadow indexers. Parameter names stay the full model's (`model.layers.7...`)."""

    def __init__(
        self,
        model: DeepseekV41ForCausalLM,
        plan: StagePlan,
        stage: int,
        indexer_rows: int = 0,
        indexer_scale: float = 0.0,
        shards: ContextShards | None = None,
    ) -> None:
        super().__init__()
        self.plan, self.stage = plan, stage
        self.shards = shards  # context parallelism: this process's shard of every sequence
        self.layer_range = plan.layers(stage)
        self.received: Boundary | None = plan.received(stage)
        self.sent: Boundary | None = plan.sent(stage)
        self.is_first, self.is_last = stage == 0, stage == plan.stages - 1
        self.spec = ModelSpec.from_config(model.config)
        self.shadows = nn.ModuleDict(
            {str(s): ShadowIndexer(indexer_of(model, s)) for s in plan.shadows(stage)}
        )
        # Keep only this stage's parameters: other layers become empty placeholders so that
        # the names (and the model's split forward) stay those of the full model.
        for i in range(model.config.num_hidden_layers):
            if i not in self.layer_range:
                model.model.layers[i] = nn.Identity()
        if not self.is_first:
            model.model.embed_tokens = None  # type: ignore[assignment]
        if not self.is_last:
            model.model.norm = None  # type: ignore[assignment]
            model.lm_head = None  # type: ignore[assignment]
        self.model = model
        self.distill = IndexerDistillation(model, indexer_rows) if indexer_rows > 0 else None
        self.indexer_scale = indexer_scale
        self.trace = SharedStateTrace()
        self.balance: RouterBalance | None = None  # the run's expert balancing, paused in dry runs
        self.micro = -1  # the micro-batch being run (set by the schedule's stage; -1: none)
        self.last_sent: dict[str, int] | None = None  # bytes per field of the last payload sent
        self._captured: dict[int, torch.Tensor] = {}
        self._wrap_sources()

    # ------------------------------------------------------------------ set-up
    def _wrap_sources(self) -> None:
        """Capture the latents this stage's KV sources pool, for the payload."""
        wanted = set(self.sent.latents) if self.sent is not None else set()
        for s in wanted & set(self.layer_range):
            comp = attention(self.model, s).compressor
            assert comp is not None
            pool = comp.pool

            def capture(self_: Any, *args: Any, _pool: Callable[..., Any] = pool, _s: int = s) -> Any:
                latents, first, count = _pool(*args)
                if len(set(first)) != 1 or len(set(count)) != 1:
                    raise NotImplementedError(
                        "pipeline-parallel training runs rows of one length from one position; "
                        f"source {_s} pooled groups {first} + {count}"
                    )
                self._captured[_s] = latents
                return latents, first, count

            comp.pool = types.MethodType(capture, comp)  # type: ignore[method-assign]

    def owned_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This stage's own parameters (shadows excluded), with the full model's names."""
        return [(n, p) for n, p in self.model.named_parameters()]

    # ------------------------------------------------------------------ forward
    def forward(self, *payload: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.micro < 0:
            # The schedule's shape-inference pass (once per schedule, on uninitialised buffers;
            # its backward computes input gradients only): no router counts, nothing traced.
            if self.balance is not None:
                self.balance.paused = True
            try:
                return self._forward(payload, -1)
            finally:
                if self.balance is not None:
                    self.balance.paused = False
        return self._forward(payload, self.micro)

    def _forward(self, payload: tuple[torch.Tensor, ...], micro: int) -> tuple[torch.Tensor, ...]:
        group: dict[str, dict[int, torch.Tensor]] = {"entries": {}, "keys": {}, "latents": {}}
        if self.is_first:
            (ids,) = payload
            state, selection = self.model.embed(ids), Selection()
        else:
            assert self.received is not None
            index = self.shards.index if self.shards is not None else 0
            state, selection, group = unpack(self.received, payload, self.model.config, index)
            if micro < 0:
                # The dry run reads uninitialised buffers: attend with no selection (arbitrary
                # ids need not be causal for a query block). Floats stay as they are: their
                # values do not matter, and their gradients' shapes must reach the inputs.
                selection = Selection(
                    *(
                        None if t is None else torch.full_like(t, -1)
                        for t in (selection.topk, selection.candidates)
                    )
                )
        b, length = state.input_ids.shape
        dtype = next(self.model.parameters()).dtype
        shards = self.shards
        start = shards.index * length if shards is not None else 0  # this shard's first position
        total = shards.size * length if shards is not None else length
        view = allocate_view(self.spec, b, total, state.streams.device, dtype)
        view.positions.fill_(start)
        guard = CacheGuard()
        guard.track(view)
        step = self.model.step(view, length)
        step.context = shards
        c = self.model.config
        self._captured = {}
        with guard:
            for kind, name in (("entries", "entries"), ("keys", "index_keys")):
                for s, t in group[kind].items():
                    lo = start // c.compress_ratio(s)
                    scatter_entries(_cache(view, s, name), t, [lo] * b, [t.shape[1]] * b)
                    if shards is not None:  # the other shards' groups
                        shards.share(view.layers[s], c.compress_ratio(s), step, (name,))
            for s, t in group["latents"].items():
                self._rebuild(s, t, step, view)
            out = self.model.run_layers(state, self.layer_range, step, view, selection)
        shared = _view_tensors(view) + [t for t in (selection.topk, selection.candidates) if t is not None]
        shared += list(self._captured.values())
        if self.is_last:
            outputs: tuple[torch.Tensor, ...] = (self.model.head(out), out.input_ids)
        else:
            assert self.sent is not None
            # A group travels as this shard's part (all of it without context parallelism): the
            # entries of positions [start, start + length), split as the sequence is.
            span = {
                s: slice(start // c.compress_ratio(s), (start + length) // c.compress_ratio(s))
                for s in c.kv_sources
            }
            sent = {
                "entries": {s: _cache(view, s, "entries")[:, span[s]] for s in self.sent.entries},
                "keys": {s: _cache(view, s, "index_keys")[:, span[s]] for s in self.sent.keys},
                "latents": {**group["latents"], **self._captured},
            }
            outputs = pack(self.sent, out, selection, sent)
            self.last_sent = payload_bytes(outputs, self.sent.fields())
        received = {id(t.untyped_storage()) for t in payload}  # the schedule's receive buffers
        if micro >= 0:
            self.trace.track(micro, [t for t in shared if id(t.untyped_storage()) not in received])
        self._captured = {}
        if self.distill is not None:
            kl = self.distill.pop()
            if kl is not None:
                outputs = (AuxLoss.apply(outputs[0], kl, self.indexer_scale), *outputs[1:])
        if micro >= 0:
            self.trace.record("forward", micro)
        return outputs

    def _rebuild(self, source: int, latents: torch.Tensor, step: Any, view: CacheView) -> None:
        """An upstream group from its latents (compact payload): its FP4 entries, and its index
        keys when this stage holds a shadow of the source's indexer."""
        b, n = latents.shape[0], latents.shape[1]
        shadow = dict(self.shadows.items()).get(str(source))
        keys = shadow.keys if isinstance(shadow, ShadowIndexer) else None
        c = self.model.config
        ratio = c.compress_ratio(source)
        first = step.start_host[0] // ratio
        publish_groups(latents, [first] * b, [n] * b, ratio, c.kv_quant, keys, step, view.layers[source])
        if self.shards is not None:  # the other shards' groups
            names = ("entries", "index_keys") if keys is not None else ("entries",)
            self.shards.share(view.layers[source], ratio, step, names)


def indexer_of(model: DeepseekV41ForCausalLM, layer: int) -> IndexerV41:
    idx = attention(model, layer).indexer
    if idx is None:
        raise KeyError(f"layer {layer} has no indexer")
    return idx


def _cache(view: CacheView, source: int, name: str) -> torch.Tensor:
    """A group's `entries` or `index_keys` tensor in the view."""
    t = getattr(view.layers[source], name)
    assert t is not None
    return t


def _view_tensors(view: CacheView) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for lc in view.layers:
        out += [t for t in (lc.window, lc.entries, lc.index_keys) if t is not None]
        if lc.carry is not None:
            out += [lc.carry.kv, lc.carry.gate]
    return out


def pack(
    boundary: Boundary, state: Residual, selection: Selection, groups: dict[str, dict[int, torch.Tensor]]
) -> tuple[torch.Tensor, ...]:
    """The payload of `boundary` as a flat tuple in :meth:`Boundary.fields` order; `groups`
    maps "entries", "keys" and "latents" to the tensors of each source."""
    out: list[torch.Tensor] = [state.streams, state.pre_mix, state.input_ids.contiguous()]
    if boundary.topk:
        if selection.topk is None:
            raise RuntimeError(f"boundary {boundary.index}: no selection to send")
        out.append(selection.topk)
    if boundary.candidates:
        if selection.candidates is None:
            raise RuntimeError(f"boundary {boundary.index}: no candidate blocks to send")
        out.append(selection.candidates)
    for kind in ("entries", "keys", "latents"):
        for s in getattr(boundary, kind):
            if s not in groups[kind]:
                raise RuntimeError(f"boundary {boundary.index}: the {kind} of source {s} are missing")
            out.append(groups[kind][s].contiguous())  # a shard's part is a slice of the group
    return tuple(out)


def unpack(
    boundary: Boundary, payload: tuple[torch.Tensor, ...], config: DeepseekV41Config, shard: int = 0
) -> tuple[Residual, Selection, dict[str, dict[int, torch.Tensor]]]:
    """The inverse of :func:`pack` (`shard`: which sequence shard the payload holds under
    context parallelism; its selections index every entry before its end). Ids are clamped into
    their ranges: a no-op on what the previous stage sent, and it keeps the schedule's
    shape-inference pass (uninitialised buffers) from indexing out of bounds."""
    fields = boundary.fields()
    if len(payload) != len(fields):
        raise ValueError(
            f"boundary {boundary.index} expects {len(fields)} tensors ({fields}), got {len(payload)}"
        )
    named = dict(zip(fields, payload, strict=True))
    ids = named["input_ids"].clamp(0, config.vocab_size - 1)
    state = Residual(named["streams"], named["pre_mix"], ids)
    length = ids.shape[1] * (shard + 1)  # the end of the payload's positions
    topk, cands = named.get("topk"), named.get("candidates")
    if topk is not None:  # entry ids of the latest index source's group
        owner = max(i for i in config.index_sources if i < boundary.layer)
        topk = topk.clamp(-1, length // config.compress_ratio(owner) - 1)
    if cands is not None:  # block ids of the candidate source's group
        n = length // config.compress_ratio(config.candidate_source)
        cands = cands.clamp(-1, -(-n // config.candidate_block_size) - 1)
    groups = {
        kind: {s: named[f"{kind}.{s}"] for s in getattr(boundary, kind)}
        for kind in ("entries", "keys", "latents")
    }
    return state, Selection(topk, cands), groups


def payload_bytes(payload: tuple[torch.Tensor, ...], fields: tuple[str, ...]) -> dict[str, int]:
    """Bytes per payload field (what one micro-batch sends over one boundary)."""
    return {f: t.numel() * t.element_size() for f, t in zip(fields, payload, strict=True)}
