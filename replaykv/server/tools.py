"""Tool calling in the format the shipped models were trained on.

For: turning an OpenAI chat request with ``tools`` into prompt messages and the model's answer
back into ``tool_calls``. The trained format (``replaykv/train/tasks.py``, the tool task) is::

    <|system|>Tools: lookup(key) returns JSON. Call it as {"tool": "lookup", "key": K}.<|end|>
    <|user|>What is the value of abc?<|end|>
    <|assistant|>{"tool": "lookup", "key": "abc"}<|end|>
    <|tool|>{"abc": 4711}<|end|>
    <|assistant|>4711<|end|>

- ``tools`` become that system line (put before the first system message's content, or as a new
  first system message): each function as ``name(param, ...)``, and one call example per
  function whose parameters read as their first letter in capitals.
- An assistant message's ``tool_calls`` become its content: one JSON object per call,
  ``{"tool": name, **arguments}`` (newline-separated when there are several); a ``tool``
  message's content is the result as given.
- An answer that is nothing but such objects naming offered tools becomes ``tool_calls``
  (``finish_reason`` ``"tool_calls"``, content null); anything else is content.
- ``tool_choice``: ``"auto"`` (default with tools) parses calls; ``"none"`` offers the tools but
  returns text as text; ``"required"`` and a named function start the answer with the call's
  opening (``{"tool": "`` or ``{"tool": "name", ``) so the model continues a call; the opening is
  part of the answer that is parsed. ``parallel_tool_calls: false`` keeps the first call only.

Not for: other models' tool formats (a Jinja template that reads ``tools`` is given them too,
but answers are parsed in this format only), or constrained decoding of the arguments.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from replaykv.server.chat import Content

FINISH_TOOL_CALLS = "tool_calls"


@dataclass(frozen=True)
class Function:
    """One offered function: its name and parameter names (from the JSON Schema's properties)."""

    name: str
    params: tuple[str, ...]

    @classmethod
    def of(cls, name: str, parameters: dict[str, Any] | None) -> Function:
        props = (parameters or {}).get("properties") or {}
        return cls(name, tuple(str(p) for p in props) if isinstance(props, dict) else ())

    def signature(self) -> str:
        return f"{self.name}({', '.join(self.params)})"

    def example(self) -> str:
        fields = "".join(f', "{p}": {p[:1].upper() or "X"}' for p in self.params)
        return f'{{"tool": "{self.name}"{fields}}}'


def system_line(functions: Sequence[Function]) -> str:
    """The trained tools line: ``Tools: f(a) returns JSON. Call it as {"tool": "f", "a": A}.``"""
    described = " ".join(f"{f.signature()} returns JSON." for f in functions)
    examples = " or ".join(f.example() for f in functions)
    return f"Tools: {described} Call {'it' if len(functions) == 1 else 'one'} as {examples}."


def with_tools(
    messages: list[tuple[str, Content]], functions: Sequence[Function]
) -> list[tuple[str, Content]]:
    """`messages` with the tools line put into the first system message (or a new one first)."""
    if not functions:
        return messages
    line = system_line(functions)
    if messages and messages[0][0] == "system" and isinstance(messages[0][1], str):
        content = messages[0][1]
        return [("system", f"{line}\n{content}" if content else line), *messages[1:]]
    return [("system", line), *messages]


def call_text(name: str, arguments: str) -> str:
    """An assistant tool call as the model writes it. `arguments`: the OpenAI JSON string."""
    try:
        args = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"the arguments of tool call {name!r} are not JSON ({e.msg})") from e
    if not isinstance(args, dict):
        raise ValueError(f"the arguments of tool call {name!r} must be a JSON object")
    if "tool" in args:
        raise ValueError(f"tool call {name!r}: an argument may not be named 'tool' (the format's name key)")
    return json.dumps({"tool": name, **args}, ensure_ascii=False)


def forced_opening(choice: str | None, functions: Sequence[Function]) -> str:
    """The text the answer is started with for `choice` ("required" or a function name)."""
    if choice is None or choice in ("auto", "none"):
        return ""
    if choice == "required":
        if len(functions) == 1:
            choice = functions[0].name
        else:
            return '{"tool": "'
    has_params = any(f.params for f in functions if f.name == choice)
    return f'{{"tool": "{choice}", ' if has_params else f'{{"tool": "{choice}"'


def parse_calls(
    text: str, functions: Sequence[Function], parallel: bool = True
) -> list[dict[str, Any]] | None:
    """The OpenAI ``tool_calls`` of an answer that consists of tool calls only, else None."""
    names = {f.name for f in functions}
    decoder = json.JSONDecoder()
    calls: list[dict[str, Any]] = []
    i, end = 0, len(text)
    while True:
        while i < end and text[i].isspace():
            i += 1
        if i == end:
            break
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or obj.get("tool") not in names:
            return None
        args = {k: v for k, v in obj.items() if k != "tool"}
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": obj["tool"], "arguments": json.dumps(args, ensure_ascii=False)},
            }
        )
    if not calls:
        return None
    return calls if parallel else calls[:1]


def may_become_call(text: str) -> bool:
    """Whether streamed text so far could still turn out to be a tool call (held back until known)."""
    stripped = text.lstrip()
    return not stripped or stripped.startswith("{")
