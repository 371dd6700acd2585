"""Small POSIX file helpers shared by the persistent stores: whole writes and reads, directory
fsync, error names, and the orphan test for temp files a crashed writer left behind.

Not for: any layout or policy (see ``cache/file_store.py`` and ``cache/pack_store.py``).
"""

from __future__ import annotations

import errno
import os
import struct
import time
import zlib

__all__ = [
    "crc_sealed",
    "errname",
    "fsync_dir",
    "is_orphan_temp",
    "pid_alive",
    "pread_exact",
    "seal_crc",
    "write_all",
]


def errname(exc: OSError) -> str:
    """``ENOSPC``, ``EIO``, ... (the exception's class name when it carries no errno)."""
    return errno.errorcode.get(exc.errno, "OSError") if exc.errno is not None else type(exc).__name__


def write_all(fd: int, data: bytes | memoryview) -> None:
    """Write every byte of ``data`` (``os.write`` may write less than asked)."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:
            raise OSError(errno.EIO, "short write")
        view = view[written:]


def pread_exact(fd: int, size: int, offset: int) -> bytes | None:
    """``size`` bytes at ``offset`` (one ``pread`` unless it comes back short); ``None`` at EOF."""
    data = os.pread(fd, size, offset)
    if len(data) == size:
        return data
    parts = [data]
    got = len(data)
    while got < size:
        more = os.pread(fd, size - got, offset + got)
        if not more:
            return None
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def fsync_dir(path: str) -> None:
    """Make the directory's entries (a rename or unlink in it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def is_orphan_temp(name: str, ctime: float, grace_s: float) -> bool:
    """Whether a temp file named ``.<id>.<pid>.<rand>.tmp`` was left by a writer that is gone:
    its pid is not running (or unparseable), or it is older than ``grace_s`` (ctime is wall
    clock time that ``utime`` cannot move). This process's own temp files are in flight."""
    parts = name.split(".")  # ["", id, pid, rand, "tmp"]
    try:
        pid = int(parts[2])
    except (IndexError, ValueError):
        return True
    if time.time() - ctime > grace_s:
        return True
    return pid != os.getpid() and not pid_alive(pid)


def seal_crc(packed: bytes) -> bytes:
    """``packed`` (a struct whose last field is a u32 CRC-32 left 0) with that CRC-32 of every
    byte before it filled in (little-endian)."""
    return packed[:-4] + struct.pack("<I", zlib.crc32(packed[:-4]))


def crc_sealed(raw: bytes, crc: int) -> bool:
    """Whether ``crc`` (the u32 read from the last 4 bytes of ``raw``) is the CRC-32 of the rest."""
    return zlib.crc32(raw[:-4]) == crc
