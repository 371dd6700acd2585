"""``response_format``: the request's JSON Schema checked up front, the answer checked after.

For: ``{"type": "text"}``, ``{"type": "json_object"}`` and ``{"type": "json_schema",
"json_schema": {"name", "schema", "strict", "description"}}``. The schema itself must be a valid
JSON Schema (Draft 2020-12, checked with ``jsonschema``) or the request gets a 400. Generation is
not constrained: the answer is checked when it is complete and the result reported in
``usage.replaykv.response_format`` as ``{"type", "valid", "error"}`` (``error`` null when valid),
and a warning is logged when it does not conform.

Not for: grammar-constrained decoding (not implemented: a ``strict: true`` schema is checked and
reported like any other, never enforced token by token).
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema


def check_schema(schema: dict[str, Any]) -> None:
    """Raise ValueError naming the problem when `schema` is not a valid JSON Schema."""
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.path) or "(root)"
        raise ValueError(f"response_format.json_schema.schema is not a valid JSON Schema at {where}: {e.message}") from e


def conformance(kind: str, schema: dict[str, Any] | None, text: str) -> dict[str, Any]:
    """The report of `text` against ``response_format`` type `kind` (and its schema)."""
    if kind == "text":
        return {"type": kind, "valid": True, "error": None}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return {"type": kind, "valid": False, "error": f"not JSON: {e.msg} at character {e.pos}"}
    if kind == "json_object" and not isinstance(value, dict):
        return {"type": kind, "valid": False, "error": f"JSON {type(value).__name__}, not an object"}
    if kind == "json_schema" and schema is not None:
        error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(value))
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path) or "(root)"
            return {"type": kind, "valid": False, "error": f"at {where}: {error.message}"}
    return {"type": kind, "valid": True, "error": None}
