"""Training data that needs no download: the Python standard library as a byte corpus, mixed with
the generated tasks of :mod:`replaykv.train.tasks`.

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

All rows of a batch share the prompt length P and, in replay-adaptation steps, the cut point, so
the replay paths can run them as one batch. Not for: running the model (see
:mod:`replaykv.train.paths`).
"""

from __future__ import annotations

import ast
import hashlib
import itertools
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from replaykv.train.recipes import Recipe
from replaykv.train.tasks import TASKS, TOKENIZER, TaskSample, generate, link_code

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


# ---------------------------------------------------------------------------- copy rows
COPY_ALPHABET = np.frombuffer(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789", dtype=np.uint8)


def copy_row(
    rng: np.random.Generator, corpus: Corpus, length: int, window: int, prose: bool = False
) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int, int]]]:
    """A corpus window with random strings, each written twice: ids [length], a copy mask
    [length] (True on a repeat's bytes after its first, the only predictable ones) and the
    (first, repeat, size) of each string.

    About one string of 6-32 bytes (upper case and digits) per 64 bytes; half of the repeats
    follow within the `window`, the others anywhere later in the row. A first occurrence and a
    repeat's first byte are random: the sampler gives them no loss."""
    ids = corpus.window(rng, length, prose)
    used = np.zeros(length, dtype=bool)
    copy = np.zeros(length, dtype=bool)
    pairs: list[tuple[int, int, int]] = []
    for _ in range(max(1, length // 64)):
        for _attempt in range(8):
            size = int(rng.integers(6, 33))
            room = length - 2 * size
            if room < 0:
                break
            near = rng.uniform() < 0.5
            gap = int(rng.integers(0, min(window, room) + 1)) if near else int(rng.integers(0, room + 1))
            first = int(rng.integers(0, room - gap + 1))
            repeat = first + size + gap
            if (
                used[max(0, first - 1) : first + size + 1].any()
                or used[max(0, repeat - 1) : repeat + size + 1].any()
            ):
                continue
            text = COPY_ALPHABET[rng.integers(0, len(COPY_ALPHABET), size)]
            ids[first : first + size] = text
            ids[repeat : repeat + size] = text
            used[first : first + size] = used[repeat : repeat + size] = True
            copy[repeat + 1 : repeat + size] = True
            pairs.append((first, repeat, size))
            break
    return ids, copy, sorted(pairs)


def lookup_row(
    rng: np.random.Generator, corpus: Corpus, length: int, prose: bool = False, segment: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[Evidence]]:
    """Link records and questions about them in a corpus window: ids [length], an answer mask
    [length] (True on each answer's bytes), a mask of every inserted byte and, for each question
    about one link in the row's order, the row that predicts its answer's first byte with the
    span `A -> B` of the record it needs (the rest need records found through others; see
    `Evidence`).

    The first 40-60% of the row holds the records `A -> B` of one chain of 2-4 codes (four upper
    case letters or digits) per 256 bytes, in random order and places; the rest holds up to two
    different questions per chain in the multi-hop task's words, `Follow h links from A: Z`, each
    about links that all made it into the row. Answering is a lookup by a key drawn for this row:
    what the multi-hop and chain tasks need and a pass key's fixed phrase does not teach, here a
    dozen times a row instead of once.

    With `segment` > 0 the row is cut into segments of that many bytes, one chain each: its
    records in the segment's first 40%, its questions in its last 40%, so a question sits at most
    `segment` bytes after the records it needs (a distance the caller sets against the window)."""
    ids = corpus.window(rng, length, prose)
    answer = np.zeros(length, dtype=bool)
    used = np.zeros(length, dtype=bool)
    split = 0 if segment else int(length * rng.uniform(0.4, 0.6))

    def put(text: bytes, lo: int, hi: int) -> int | None:
        for _ in range(16):
            if hi - lo < len(text):
                return None
            at = int(rng.integers(lo, hi - len(text) + 1))
            if not used[max(0, at - 1) : at + len(text) + 1].any():
                ids[at : at + len(text)] = np.frombuffer(text, dtype=np.uint8)
                used[at : at + len(text)] = True
                return at
        return None

    codes: set[str] = set()
    chains = [
        [link_code(rng, codes) for _ in range(int(rng.integers(2, 5)))]
        for _ in range(max(1, length // (segment or 256)))
    ]

    def records_span(c: int) -> tuple[int, int]:
        return (c * segment, c * segment + segment * 2 // 5) if segment else (0, split)

    def questions_span(c: int) -> tuple[int, int]:
        return (c * segment + segment * 3 // 5, (c + 1) * segment) if segment else (split, length)

    links = [(c, a, b) for c, chain in enumerate(chains) for a, b in itertools.pairwise(chain)]
    placed: dict[tuple[str, str], int] = {}
    span = {(a, b): len(f"{a} -> {b}") for _, a, b in links}
    for c, a, b in (links[i] for i in rng.permutation(len(links))):
        at = put(f"\n{a} -> {b}\n".encode(), *records_span(c))
        if at is not None:
            placed[(a, b)] = at + 1  # the record's first byte, after its newline
    records = tuple(sorted((at, at + span[link]) for link, at in placed.items()))
    evidence: list[Evidence] = []
    for c, chain in enumerate(chains):
        pairs = [(i, h) for i in range(len(chain) - 1) for h in range(1, len(chain) - i)]
        for k in rng.permutation(len(pairs))[:2]:  # two different questions (a repeat is a copy)
            i, h = pairs[k]
            if not all(link in placed for link in itertools.pairwise(chain[i : i + h + 1])):
                continue
            question = f"\nFollow {h} links from {chain[i]}: "
            at = put(f"{question}{chain[i + h]}\n".encode(), *questions_span(c))
            if at is not None:
                answer[at + len(question) : at + len(question) + len(chain[i + h])] = True
                if h == 1:
                    link = (chain[i], chain[i + 1])
                    first = placed[link]
                    evidence.append(Evidence(at + len(question) - 1, first, first + span[link], records))
    return ids, answer, used, sorted(evidence, key=lambda e: e.query)


def recall_row(
    rng: np.random.Generator, corpus: Corpus, length: int, prose: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Blocks of four link records and two questions about them, each block inside one window:
    ids [length], an answer mask [length] (True on each answer's bytes) and a mask of every
    inserted byte.

    A block holds one chain of three codes (two links) and two unrelated links, in random
    order, then, in random order, `Follow 2 links from` the chain's first code and `Follow 1
    links from` one of the four records' first codes, each with its answer (the multi-hop task's
    words). Blocks are 120 bytes with 0-47 bytes of corpus text between them, so every question
    sits less than 128 bytes after the records it needs: the match by a drawn code and the
    composition of two links with the window's full-resolution keys, four answers a window,
    before the same is asked across the compressed entries."""
    ids = corpus.window(rng, length, prose)
    answer = np.zeros(length, dtype=bool)
    used = np.zeros(length, dtype=bool)
    codes: set[str] = set()
    at = int(rng.integers(0, 48))
    while True:
        chain = [link_code(rng, codes) for _ in range(3)]
        links = [(chain[0], chain[1]), (chain[1], chain[2])]
        links += [(link_code(rng, codes), link_code(rng, codes)) for _ in range(2)]
        records = "".join(f"\n{links[i][0]} -> {links[i][1]}\n" for i in rng.permutation(4))
        one = links[int(rng.integers(0, 4))]
        asked = [(2, chain[0], chain[2]), (1, one[0], one[1])]
        block = records.encode()
        spans: list[tuple[int, int]] = []
        for i in rng.permutation(2):
            hops, start, end = asked[i]
            question = f"\nFollow {hops} links from {start}: ".encode()
            spans.append((len(block) + len(question), len(block) + len(question) + len(end)))
            block += question + f"{end}\n".encode()
        if at + len(block) > length:
            return ids, answer, used
        ids[at : at + len(block)] = np.frombuffer(block, dtype=np.uint8)
        used[at : at + len(block)] = True
        for lo, hi in spans:
            answer[at + lo : at + hi] = True
        at += len(block) + int(rng.integers(0, 48))


def repeat_row(rng: np.random.Generator, length: int) -> tuple[np.ndarray, int]:
    """One random string of 10-40 bytes (upper case and digits) written again and again to fill
    `length`: ids [length] and the string's size. Every byte after the first repeat's first is a
    copy of the byte one period back, inside the window: the densest copy target there is, for
    the phase that forms the copying circuit before anything else (see `Recipe` `small`)."""
    size = int(rng.integers(10, 41))
    text = COPY_ALPHABET[rng.integers(0, len(COPY_ALPHABET), size)]
    return np.resize(text, length).astype(np.int64), size


# ---------------------------------------------------------------------------- the mixture
@dataclass(frozen=True)
class Evidence:
    """Where an answer's evidence is: the row `query` that predicts the answer's first byte and
    the positions [lo, hi) of the text it needs (a lookup's record `A -> B`), for the
    evidence-attention loss (:mod:`replaykv.train.evidence`); `records`: the [lo, hi) of every
    record of the row (the needed one among them), the rivals of its contrastive form."""

    query: int
    lo: int
    hi: int
    records: tuple[tuple[int, int], ...] = ()


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
        for row in range(phase.batch):
            kind = str(rng.choice(names, p=probs))
            sample = None
            if kind in TASKS:
                controls = {}
                if cut and rng.uniform() < phase.paths.boundary_prob and cut - w > 0:
                    controls["evidence_end"] = cut - w
                sample = generate(kind, rng, self.corpus, prompt_len, **controls)
                if sample is None or prompt_len + len(sample.answer) + 1 > length:
                    sample, kind = None, "text"
            kinds.append(kind)
            samples.append(sample)
            prose = bool(rng.uniform() < phase.mixture.prose_fraction)
            if kind == "repeat":
                ids[row], size = repeat_row(rng, length)
                targets[row, size + 1 :] = phase.copy_weight
                continue
            if kind == "copy":
                ids[row], mask, pairs = copy_row(rng, self.corpus, length, w, prose)
                targets[row, 1:] = 1.0
                for first, repeat, size in pairs:
                    targets[row, first : first + size] = 0.0
                    targets[row, repeat] = 0.0
                targets[row, mask] = phase.copy_weight
                continue
            if kind == "recall":
                ids[row], answers, inserted = recall_row(rng, self.corpus, length, prose)
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
            if kind == "multihop" and kind in phase.evidence_rows:  # the answer's record, its rivals
                records = sample.meta["records"]
                lo, hi = next(r for r in records if sample.evidence[0] < r[0] < sample.evidence[1])
                evidence[row] = (Evidence(len(sample.prompt) - 1, lo, hi, records),)
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
