"""Prefix keys: the names under which global-KV chunks and SWA snapshots are stored.

For: turning (everything that changes the cached bytes, tenant salt, token ids) into
32-byte SHA-256 keys that are identical across processes, machines and Python versions
(no ``hash()``, no pickling), and hex helpers for file and Redis names.

Not for: deciding what is cached or where (``cache/manager.py``), or storing anything.

Encoding (version 1, all integers little-endian, every variable-length item framed by
its length so no two inputs share an encoding):

* ``frame(b)``          = ``u64 len(b) || b``
* namespace seed        = ``SHA-256(frame(b"replaykv.keys.v1") || for each field in
  declaration order: frame(field name) || frame(typed value))``, where a ``str`` is its
  UTF-8 bytes (``surrogatepass``), an ``int`` is ``i64``, a tuple is ``u64 count`` followed
  by its framed items, and the tenant salt is its bytes (a ``str`` salt is first encoded as
  UTF-8, so ``"acme"`` and ``b"acme"`` name the same tenant).
* token ids             = ``int64`` little-endian (``numpy '<i8'``), 8 bytes per token;
  ids must be in ``[0, 2**63)``.
* chunk key ``k_i``     = ``SHA-256(b"RKV-CHUNK\\x00" || k_{i-1} || frame(tokens of chunk i))``
  with ``k_{-1}`` = the namespace seed; one key per COMPLETE chunk.
* prefix key (any n)    = ``SHA-256(b"RKV-PREFIX" || k_last || frame(tokens after the last
  complete chunk))``; the tag differs from the chunk tag, so a prefix key never equals a
  chunk key, even when n is a multiple of the chunk size (the tail is then empty).

Both tags are 10 bytes and the parent is always 32 bytes, so the layout is unambiguous.

Images. Every position of an image span carries the same token id, so token ids alone would let
one image's cached state serve a prompt with another image in the same place. A chunk (or the
tail of a prefix key) that any image span overlaps is therefore hashed under its own tag, with
the images appended: ``SHA-256(b"RKV-CHUNKI" || parent || frame(tokens) || u64 count || for each
overlapping image in order: i64 span start - chunk start || u64 span length || digest)`` (tail:
tag ``b"RKV-PREFXI"``, start relative to the tail's first position). The digest is the image's
content digest (:attr:`replaykv.images.PreparedImage.digest`, 32 bytes). Text-only chunks keep
their keys, so stores written before images existed stay valid.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import TypeAlias

import numpy as np

__all__ = [
    "KEY_BYTES",
    "TOKEN_DTYPE",
    "ImageKeyPart",
    "KeyNamespace",
    "PrefixKeyBuilder",
    "TokenIds",
    "chunk_keys",
    "key_from_hex",
    "key_hex",
    "next_chunk_key",
    "prefix_key",
    "prefix_key_from_parent",
    "token_array",
]

KEY_BYTES = 32
"""Every key is a raw SHA-256 digest of this many bytes."""

TOKEN_DTYPE = np.dtype("<i8")
"""Token ids are hashed as little-endian int64 (8 bytes per token)."""

TokenIds: TypeAlias = Sequence[int] | np.ndarray
"""Token ids: a list/tuple of ints, or a 1-D integer numpy array (CPU torch tensors convert too)."""

_DOMAIN = b"replaykv.keys.v1"
_CHUNK_TAG = b"RKV-CHUNK\x00"
_PREFIX_TAG = b"RKV-PREFIX"
_IMAGE_CHUNK_TAG = b"RKV-CHUNKI"
_IMAGE_PREFIX_TAG = b"RKV-PREFXI"
assert len(_CHUNK_TAG) == len(_PREFIX_TAG) == len(_IMAGE_CHUNK_TAG) == len(_IMAGE_PREFIX_TAG) == 10

ImageKeyPart: TypeAlias = tuple[int, int, bytes]
"""An image in a token sequence, as keys see it: (span start, span length, 32-byte content digest)."""
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")


def _frame(data: bytes) -> bytes:
    return _U64.pack(len(data)) + data


def _encode_str(value: str) -> bytes:
    return value.encode("utf-8", "surrogatepass")


def _encode_field(name: str, value: object) -> bytes:
    if isinstance(value, bool):
        raise TypeError(f"KeyNamespace.{name}: bool is not a valid field value")
    if isinstance(value, str):
        body = _encode_str(value)
    elif isinstance(value, int):
        body = _I64.pack(value)
    elif isinstance(value, bytes):
        body = value
    elif isinstance(value, tuple):
        body = _U64.pack(len(value)) + b"".join(_frame(_encode_field(name, item)) for item in value)
    else:
        raise TypeError(f"KeyNamespace.{name}: cannot encode {type(value).__name__}")
    return body


@dataclass(frozen=True)
class KeyNamespace:
    """Everything that changes the bytes of a cached entry, plus the tenant salt.

    Two requests share cache entries only if every field is equal. ``tenant_salt`` is set by
    the server from the API key (never by the client); any bytes or str is accepted (empty,
    megabytes long, ``"../"``, NUL bytes): it is only ever hashed, never used as a name.

    Fields:
        model_config_hash: digest of the model's config (architecture, sizes, schedule).
        weights_digest: digest or revision of the weights (a fine-tune changes every entry).
        kv_layout_version: version of the byte layouts of compressed KV / index keys / window entries.
        kv_dtypes: dtypes of the cached items, e.g. ``("fp4_e2m1", "ue8m0", "fp8_e4m3")``.
        compress_ratios: per-layer compression schedule, e.g. ``(0, 0, 2, 1, ...)``.
        chunk_size: tokens per global-KV chunk (256 by default in the engine).
        tenant_salt: isolation domain; ``str`` is encoded as UTF-8.
    """

    model_config_hash: str
    weights_digest: str
    kv_layout_version: int
    kv_dtypes: tuple[str, ...]
    compress_ratios: tuple[int, ...]
    chunk_size: int
    tenant_salt: bytes | str = field(repr=False)

    def __post_init__(self) -> None:
        # Accept lists for convenience; store tuples so the namespace stays hashable.
        for name in ("kv_dtypes", "compress_ratios"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
            elif not isinstance(value, tuple):
                raise TypeError(f"KeyNamespace.{name} must be a tuple, got {type(value).__name__}")
        for name in ("model_config_hash", "weights_digest"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(
                    f"KeyNamespace.{name} must be a non-empty str (e.g. the SHA-256 hex of the config or "
                    f"of the weights index); got {value!r}"
                )
        if not all(isinstance(d, str) and d for d in self.kv_dtypes) or not self.kv_dtypes:
            raise ValueError(f"KeyNamespace.kv_dtypes must be non-empty dtype names; got {self.kv_dtypes!r}")
        if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in self.compress_ratios):
            raise ValueError(
                f"KeyNamespace.compress_ratios must be ints >= 0 (0 = window-only layer); got {self.compress_ratios!r}"
            )
        if isinstance(self.kv_layout_version, bool) or not isinstance(self.kv_layout_version, int):
            raise TypeError("KeyNamespace.kv_layout_version must be an int")
        if self.kv_layout_version < 0:
            raise ValueError(f"KeyNamespace.kv_layout_version must be >= 0; got {self.kv_layout_version}")
        if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size <= 0:
            raise ValueError(
                f"KeyNamespace.chunk_size must be a positive int (e.g. 256); got {self.chunk_size!r}"
            )
        if not isinstance(self.tenant_salt, (bytes, str)):
            raise TypeError(
                f"KeyNamespace.tenant_salt must be bytes or str; got {type(self.tenant_salt).__name__}"
            )

    @property
    def salt_bytes(self) -> bytes:
        salt = self.tenant_salt
        return _encode_str(salt) if isinstance(salt, str) else bytes(salt)

    @cached_property
    def _seed(self) -> bytes:
        h = hashlib.sha256(_frame(_DOMAIN))
        for f in fields(self):
            value: object = self.salt_bytes if f.name == "tenant_salt" else getattr(self, f.name)
            h.update(_frame(_encode_str(f.name)))
            h.update(_frame(_encode_field(f.name, value)))
        return h.digest()

    def seed(self) -> bytes:
        """The 32-byte SHA-256 root of every key in this namespace (parent of chunk 0)."""
        return self._seed

    def seed_hex(self) -> str:
        return self._seed.hex()


def token_array(tokens: TokenIds) -> np.ndarray:
    """``tokens`` as the contiguous little-endian int64 array that keys hash (validated).

    Raises ``ValueError``/``TypeError`` unless ``tokens`` is a 1-D sequence of integer ids in
    ``[0, 2**63)``. Callers that hash the same ids several times convert once with this.
    """
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be a 1-D sequence of token ids; got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=TOKEN_DTYPE)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"token ids must be integers; got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and int(arr.max()) > np.iinfo(np.int64).max:
        raise ValueError("token ids must be < 2**63")
    if arr.dtype.kind == "i" and int(arr.min()) < 0:
        raise ValueError(f"token ids must be >= 0; got {int(arr.min())}")
    return np.ascontiguousarray(arr, dtype=TOKEN_DTYPE)


_as_token_array = token_array  # the former private name


def _check_parent(parent: bytes) -> None:
    if not isinstance(parent, bytes) or len(parent) != KEY_BYTES:
        raise ValueError(f"a parent key must be {KEY_BYTES} bytes")


def _chunk_digest(parent: bytes, token_bytes: bytes, images: bytes = b"") -> bytes:
    if images:
        return hashlib.sha256(_IMAGE_CHUNK_TAG + parent + _frame(token_bytes) + images).digest()
    return hashlib.sha256(_CHUNK_TAG + parent + _frame(token_bytes)).digest()


def _check_images(images: Sequence[ImageKeyPart], n_tokens: int) -> tuple[ImageKeyPart, ...]:
    """Images sorted by start, checked: 32-byte digests, positive lengths, inside the sequence
    (a prefix may end inside a span: spans are cut at the end), no overlaps."""
    out = tuple(sorted((int(s), int(n), bytes(d)) for s, n, d in images))
    end = 0
    for start, length, digest in out:
        if len(digest) != KEY_BYTES:
            raise ValueError(f"an image digest must be {KEY_BYTES} bytes; got {len(digest)}")
        if length <= 0 or start < end:
            raise ValueError(f"image spans must be non-empty and must not overlap; got one at {start}")
        end = start + length
    return out


def _image_bytes(images: tuple[ImageKeyPart, ...], a: int, b: int) -> bytes:
    """The image part of the hash of positions [a, b): every span overlapping them (empty if none)."""
    hits = [(s, n, d) for s, n, d in images if s < b and s + n > a] if a < b else []
    if not hits:
        return b""
    return _U64.pack(len(hits)) + b"".join(_I64.pack(s - a) + _U64.pack(n) + d for s, n, d in hits)


def next_chunk_key(parent: bytes, chunk_tokens: TokenIds) -> bytes:
    """Key of one chunk given its parent (the previous chunk key, or ``namespace.seed()``).

    The caller guarantees the chunk is complete; for a possibly partial tail use :func:`prefix_key`.
    """
    _check_parent(parent)
    return _chunk_digest(parent, token_array(chunk_tokens).tobytes())


def _resolve_chunk_size(namespace: KeyNamespace, chunk_size: int | None) -> int:
    if chunk_size is None:
        return namespace.chunk_size
    if chunk_size != namespace.chunk_size:
        raise ValueError(
            f"chunk_size {chunk_size} differs from the namespace's chunk_size {namespace.chunk_size}; "
            "the chunk size is part of the key, so build a namespace with the size you want"
        )
    return chunk_size


def chunk_keys(namespace: KeyNamespace, tokens: TokenIds, chunk_size: int | None = None) -> list[bytes]:
    """One 32-byte key per COMPLETE chunk of ``tokens``; key i covers ``tokens[: (i + 1) * chunk_size]``.

    ``chunk_size`` defaults to (and must equal) ``namespace.chunk_size``. A trailing partial
    chunk gets no key here (see :func:`prefix_key`).
    """
    size = _resolve_chunk_size(namespace, chunk_size)
    arr = token_array(tokens)
    keys: list[bytes] = []
    parent = namespace.seed()
    for start in range(0, (arr.size // size) * size, size):
        parent = _chunk_digest(parent, arr[start : start + size].tobytes())
        keys.append(parent)
    return keys


def prefix_key(namespace: KeyNamespace, tokens: TokenIds) -> bytes:
    """Key of the exact prefix ``tokens`` (any length, including 0 and chunk multiples).

    Chains the complete chunks as :func:`chunk_keys` does, then hashes the framed partial tail
    under a distinct tag. Used for SWA snapshots taken at turn boundaries.
    """
    arr = token_array(tokens)
    size = namespace.chunk_size
    complete = chunk_keys(namespace, arr[: (arr.size // size) * size])
    parent = complete[-1] if complete else namespace.seed()
    return _prefix_digest(parent, arr[len(complete) * size :].tobytes())


def _prefix_digest(parent: bytes, tail_bytes: bytes, images: bytes = b"") -> bytes:
    if images:
        return hashlib.sha256(_IMAGE_PREFIX_TAG + parent + _frame(tail_bytes) + images).digest()
    return hashlib.sha256(_PREFIX_TAG + parent + _frame(tail_bytes)).digest()


def prefix_key_from_parent(parent: bytes, tail_tokens: TokenIds) -> bytes:
    """:func:`prefix_key` from the key of the last complete chunk and the tokens after it.

    ``parent`` is ``chunk_keys(namespace, tokens)[-1]`` (or ``namespace.seed()`` when ``tokens``
    holds no complete chunk) and ``tail_tokens`` the ids after the last complete chunk (empty at a
    chunk boundary). Lets a caller that already holds the chunk keys derive prefix keys at many
    positions without re-hashing the chunks; the caller guarantees ``tail_tokens`` is shorter than
    a chunk (a longer tail gives a key no other call produces, never a wrong hit).
    """
    _check_parent(parent)
    return _prefix_digest(parent, token_array(tail_tokens).tobytes())


class PrefixKeyBuilder:
    """Chunk and prefix keys of one token sequence under one namespace, each chunk hashed once.

    ``chunk_keys(n)`` equals ``chunk_keys(namespace, tokens[:n])`` and ``prefix_key(n)`` equals
    ``prefix_key(namespace, tokens[:n])``, for any ``0 <= n <= len(tokens)``; the tokens are
    validated once and chunk keys are computed on first need and kept. For callers that probe
    prefix keys at many positions of one request (the cache manager's lookup and write-back).
    Not thread-safe: one builder per request.
    """

    def __init__(
        self, namespace: KeyNamespace, tokens: TokenIds, images: Sequence[ImageKeyPart] = ()
    ) -> None:
        self.namespace = namespace
        self.tokens = token_array(tokens)
        self.chunk_size = namespace.chunk_size
        self.images = _check_images(images, self.tokens.size)
        self._keys: list[bytes] = []

    def _extend(self, n: int) -> int:
        if not 0 <= n <= self.tokens.size:
            raise ValueError(f"n must be in [0, {self.tokens.size}]; got {n}")
        size = self.chunk_size
        want = n // size
        parent = self._keys[-1] if self._keys else self.namespace.seed()
        for i in range(len(self._keys), want):
            a, b = i * size, (i + 1) * size
            parent = _chunk_digest(parent, self.tokens[a:b].tobytes(), _image_bytes(self.images, a, b))
            self._keys.append(parent)
        return want

    def chunk_keys(self, n: int | None = None) -> list[bytes]:
        """Keys of the complete chunks in ``tokens[:n]`` (default: all tokens)."""
        return self._keys[: self._extend(self.tokens.size if n is None else n)]

    def prefix_key(self, n: int) -> bytes:
        """Key of the exact prefix ``tokens[:n]``."""
        count = self._extend(n)
        parent = self._keys[count - 1] if count else self.namespace.seed()
        a = count * self.chunk_size
        return _prefix_digest(parent, self.tokens[a:n].tobytes(), _image_bytes(self.images, a, n))


def key_hex(key: bytes) -> str:
    """Lower-case hex of a 32-byte key (64 characters); used for file names and Redis keys."""
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"a key must be {KEY_BYTES} bytes; got {key!r:.80}")
    return key.hex()


def key_from_hex(text: str) -> bytes:
    """Inverse of :func:`key_hex`; raises ``ValueError`` unless ``text`` is 64 hex characters."""
    if len(text) != 2 * KEY_BYTES:
        raise ValueError(f"a key in hex has {2 * KEY_BYTES} characters; got {len(text)}")
    try:
        return bytes.fromhex(text)
    except ValueError as exc:
        raise ValueError(f"not a hex key: {text!r}") from exc
