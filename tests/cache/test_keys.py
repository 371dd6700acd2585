"""Prefix keys: determinism across processes, unambiguous framing, hostile salts, completeness."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from replaykv.cache.keys import (
    KEY_BYTES,
    KeyNamespace,
    PrefixKeyBuilder,
    chunk_keys,
    key_from_hex,
    key_hex,
    next_chunk_key,
    prefix_key,
)
from tests.cache.conftest import make_namespace

REPO = Path(__file__).resolve().parents[2]

# Pinned: changing the encoding silently would orphan every stored entry.
GOLDEN_SEED = "128374970bf85824063015c3f2242a71e2717a22d707f7dcedfbb975427de2a2"
GOLDEN_CHUNK_1 = "dbfecae1383294baa460baa4c7ad9af1066ecff21837a7cfc9ecc1d52b2c1bd5"
GOLDEN_PREFIX_40 = "4b4b9d523a4552dcd5a739e5bcfe5e729d2411b5841c6be1db70310c914e19e5"


def _reference_keys(ns: KeyNamespace, tokens: list[int]) -> tuple[bytes, list[bytes], bytes]:
    """The encoding written out from the keys.py docstring, independently of its code."""

    def frame(b: bytes) -> bytes:
        return struct.pack("<Q", len(b)) + b

    def enc(v: object) -> bytes:
        if isinstance(v, str):
            return v.encode("utf-8", "surrogatepass")
        if isinstance(v, int):
            return struct.pack("<q", v)
        if isinstance(v, bytes):
            return v
        assert isinstance(v, tuple)
        return struct.pack("<Q", len(v)) + b"".join(frame(enc(x)) for x in v)

    salt = (
        ns.tenant_salt.encode("utf-8", "surrogatepass") if isinstance(ns.tenant_salt, str) else ns.tenant_salt
    )
    values = [
        ("model_config_hash", ns.model_config_hash),
        ("weights_digest", ns.weights_digest),
        ("kv_layout_version", ns.kv_layout_version),
        ("kv_dtypes", ns.kv_dtypes),
        ("compress_ratios", ns.compress_ratios),
        ("chunk_size", ns.chunk_size),
        ("tenant_salt", salt),
    ]
    seed = hashlib.sha256(
        frame(b"replaykv.keys.v1") + b"".join(frame(n.encode()) + frame(enc(v)) for n, v in values)
    ).digest()
    c = ns.chunk_size
    keys, parent = [], seed
    for i in range(len(tokens) // c):
        body = b"".join(struct.pack("<q", t) for t in tokens[i * c : (i + 1) * c])
        parent = hashlib.sha256(b"RKV-CHUNK\x00" + parent + frame(body)).digest()
        keys.append(parent)
    tail = b"".join(struct.pack("<q", t) for t in tokens[len(keys) * c :])
    return seed, keys, hashlib.sha256(b"RKV-PREFIX" + parent + frame(tail)).digest()


def test_matches_independent_reference_and_golden_values() -> None:
    ns = make_namespace("golden")
    tokens = list(range(40))
    seed, keys, pkey = _reference_keys(ns, tokens)
    assert ns.seed() == seed
    assert chunk_keys(ns, tokens) == keys
    assert prefix_key(ns, tokens) == pkey
    assert ns.seed_hex() == GOLDEN_SEED
    assert keys[-1].hex() == GOLDEN_CHUNK_1
    assert pkey.hex() == GOLDEN_PREFIX_40
    for salt in ("", b"\x00\xff", "../x", "é"):
        other = make_namespace(salt)
        ref = _reference_keys(other, tokens[:33])
        assert (other.seed(), chunk_keys(other, tokens[:33]), prefix_key(other, tokens[:33])) == ref


def test_prefix_key_builder_equals_the_functions_at_every_position_in_any_order() -> None:
    ns = make_namespace("builder")  # chunk size 16
    tokens = [(i * 7919) % 50_000 for i in range(70)]
    rng = np.random.default_rng(0)
    order = [int(n) for n in rng.permutation(len(tokens) + 1)]  # probe out of order: cached chunks reused
    builder = PrefixKeyBuilder(ns, tokens)
    for n in order:
        _, ref_chunks, ref_prefix = _reference_keys(ns, tokens[:n])
        assert builder.prefix_key(n) == prefix_key(ns, tokens[:n]) == ref_prefix, n
        assert builder.chunk_keys(n) == chunk_keys(ns, tokens[:n]) == ref_chunks, n
    assert builder.chunk_keys() == chunk_keys(ns, tokens) and len(builder.chunk_keys()) == 4
    assert PrefixKeyBuilder(make_namespace("other"), tokens).prefix_key(40) != builder.prefix_key(40)
    for bad in (-1, len(tokens) + 1):
        with pytest.raises(ValueError, match="n must be in"):
            builder.prefix_key(bad)


_CHILD = """
import json, sys
from tests.cache.conftest import make_namespace
from replaykv.cache.keys import chunk_keys, prefix_key
ns = make_namespace(sys.argv[1])
toks = list(range(1000, 1050))
print(json.dumps({"seed": ns.seed_hex(), "chunks": [k.hex() for k in chunk_keys(ns, toks)],
                  "prefix": prefix_key(ns, toks[:37]).hex()}))
