"""Redis URLs as they may be shown in logs, stats and /get_server_info: the password replaced.

For: every place that prints or returns the address of the Redis SWA pool.
Not for: connecting (the pool hands the original URL to redis-py).
"""

from __future__ import annotations

import urllib.parse

__all__ = ["redacted_url"]


def redacted_url(url: str) -> str:
    """`url` with its password (``redis://user:PASS@host`` or ``redis://:PASS@host``) as ``***``;
    a URL without one is returned unchanged."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    user = parts.username or ""
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
