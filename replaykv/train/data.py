"""Training data that needs no download: the Python standard library as a byte corpus, mixed with
the generated tasks of :mod:`replaykv.train.tasks` and the rows of :mod:`replaykv.train.rows`.

The corpus is every `.py` file under ``sysconfig.get_paths()['stdlib']`` (site-packages left
out, so it depends only on the Python version) as *code*, and their module, class and function
docstrings as *prose*. A file belongs to the held-out split when the hash of its relative path
says so, so the splits are disjoint and stable across machines; documents are shuffled by seed
and joined with <|eos|>. The mixture sampler turns (seed, step) into a fixed-length batch with a
loss mask, so a batch is a pure function of its step (resuming needs no data state):

    text row   [corpus window .................................]  loss everywhere
    task row   [prompt (exactly P tokens) | answer | eos | text ]  loss on answers, tool calls, text
    copy row   [text .. S1 .. S2 .. S1 .. text .. S2 .. text ...]  loss on text and each repeat
    lookup row [text .. A -> B .. B -> C .. | .. from A: C .. ...]  loss on text and each answer
    recall row [A -> B  C -> D .. from A: D .. text .. (blocks)  ]  loss on text and each answer
    program    [x = 1 y = x print(y): y = x = 1 .. text (blocks)]  loss on text and each answer
    recency    [x = 1 y = 2 x = 3 print(x): x = 3 .. text (blocks)]  loss on text and each answer

All rows of a batch share the prompt length P and, in replay-adaptation steps, the cut point, so
the replay paths can run them as one batch. Not for: running the model (see
:mod:`replaykv.train.paths`).
"""

from __future__ import annotations

import ast
import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from replaykv.train.recipes import Recipe
from replaykv.train.rows import (
    COPY_ALPHABETS,
    Evidence,
    copy_row,
    lookup_row,
    program_row,
    recall_row,
    repeat_row,
    traced_recall_row,
)
from replaykv.train.tasks import TASKS, TOKENIZER, TaskSample, generate

