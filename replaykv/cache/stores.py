"""Choosing and opening a persistent global-KV store by format name.

For: entry points (engine, ``replaykv store``) that get a directory and maybe a format name:
``pack`` (:class:`~replaykv.cache.pack_store.PackStore`, a file per written batch; the default
for a new directory) or ``file`` (:class:`~replaykv.cache.store.DirectoryStore`, a file per
entry). A directory is recognised by its top-level folder (``packs/`` or ``entries/``).
Not for: the stores themselves.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from replaykv.cache.pack_store import PackStore
from replaykv.cache.store import DirectoryStore

__all__ = ["STORE_FORMATS", "detect_format", "make_store"]

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
    fmt: str | None, root: str | os.PathLike[str], capacity_bytes: int, **kwargs: Any
) -> PackStore | DirectoryStore:
    """Open (or create) the store at ``root``. ``fmt`` None: the format already there, or ``pack``
    for a new directory. A format that differs from the one on disk is refused (``ValueError``),
    so a store is never silently shadowed by an empty one of the other kind."""
    if fmt is not None and fmt not in STORE_FORMATS:
        raise ValueError(f"store format must be one of {STORE_FORMATS}; got {fmt!r}")
    on_disk = detect_format(root)
    if fmt is not None and on_disk is not None and fmt != on_disk:
        raise ValueError(
            f"{root} holds a {on_disk!r} store ({_MARKERS[on_disk]}/); open it as {on_disk!r} or use another directory"
        )
    chosen = fmt or on_disk or "pack"
    if chosen == "pack":
        return PackStore(root, capacity_bytes, **kwargs)
    return DirectoryStore(root, capacity_bytes, **kwargs)
