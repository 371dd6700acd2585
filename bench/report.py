"""Writing a benchmark's Markdown section into docs/benchmarks.md (shared by the bench scripts).

A section lives between `<!-- NAME:begin -->` and `<!-- NAME:end -->`; rerunning a bench replaces
only its own section, or appends it under `heading` the first time.
"""

from __future__ import annotations

from pathlib import Path


def replace_section(path: str | Path, section: str, begin: str, end: str, heading: str) -> None:
    """Put `section` (which starts with `begin` and ends with `end`) into the file at `path`."""
    path = Path(path)
    text = path.read_text() if path.exists() else ""
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = head + section + tail
    else:
        text = text.rstrip() + f"\n\n{heading}\n\n" + section + "\n"
    path.write_text(text)
