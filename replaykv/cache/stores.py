"""Choosing and opening a persistent global-KV store by format name.

For: entry points (engine, ``replaykv store``) that get a directory and maybe a format name:
``pack`` (:class:`~replaykv.cache.pack_store.PackStore`, a file per written batch; the default
for a new directory) or ``file`` (:class:`~replaykv.cache.file_store.DirectoryStore`, a file per
entry). A directory is recognised by its top-level folder (``packs/`` or ``entries/``). Also the
``--store-capacity`` syntax: bytes with units, or a share of the store's file system.
Not for: the stores themselves.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

from replaykv.cache.file_store import DirectoryStore
from replaykv.cache.pack_store import PackStore

__all__ = ["STORE_FORMATS", "capacity_bytes", "detect_format", "make_store", "parse_capacity"]

STORE_FORMATS = ("pack", "file")
_MARKERS = {"pack": "packs", "file": "entries"}


def detect_format(root: str | os.PathLike[str]) -> str | None:
    """``pack`` or ``file`` for a directory holding that store, None for neither (or missing).
    Raises ``ValueError`` for a directory that holds both."""
    found = [fmt for fmt, folder in _MARKERS.items() if (Path(root) / folder).is_dir()]
    if len(found) > 1:
        raise ValueError(f"{root} holds both a pack store (packs/) and a file store (entries/); keep one")
    return found[0] if found else None


def make_store(
    fmt: str | None, root: str | os.PathLike[str], capacity_bytes: int, *, shared: bool = False, **kwargs: Any
) -> PackStore | DirectoryStore:
    """Open (or create) the store at ``root``. ``fmt`` None: the format already there, or ``pack``
    for a new directory (``file`` when ``shared``). A format that differs from the one on disk is
    refused (``ValueError``), so a store is never silently shadowed by an empty one of the other
    kind. ``shared``: other processes write the directory too, which only the ``file`` format
    supports (an entry is one file: published by a rename, found by a ``stat``); a pack holds
    many entries and other processes would see them only by rescanning."""
    if fmt is not None and fmt not in STORE_FORMATS:
        raise ValueError(f"store format must be one of {STORE_FORMATS}; got {fmt!r}")
    on_disk = detect_format(root)
    if fmt is not None and on_disk is not None and fmt != on_disk:
        raise ValueError(
            f"{root} holds a {on_disk!r} store ({_MARKERS[on_disk]}/); open it as {on_disk!r} or use another directory"
        )
    chosen = fmt or on_disk or ("file" if shared else "pack")
    if shared and chosen != "file":
        raise ValueError(
            f"a store shared by several processes uses the 'file' format; {root} would be {chosen!r} "
            "(use --store-format file with a new directory)"
        )
    if chosen == "pack":
        return PackStore(root, capacity_bytes, **kwargs)
    return DirectoryStore(root, capacity_bytes, shared=shared, **kwargs)


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_CAPACITY = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(%|[kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_capacity(text: str) -> int | float:
    """A store capacity: bytes (``123456``, ``500MB`` = 500·10⁶, ``2GiB`` or ``2G`` = 2·2³⁰, up
    to ``T``) as an int, or a share of the file system (``0.5``, ``50%``) as a float in (0, 1].
    Raises ``ValueError`` with the accepted forms."""
    match = _CAPACITY.match(str(text))
    if match is None:
        raise ValueError(f"not a capacity: {text!r} (e.g. 500GB, 2GiB, 123456, or 0.5 / 50% of the disk)")
    number, unit, suffix = float(match[1]), match[2].lower(), (match[3] or "").lower()
    if unit == "%" or (not unit and not suffix and number < 1 and "." in match[1]):
        share = number / 100 if unit == "%" else number
        if not 0 < share <= 1 or suffix:
            raise ValueError(f"a share of the disk must be in (0, 1] or (0%, 100%]; got {text!r}")
        return share
    scale = 1000 ** "kmgt".index(unit) * 1000 if unit and suffix == "b" else _UNITS[unit]
    value = int(number * scale)
    if value <= 0:
        raise ValueError(f"capacity must be > 0 bytes; got {text!r}")
    return value


def capacity_bytes(spec: int | float, directory: str | os.PathLike[str]) -> int:
    """Bytes of a :func:`parse_capacity` result; a share is of the size of the file system that
    holds ``directory`` (or its nearest existing parent)."""
    if isinstance(spec, int):
        return spec
    path = Path(directory).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return max(1, int(shutil.disk_usage(path).total * spec))