SPLITS = ("train", "heldout")
_SPLIT_CODE = {"train": 0, "heldout": 1}
_SEP = 0  # NUL joins documents in the byte arrays; read back as <|eos|> (or a newline in filler)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_files(root: Path, max_files: int | None = None) -> list[str]:
    """Relative paths of the corpus files, sorted; `max_files` keeps an evenly spaced subset."""
    files = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*.py")
        if not ({"site-packages", "dist-packages", "__pycache__"} & set(p.relative_to(root).parts))
    )
    if max_files is not None and max_files < len(files):
        files = [files[i * len(files) // max_files] for i in range(max_files)]
    return files


def split_of(rel_path: str, heldout_percent: int = 5) -> str:
    """'heldout' for about `heldout_percent`% of files, chosen by the hash of the path."""
    h = int(hashlib.sha256(rel_path.encode()).hexdigest()[:8], 16)
    return "heldout" if h % 100 < heldout_percent else "train"


def docstrings(source: bytes) -> bytes:
    """Module, class and function docstrings of one file, blank-line separated (b'' if none)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return b""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                out.append(doc.encode("utf-8", errors="replace"))
    return b"\n\n".join(out)


@dataclass(frozen=True)
class CorpusInfo:
    """What the corpus was: for the model card and to compare runs."""

    python: str
    files: int
    code_bytes: int
    prose_bytes: int
    fingerprint: str  # sha256 of the split's paths and file contents, in order


class Corpus:
    """One split's bytes: `code` and `prose` (uint8 arrays, documents joined by NUL)."""

    def __init__(self, split: str, code: np.ndarray, prose: np.ndarray, info: CorpusInfo) -> None:
        if len(code) == 0 or len(prose) == 0:
            raise ValueError(f"the {split} split is empty; use more files (max_files) or another root")
        self.split, self.code, self.prose, self.info = split, code, prose, info

    def window(self, rng: np.random.Generator, n: int, prose: bool = False) -> np.ndarray:
        """n token ids (int64) from a random offset; document boundaries read as <|eos|>."""
        raw = self._bytes(rng, n, prose).astype(np.int64)
        raw[raw == _SEP] = TOKENIZER.eos_id
        return raw

    def filler(self, rng: np.random.Generator, n: int, prose: bool = True) -> bytes:
        """n bytes of haystack text (document boundaries read as a newline)."""
        raw = self._bytes(rng, n, prose).copy()
        raw[raw == _SEP] = ord("\n")
        return raw.tobytes()

    def _bytes(self, rng: np.random.Generator, n: int, prose: bool) -> np.ndarray:
        arr = self.prose if prose else self.code
        if n <= 0:
            return arr[:0]
        if len(arr) < n:
            arr = np.tile(arr, n // len(arr) + 1)
        start = int(rng.integers(0, len(arr) - n + 1))
        return arr[start : start + n]


_LOADED: dict[tuple[str, int | None, int, int, tuple[str, ...]], dict[str, Corpus]] = {}


def load_corpus(
    root: str | Path | None = None,
    max_files: int | None = None,
    seed: int = 0,
    heldout_percent: int = 5,
    splits: tuple[str, ...] = SPLITS,
    cached: bool = True,
) -> dict[str, Corpus]:
    """The splits of the corpus under `root` (default: this Python's standard library), documents
    shuffled with `seed` (every recipe uses the default, so held-out cases are the same for all).
    A split's contents do not depend on which other splits are loaded.

    With `cached`, the process reads a given (root, max_files, seed, heldout_percent, splits)
    once and hands out the same read-only arrays afterwards (reading the standard library takes
    seconds; a Corpus's arrays cannot be written to); `cached=False` reads the files again."""
    base = Path(root) if root is not None else stdlib_root()
    key = (str(base.resolve()), max_files, seed, heldout_percent, tuple(splits))
    if not cached or key not in _LOADED:
        _LOADED[key] = _read_corpus(base, max_files, seed, heldout_percent, splits)
    return dict(_LOADED[key])


def _read_corpus(
    base: Path, max_files: int | None, seed: int, heldout_percent: int, splits: tuple[str, ...]
) -> dict[str, Corpus]:
    import platform

    parts: dict[str, tuple[list[bytes], list[bytes], hashlib._Hash, list[str]]] = {
        s: ([], [], hashlib.sha256(), []) for s in splits
    }
    for rel in list_files(base, max_files):
        split = split_of(rel, heldout_percent)
        if split not in parts:
            continue
        data = (base / rel).read_bytes().replace(b"\0", b" ")
        code, prose, digest, names = parts[split]
        digest.update(rel.encode() + b"\0" + data)
        names.append(rel)
        code.append(data)
        doc = docstrings(data)
        if doc:
            prose.append(doc.replace(b"\0", b" "))
    out = {}
    for split, (code, prose, digest, names) in parts.items():
        rng = np.random.default_rng([seed, _SPLIT_CODE[split]])
        code_arr = _join([code[i] for i in rng.permutation(len(code))])
        prose_arr = _join([prose[i] for i in rng.permutation(len(prose))])
        info = CorpusInfo(
            platform.python_version(), len(names), len(code_arr), len(prose_arr), digest.hexdigest()
        )
        out[split] = Corpus(split, code_arr, prose_arr, info)
    return out


def _join(docs: list[bytes]) -> np.ndarray:
    return np.frombuffer(bytes([_SEP]).join(docs), dtype=np.uint8) if docs else np.zeros(0, np.uint8)


# ---------------------------------------------------------------------------- the mixture
@dataclass
class Batch:
    """ids [B, L] long; targets [B, L] float32, the loss weight of position t (predicted by row
    t-1; 0: no loss; 1 for text, the phase's `answer_weight` for task answers and train spans,
    its `copy_weight` for copy rows' repeats and repeat rows' copies);
    prompt_len: P, the follow-up boundary shared by every row; cut: the encoder bounded-replay
    cut (0: none); kinds: the row kinds; samples: the task samples (None for text rows)."""

    ids: torch.Tensor
    targets: torch.Tensor
    prompt_len: int
    cut: int
    kinds: tuple[str, ...]
    samples: tuple[TaskSample | None, ...]
    evidence: tuple[tuple[Evidence, ...], ...] = ()  # per row: see `Evidence` (lookup rows)

    @property
    def tokens(self) -> int:
        return int(self.ids.numel())


def task_evidence(sample: TaskSample) -> tuple[Evidence, ...]:
    """A task row's evidence questions (`meta["questions"]`: an offset in the answer and the
    record that gives what starts there): the row that predicts that byte, the record, every
    record of the prompt its rivals. Multi-hop rows ask for the last link's code (every code
    with a traced answer), traced chain rows for each name or value after q, a statement's value
    against every statement's (`meta["values"]`). A traced multi-hop answer's numbers
    (`meta["counts"]`) also ask for the number each is made from, the question's or the one
    written before, against the question's and answer's numbers and codes
    (`meta["count_rivals"]`; not keyed)."""
    records = sample.meta.get("values", sample.meta["records"])
    first = len(sample.prompt) - 1  # predicts the answer's first byte
    keyed = sample.task != "chain"
    found = [Evidence(first + o, lo, hi, records, keyed) for o, (lo, hi) in sample.meta["questions"]]
    rivals = sample.meta.get("count_rivals", ())
    found += [Evidence(first + o, at, at + 1, rivals, False) for o, at in sample.meta.get("counts", ())]
    return tuple(sorted(found, key=lambda e: e.query))


class MixtureSampler:
    """Batches of a recipe's phases from one corpus split; `batch(step)` is deterministic."""

    def __init__(self, corpus: Corpus, recipe: Recipe, window: int, alignment: int = 2) -> None:
        self.corpus, self.recipe = corpus, recipe
        self.window, self.alignment = window, alignment

    def batch(self, step: int) -> Batch:
        phase = self.recipe.phase_at(step)
        rng = np.random.default_rng([self.recipe.seed, _SPLIT_CODE[self.corpus.split], step])
        length, w, a = phase.seq_len, self.window, self.alignment
        p_max = length - self.recipe.answer_budget
        p_min = min(p_max, max(w + 1, int(length * phase.prompt_from)))
        prompt_len = int(rng.integers(p_min, p_max + 1))
        cut = 0
        if phase.paths.bounded_prob and rng.uniform() < phase.paths.bounded_prob and prompt_len > 2 * a:
            cut = int(rng.integers(a, prompt_len - 1)) // a * a
        names = list(phase.mixture.weights)
        probs = np.array([phase.mixture.weights[k] for k in names], dtype=np.float64)
        probs /= probs.sum()
        ids = np.zeros((phase.batch, length), dtype=np.int64)
        targets = np.zeros((phase.batch, length), dtype=np.float32)
        answer_weight = phase.answer_weight
        kinds: list[str] = []
        samples: list[TaskSample | None] = []
        evidence: list[tuple[Evidence, ...]] = [()] * phase.batch
        alphabet = COPY_ALPHABETS[phase.mixture.copy_alphabet]  # copy and repeat rows' strings
        for row in range(phase.batch):
            kind = str(rng.choice(names, p=probs))
            sample = None
            if kind in TASKS:
                traced = {"multihop": phase.mixture.trace_hops, "chain": phase.mixture.trace_chains}
                controls: dict[str, Any] = {"trace": True} if traced.get(kind) else {}
                if cut and rng.uniform() < phase.paths.boundary_prob and cut - w > 0:
                    controls["evidence_end"] = cut - w
                sample = generate(kind, rng, self.corpus, prompt_len, **controls)
                if sample is None or prompt_len + len(sample.answer) + 1 > length:
                    sample, kind = None, "text"
            kinds.append(kind)
            samples.append(sample)
            prose = bool(rng.uniform() < phase.mixture.prose_fraction)
            if kind == "repeat":
                ids[row], size = repeat_row(rng, length, alphabet)
                targets[row, size + 1 :] = phase.copy_weight
                continue
            if kind == "copy":
                ids[row], mask, pairs = copy_row(rng, self.corpus, length, w, prose, alphabet)
                targets[row, 1:] = 1.0
                for first, repeat, size in pairs:
                    targets[row, first : first + size] = 0.0
                    targets[row, repeat] = 0.0
                targets[row, mask] = phase.copy_weight
                continue
            if kind in ("recall", "program", "recency"):
                if kind == "recall":
                    recall = traced_recall_row if phase.mixture.trace_hops else recall_row
                    built = recall(rng, self.corpus, length, prose)
                else:
                    built = program_row(rng, self.corpus, length, prose, recency=kind == "recency")
                ids[row], answers, inserted, found = built
                evidence[row] = tuple(found) if kind in phase.evidence_rows else ()
                targets[row, 1:] = 1.0
                targets[row, inserted] = 0.0
                targets[row, answers] = phase.copy_weight
                continue
            if kind == "lookup":
                ids[row], answers, inserted, found = lookup_row(
                    rng, self.corpus, length, prose, phase.mixture.lookup_segment
                )
                evidence[row] = tuple(found) if "lookup" in phase.evidence_rows else ()
                targets[row, 1:] = 1.0
                targets[row, inserted] = 0.0
                targets[row, answers] = phase.copy_weight
                continue
            if sample is None:
                ids[row] = self.corpus.window(rng, length, prose)
                targets[row, 1:] = 1.0
                continue
            head = [*sample.prompt, *sample.answer, TOKENIZER.eos_id]
            ids[row, : len(head)] = head
            if kind in ("multihop", "chain") and kind in phase.evidence_rows:  # the records, their rivals
                evidence[row] = task_evidence(sample)
            ids[row, len(head) :] = self.corpus.window(rng, length - len(head), prose)
            targets[row, prompt_len : prompt_len + len(sample.answer)] = answer_weight
            for s0, s1 in sample.train_spans:
                targets[row, s0:s1] = answer_weight
            targets[row, len(head) :] = 1.0
        return Batch(
            torch.from_numpy(ids),
            torch.from_numpy(targets),
            prompt_len,
            cut,
            tuple(kinds),
            tuple(samples),
            tuple(evidence),
        )