"""


@pytest.mark.parametrize("hash_seed", ["0", "12345"])
def test_keys_identical_across_processes(hash_seed: str) -> None:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=str(REPO))
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, "tenant-x"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    child = json.loads(out.stdout)
    ns = make_namespace("tenant-x")
    toks = list(range(1000, 1050))
    assert child == {
        "seed": ns.seed_hex(),
        "chunks": [k.hex() for k in chunk_keys(ns, toks)],
        "prefix": prefix_key(ns, toks[:37]).hex(),
    }


def test_salt_concatenation_does_not_collide() -> None:
    # ("org_1", "2345") vs ("org_12345", ""): string salts and token-derived strings.
    assert make_namespace("org_1").seed() != make_namespace("org_12345").seed()
    a = prefix_key(make_namespace("org_1"), [2, 3, 4, 5])
    b = prefix_key(make_namespace("org_12345"), [])
    assert a != b
    # Field-boundary shifts.
    pairs = [
        (dict(model_config_hash="ab", weights_digest="c"), dict(model_config_hash="a", weights_digest="bc")),
        (dict(kv_dtypes=("a", "b")), dict(kv_dtypes=("ab",))),
        (dict(compress_ratios=(1, 23)), dict(compress_ratios=(12, 3))),
        (dict(compress_ratios=(0,)), dict(compress_ratios=(0, 0))),
    ]
    for left, right in pairs:
        assert make_namespace("s", **left).seed() != make_namespace("s", **right).seed()


def test_token_framing_is_unambiguous() -> None:
    ns = make_namespace(chunk_size=4)
    assert prefix_key(ns, []) != prefix_key(ns, [0])
    assert prefix_key(ns, [1, 0]) != prefix_key(ns, [256])
    assert prefix_key(ns, [1, 2]) != prefix_key(ns, [1, 2, 0])
    # A prefix ending on a chunk boundary is not the chunk's key.
    assert prefix_key(ns, [1, 2, 3, 4]) != chunk_keys(ns, [1, 2, 3, 4])[0]
    assert prefix_key(ns, [1, 2, 3, 4]) != prefix_key(ns, [1, 2, 3])


@pytest.mark.parametrize(
    "salt",
    [
        "",
        b"",
        "x" * (1 << 20),
        b"\x00" * 4096,
        "../../etc/passwd",
        "a\x00b",
        "\udcff",
        "🔑",
        b"\xff\xfe",
        "{tag}*?",
    ],
)
def test_hostile_salts(salt: bytes | str) -> None:
    ns = make_namespace(salt)
    seed = ns.seed()
    assert len(seed) == KEY_BYTES
    keys = chunk_keys(ns, list(range(64)))
    assert all(len(k) == KEY_BYTES for k in keys)
    assert seed != make_namespace("tenant-a").seed()
    assert key_hex(keys[0]).isalnum()  # names on disk and in Redis never contain the salt
    assert "tenant_salt" not in repr(ns)  # the salt never lands in logs


def test_salts_are_distinct_and_str_equals_utf8_bytes() -> None:
    salts: list[bytes | str] = [
        "",
        "a",
        "a\x00",
        "a\x00b",
        "\x00",
        b"\x00\x00",
        "org_1",
        "org_12345",
        "x" * 1000,
    ]
    seeds = {make_namespace(s).seed() for s in salts}
    assert len(seeds) == len(salts)
    assert make_namespace("acme").seed() == make_namespace(b"acme").seed()


def test_every_field_changes_the_seed() -> None:
    base = make_namespace("t")
    changes = dict(
        model_config_hash="cfg-other",
        weights_digest="weights-1",
        kv_layout_version=2,
        kv_dtypes=("fp8_e4m3",),
        compress_ratios=(0, 2, 2, 2, 0),
        chunk_size=32,
        tenant_salt="u",
    )
    assert {f.name for f in dataclasses.fields(KeyNamespace)} == set(changes)
    for name, value in changes.items():
        other = dataclasses.replace(base, **{name: value})
        assert other.seed() != base.seed(), name
        assert chunk_keys(other, list(range(64)))[0] != chunk_keys(base, list(range(64)))[0]


def test_chunk_chain_properties() -> None:
    ns = make_namespace(chunk_size=8)
    toks = list(range(100, 131))
    keys = chunk_keys(ns, toks)
    assert len(keys) == 3  # 31 tokens → 3 complete chunks, the tail gets no chunk key
    assert chunk_keys(ns, toks[:16]) == keys[:2]
    assert next_chunk_key(keys[1], toks[16:24]) == keys[2]
    assert next_chunk_key(ns.seed(), toks[:8]) == keys[0]
    changed = [*toks[:3], 7, *toks[4:]]
    assert all(
        a != b for a, b in zip(chunk_keys(ns, changed), keys, strict=True)
    )  # the chain carries the change
    assert len(set(keys)) == 3
    assert chunk_keys(ns, toks, 8) == keys
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_keys(ns, toks, 16)


def test_token_containers_agree() -> None:
    import torch

    ns = make_namespace(chunk_size=4)
    toks = [5, 129_279, 0, 3, 9, 9, 1]
    expected = prefix_key(ns, toks)
    for container in (tuple(toks), np.array(toks, np.int32), np.array(toks, np.uint64), torch.tensor(toks)):
        assert prefix_key(ns, container) == expected
        assert chunk_keys(ns, container) == chunk_keys(ns, toks)


def test_invalid_inputs_are_rejected() -> None:
    ns = make_namespace()
    with pytest.raises(ValueError):
        prefix_key(ns, [1, -1])
    with pytest.raises(TypeError):
        prefix_key(ns, [1.5, 2.0])
    with pytest.raises(ValueError):
        prefix_key(ns, np.zeros((2, 2), np.int64))
    with pytest.raises(ValueError):
        next_chunk_key(b"short", [1])
    with pytest.raises(ValueError, match="chunk_size"):
        make_namespace(chunk_size=0)
    with pytest.raises(ValueError, match="weights_digest"):
        make_namespace(weights_digest="")
    with pytest.raises(ValueError, match="compress_ratios"):
        make_namespace(compress_ratios=(2, -1))
    with pytest.raises(TypeError, match="tenant_salt"):
        make_namespace(salt=123)  # type: ignore[arg-type]


def test_hex_helpers() -> None:
    key = chunk_keys(make_namespace(), list(range(16)))[0]
    assert key_from_hex(key_hex(key)) == key
    assert len(key_hex(key)) == 64
    for bad in ("", "zz" * 32, "ab" * 31):
        with pytest.raises(ValueError):
            key_from_hex(bad)
    with pytest.raises(ValueError):
        key_hex(b"x")


def test_namespace_is_hashable_and_lists_become_tuples() -> None:
    ns = make_namespace(kv_dtypes=["fp8"], compress_ratios=[0, 2])
    assert ns.kv_dtypes == ("fp8",) and ns.compress_ratios == (0, 2)
    assert hash(ns) == hash(make_namespace(kv_dtypes=("fp8",), compress_ratios=(0, 2)))
