"""The stage plan of a pipeline-parallel V4.1 run: which layers each stage runs, what crosses each
boundary, and who owns every shared component.

CSA2 breaks the premise that pipeline stages exchange hidden states only: a KV source's
compressed entries and index keys are read by every later layer of its group, and an index
source's top-k selection (and the candidate source's blocks) by the layers after it. When a
source and a reader sit on different stages, three mechanisms carry the state across:

* **Extended payload.** Besides the residual (mHC streams, the lagged pre-mix, the token ids),
  a boundary carries the state of every group whose source is before it and whose readers are
  at or after it, the current top-k selection when a layer after the boundary attends with it,
  and the candidate blocks when an index layer after the boundary filters with them. Selections
  are integer ids and carry no gradient. A stage between a source and its readers forwards what
  it received. A group's state travels in one of two forms (`payload`):
  - `exact` (default): the group's FP4 entries as the source wrote them and, where an index
    layer after the boundary scores them, its index keys, both carrying their readers'
    gradients back. Every gradient sums the same terms in the same order as one process does,
    so a pipeline step equals a single-process step bit for bit.
  - `compact`: the pre-RoPE latents alone (with gradient). The stage after the boundary rebuilds
    the entries (RoPE and the FP4 rounding, no parameters) and, with a shadow indexer, the
    index keys. Fewer bytes, the same computation, equal to float32 rounding but not bit for
    bit: the entries' gradient reaches the latents in one sum per side of the boundary, and a
    shared key projection's gradient adds the owner's and the replicas' parts in another order.
* **Shadow indexers** (compact payload). A stage holding a Reindex layer of a group whose source
  is on an earlier stage needs the group's index keys. It rebuilds them from the latents with a
  replica of the source indexer's key projection (`k_proj`, `k_norm`: a few thousand
  parameters) instead of receiving them. The source's stage owns the parameters: it optimises
  them and writes them to checkpoints; the replicas' gradients are summed with the owner's, and
  the owner's values are copied to the replicas after each step.
* **Shared state per micro-batch.** Everything rebuilt from the payload lives in the
  micro-batch's own cache view and is released when its backward has run (see
  :mod:`replaykv.train.pipeline.stage`).

Stage boundaries can fall anywhere: between a source and its Reuse layers, between an index
source and a Reindex layer, inside the encoder and the decoder. Not for: running the stages
(:mod:`replaykv.train.pipeline.stage`, :mod:`replaykv.train.pipeline.run`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from replaykv.model.config_v41 import DeepseekV41Config

RESIDUAL_FIELDS = ("streams", "pre_mix", "input_ids")


PAYLOADS = ("exact", "compact")


@dataclass(frozen=True)
class Boundary:
    """What crosses from stage `index` to stage `index + 1` (entering layer `layer`).

    `entries` / `keys`: KV sources whose group entries / index keys travel (exact payload);
    `latents`: KV sources whose pre-RoPE latents travel (compact payload); `topk` /
    `candidates`: whether the selection and the candidate blocks travel. All float fields
    carry gradients back."""

    index: int
    layer: int
    entries: tuple[int, ...]
    keys: tuple[int, ...]
    latents: tuple[int, ...]
    topk: bool
    candidates: bool

    def fields(self) -> tuple[str, ...]:
        """Payload fields in wire order."""
        out = list(RESIDUAL_FIELDS)
        if self.topk:
            out.append("topk")
        if self.candidates:
            out.append("candidates")
        out += [f"entries.{s}" for s in self.entries]
        out += [f"keys.{s}" for s in self.keys]
        out += [f"latents.{s}" for s in self.latents]
        return tuple(out)


@dataclass(frozen=True)
class StagePlan:
    """Stages of layers [starts[i], starts[i + 1]) of one V4.1 config."""

    config: DeepseekV41Config
    starts: tuple[int, ...]
    payload: str = "exact"

    @classmethod
    def build(
        cls,
        config: DeepseekV41Config,
        stages: int,
        boundaries: tuple[int, ...] | None = None,
        payload: str = "exact",
    ) -> StagePlan:
        """Split the layers into `stages` stages: at `boundaries` (the first layer of stages 1..P-1)
        when given, else as evenly as the layer count allows (earlier stages take the extra one).
        `payload`: the form groups travel in (exact or compact, see the module docstring)."""
        if payload not in PAYLOADS:
            raise ValueError(f"payload must be one of {PAYLOADS}, got {payload!r}")
        n = config.num_hidden_layers
        if stages < 1:
            raise ValueError(f"pipeline stages must be at least 1, got {stages}")
        if stages > n:
            raise ValueError(f"{stages} pipeline stages for {n} layers: a stage needs at least one layer")
        if boundaries is None:
            base, extra = divmod(n, stages)
            sizes = [base + (1 if i < extra else 0) for i in range(stages)]
            starts = [sum(sizes[:i]) for i in range(stages)]
        else:
            if len(boundaries) != stages - 1:
                raise ValueError(
                    f"{stages} stages need {stages - 1} boundaries (first layer of stages 1..{stages - 1}), "
                    f"got {len(boundaries)}: {list(boundaries)}"
                )
            starts = [0, *boundaries]
            if any(b <= a for a, b in itertools.pairwise(starts)) or starts[-1] >= n:
                raise ValueError(
                    f"boundaries must increase strictly within layers 1..{n - 1}, got {list(boundaries)}"
                )
        return cls(config, tuple(starts), payload)

    # ------------------------------------------------------------------ layout
    @property
    def stages(self) -> int:
        return len(self.starts)

    def layers(self, stage: int) -> range:
        end = self.starts[stage + 1] if stage + 1 < self.stages else self.config.num_hidden_layers
        return range(self.starts[stage], end)

    def stage_of(self, layer: int) -> int:
        return max(i for i, s in enumerate(self.starts) if s <= layer)

    def boundary(self, index: int) -> Boundary:
        """The payload from stage `index` to `index + 1`."""
        c = self.config
        b = self.starts[index + 1]
        after = range(b, c.num_hidden_layers)
        groups = tuple(s for s in c.kv_sources if s < b and any(c.kv_source_of(j) == s for j in after))
        topk = any((owner := c.selection_owner(j)) is not None and owner < b for j in after)
        cand = c.candidate_source
        candidates = c.candidate_enabled and cand < b and any(c.has_indexer(j) and j > cand for j in after)
        if self.payload == "compact":
            return Boundary(index, b, (), (), groups, topk, candidates)
        scored = tuple(s for s in groups if any(c.kv_source_of(j) == s and c.has_indexer(j) for j in after))
        return Boundary(index, b, groups, scored, (), topk, candidates)

    def received(self, stage: int) -> Boundary | None:
        return self.boundary(stage - 1) if stage > 0 else None

    def sent(self, stage: int) -> Boundary | None:
        return self.boundary(stage) if stage + 1 < self.stages else None

    def shadows(self, stage: int) -> tuple[int, ...]:
        """KV sources on earlier stages whose index keys this stage rebuilds (it holds one of
        their Reindex layers): the shadow indexers it carries (compact payload only)."""
        c = self.config
        if self.payload != "compact":
            return ()
        first = self.starts[stage]
        return tuple(
            s
            for s in c.kv_sources
            if s < first
            and c.has_indexer(s)
            and any(c.kv_source_of(j) == s and c.has_indexer(j) for j in self.layers(stage))
        )

    def replicas(self, source: int) -> tuple[int, ...]:
        """Stages holding a shadow of `source`'s key projection (its owner excluded)."""
        return tuple(i for i in range(self.stages) if source in self.shadows(i))

    def owner(self, name: str) -> int:
        """The stage that owns a parameter of the model's state dict (internal names)."""
        if name.startswith("model.embed_tokens."):
            return 0
        if name.startswith(("model.norm.", "lm_head.")):
            return self.stages - 1
        parts = name.split(".")
        if parts[:2] == ["model", "layers"]:
            return self.stage_of(int(parts[2]))
        raise KeyError(f"no stage owns parameter {name!r}")

    # ------------------------------------------------------------------ report
    def describe(self) -> str:
        """The plan as text (`replaykv train --print-plan`)."""
        c = self.config
        lines = [
            f"pipeline plan: {self.stages} stage{'s' if self.stages != 1 else ''} over "
            f"{c.num_hidden_layers} layers, {self.payload} payload"
        ]
        for i in range(self.stages):
            lay = self.layers(i)
            roles = ", ".join(f"{j} {c.layer_role(j)}" for j in lay)
            extra = []
            if i == 0:
                extra.append("embedding")
            if i == self.stages - 1:
                extra.append("final norm + lm_head")
            lines.append(
                f"stage {i}: layers {lay.start}-{lay.stop - 1} ({roles})"
                + (f"; {', '.join(extra)}" if extra else "")
            )
            owned = [s for s in c.kv_sources if s in lay]
            for s in owned:
                reps = self.replicas(s)
                lines.append(
                    f"  owns KV source {s} (compressor, indexer keys)"
                    + (f"; shadow indexers on stages {list(reps)}" if reps else "")
                )
            for s in self.shadows(i):
                lines.append(
                    f"  shadow indexer of source {s} (k_proj, k_norm; owner stage {self.stage_of(s)})"
                )
            sent = self.sent(i)
            if sent is not None:
                lines.append(f"  sends to stage {i + 1}: {', '.join(sent.fields())}")
        return "\n".join(lines)
