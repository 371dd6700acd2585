"""The structured-output tasks: extraction of one sentence's fields as JSON, and a tool-call loop
whose results point from key to key (chance of a blind guess about 0 for both).

Not for: the lookup tasks or scoring (see :mod:`replaykv.train.tasks`).
"""

from __future__ import annotations

import json

import numpy as np

from replaykv.train.prompts import (
    TOKENIZER,
    Filler,
    TaskSample,
    answer_ids,
    ids_of,
    link_code,
    one_insert_prompt,
    special,
)


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


_FIRST = _words(
    "Ada Boris Chen Dara Emil Farah Goran Hana Ivo Jana Kofi Lena Mateo Nia Omar Pia Quinn Rosa Sami Tomas Una Vera Wim Xenia Yusuf Zora"
)
_LAST = _words(
    "Abe Brandt Costa Diallo Eriksen Fontaine Garcia Haddad Ito Jensen Kowalski Lindqvist Moreau Novak Okafor Petrov Quispe Rossi Sato Tanaka Ueda Varga Weber Young Zhou"
)
_CITIES = _words(
    "Accra Bergen Cusco Dakar Essen Fez Graz Hanoi Izmir Jaipur Kyoto Lagos Lima Lyon Malmo Nagoya Oslo Porto Quito Riga Sofia Turin Utrecht Vigo Warsaw Zagreb"
)
_JOBS = _words(
    "baker pilot nurse carpenter chemist librarian plumber teacher welder architect farmer editor geologist jeweler mechanic surveyor tailor translator"
)
_TEMPLATES = (
    "{name} was born in {year} in {city} and works as a {job}.",
    "Born in {city} in {year}, {name} now works as a {job}.",
    "{name}, a {job} from {city}, was born in {year}.",
)


def extract(
    rng: np.random.Generator,
    filler: Filler,
    prompt_len: int,
    depth: float | None = None,
    evidence_end: int | None = None,
) -> TaskSample | None:
    """One sentence about a person in prose filler -> {"name", "year", "city", "job"} as JSON."""
    rec = {
        "name": f"{rng.choice(_FIRST)} {rng.choice(_LAST)}",
        "year": int(rng.integers(1940, 2006)),
        "city": str(rng.choice(_CITIES)),
        "job": str(rng.choice(_JOBS)),
    }
    sentence = str(rng.choice(_TEMPLATES)).format(**rec)
    insert = f"\n{sentence}\n".encode()
    intro, question = b"Read the text.\n", "\nGive name, year, city and job as JSON."
    built = one_insert_prompt(rng, filler, prompt_len, intro, question, insert, depth, evidence_end)
    if built is None:
        return None
    ids, ev, _, _ = built
    text = json.dumps(rec, separators=(", ", ": "))
    return TaskSample("extract", tuple(ids), answer_ids(text), text, ev, 0.0)


def tool(
    rng: np.random.Generator,
    filler: Filler,
    prompt_len: int,
    rounds: int | None = None,
    depth: float | None = None,
    evidence_end: int | None = None,
) -> TaskSample | None:
    """A tool-call loop: lookup results either point to another key or hold the value.

    Each round is an assistant tool call (carrying loss) and a tool result padded with other
    entries to a random length; the final answer copies the value from the last result.
    `depth` / `evidence_end` are accepted for a uniform interface but the entry's place inside
    the last result is random.
    """
    del depth, evidence_end
    if rounds is None:
        rounds = int(rng.integers(1, 4))
        while rounds > 1 and prompt_len < 90 * rounds + 80:  # about what a round needs
            rounds -= 1
    used: set[str] = set()
    keys = [link_code(rng, used).lower() for _ in range(rounds)]
    value = str(int(rng.integers(1000, 10000)))
    system = 'Tools: lookup(key) returns JSON. Call it as {"tool": "lookup", "key": K}.'
    ids = [TOKENIZER.bos_id, special("system"), *ids_of(system), special("end")]
    ids += [special("user"), *ids_of(f"What is the value of {keys[0]}?"), special("end")]
    calls = [f'{{"tool": "lookup", "key": "{k}"}}' for k in keys]
    targets = [f'"see {keys[i + 1]}"' if i + 1 < rounds else value for i in range(rounds)]
    fixed = len(ids) + 1  # + the final <|assistant|>
    for c, t in zip(calls, targets, strict=True):
        fixed += (
            2 + len(c) + 2 + len(f'{{"{keys[0]}": {t}}}')
        )  # <|assistant|> c <|end|> <|tool|> {..} <|end|>
    room = prompt_len - fixed
    if room < 0:
        return None
    split = np.sort(rng.integers(0, room + 1, rounds - 1)) if rounds > 1 else np.zeros(0, dtype=int)
    extra = np.diff(np.concatenate([[0], split, [room]])).astype(int)
    spans: list[tuple[int, int]] = []
    evidence = (0, 0)
    for i in range(rounds):
        a0 = len(ids) + 1
        ids += [special("assistant"), *ids_of(calls[i]), special("end")]
        spans.append((a0, len(ids)))
        entry = f'"{keys[i]}": {targets[i]}'
        result, at = _padded_result(rng, used, entry, int(extra[i]))
        ids += [special("tool")]
        if i == rounds - 1:
            evidence = (len(ids) + at, len(ids) + at + len(entry))
        ids += [*ids_of(result), special("end")]
    ids.append(special("assistant"))
    if len(ids) != prompt_len:
        return None
    return TaskSample(
        "tool",
        tuple(ids),
        answer_ids(value),
        value,
        evidence,
        0.0,
        train_spans=tuple(spans),
        meta={"rounds": rounds},
    )


def _padded_result(rng: np.random.Generator, used: set[str], entry: str, extra: int) -> tuple[str, int]:
    """A JSON object holding `entry` among other entries, exactly len(entry) + 2 + extra bytes long.

    Returns the text and the offset of `entry` inside it."""
    others: list[str] = []
    size = len(entry) + 2
    while True:
        e = f'"{link_code(rng, used).lower()}": {int(rng.integers(1000, 10000))}'
        if size + len(e) + 2 > len(entry) + 2 + extra:
            break
        others.append(e)
        size += len(e) + 2
    at = int(rng.integers(0, len(others) + 1))
    parts = [*others[:at], entry, *others[at:]]
    body = "{" + ", ".join(parts)
    text = body + " " * (len(entry) + 2 + extra - len(body) - 1) + "}"
    offset = 1 + sum(len(p) + 2 for p in parts[:at])
    return text, offset
