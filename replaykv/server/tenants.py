"""API keys, tenants and their cache salts.

API keys: ``--api-key KEY=TENANT`` (repeatable), ``REPLAYKV_API_KEY="k1=alice,k2=bob"``, or
``api_key: {k1: alice, k2: bob}`` in the file. A bare ``KEY`` is a tenant of its own, named
``key-`` + the first 16 hex digits of the key's SHA-256 (:func:`key_tenant`), so it never sees
what was cached without authentication. With no key configured the server runs without
authentication and every request is tenant ``default``; a key shares that tenant only when
mapped to it explicitly (``KEY=default``). A tenant's cache salt is derived here from the
tenant *name* (never from anything a client sends), so the same tenant hits its own cache
across restarts and machines.

Not for: authenticating requests (the server's gate in :mod:`replaykv.server.app`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

__all__ = ["DEFAULT_TENANT", "key_tenant", "parse_keys", "tenant_salt"]

DEFAULT_TENANT = "default"
"""The tenant of every request when no API key is configured."""


def key_tenant(key: str) -> str:
    """The tenant of a key given without one: ``key-`` + 16 hex digits of its SHA-256.

    A digest, so the key itself never shows in logs or metrics; distinct keys get distinct
    tenants, none of them ``default``.
    """
    return "key-" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def parse_keys(raw: Any) -> tuple[tuple[str, str], ...]:
    """API keys as ``((key, tenant), ...)`` from a mapping, a list of "KEY=TENANT", or "k=t,k2=t2"."""
    if isinstance(raw, Mapping):
        items = [(str(k), str(v)) for k, v in raw.items()]
    else:
        parts = raw.split(",") if isinstance(raw, str) else list(raw)
        items = []
        for part in parts:
            key, sep, tenant = str(part).strip().partition("=")
            items.append((key.strip(), tenant.strip() if sep else key_tenant(key.strip())))
    seen: dict[str, str] = {}
    for key, tenant in items:
        if not key or not tenant:
            raise ValueError(f"an API key entry needs KEY=TENANT with both non-empty, got {key!r}={tenant!r}")
        if key in seen and seen[key] != tenant:
            raise ValueError(f"API key {key[:4]}… is mapped to two tenants ({seen[key]!r}, {tenant!r})")
        seen[key] = tenant
    return tuple(seen.items())


def tenant_salt(tenant: str) -> bytes:
    """The cache salt of a tenant: SHA-256 over a tag and the framed UTF-8 name (32 bytes).

    Framing by length keeps ("org_1", …) and ("org_12345", …) apart; the tag keeps these salts
    apart from any other use of the name."""
    name = tenant.encode("utf-8", "surrogatepass")
    return hashlib.sha256(b"replaykv.tenant.v1\0" + len(name).to_bytes(8, "little") + name).digest()
