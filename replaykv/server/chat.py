"""The chat template: chat messages → prompt token ids with the byte tokenizer's specials.

The built-in template (the same as the shipped ``chat_template.json``)::

    <|bos|><|system|>…<|end|><|user|>…<|end|><|assistant|>…<|end|><|tool|>…<|end|><|assistant|>

and generation stops on ``<|end|>`` or ``<|eos|>``. A model directory may carry its own
``chat_template.json`` (format below); it is loaded instead of the built-in one.

``chat_template.json``, format ``replaykv.chat_template.v1``::

    {
      "format": "replaykv.chat_template.v1",
      "bos": "<|bos|>",                                   # put first ("" for nothing)
      "roles": {"user": ["<|user|>", "<|end|>"], ...},   # role → [text before, text after]
      "generation_prompt": "<|assistant|>",               # put last: the model answers from here
      "stop": ["<|end|>", "<|eos|>"]                      # specials → stop ids, others → stop strings
    }

Template strings may contain the tokenizer's specials by name (``<|user|>``); they become
special ids, the rest is UTF-8 bytes. Message *content* is always plain bytes: a user who
types ``<|end|>`` gets those seven bytes, never the special token, so content cannot forge a
turn boundary. A turn-N conversation renders as the turn-(N-1) prompt followed by the answer
and the new messages, so its prefix is what the earlier turn cached.

Not for: tokenizing anything but chat (see :mod:`replaykv.tokenizer`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replaykv.tokenizer import ByteTokenizer

TEMPLATE_FILE = "chat_template.json"
TEMPLATE_FORMAT = "replaykv.chat_template.v1"


class ChatTemplateError(ValueError):
    """A message the template cannot render (unknown role), or a malformed template file."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ChatTemplate:
    """How messages become a prompt. `roles`: role → (text before the content, text after)."""

    bos: str
    roles: Mapping[str, tuple[str, str]]
    generation_prompt: str
    stop: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": TEMPLATE_FORMAT,
            "bos": self.bos,
            "roles": {role: list(pair) for role, pair in self.roles.items()},
            "generation_prompt": self.generation_prompt,
            "stop": list(self.stop),
        }

    def save(self, directory: str | Path) -> None:
        """Write ``chat_template.json`` into a model directory (as ``ByteTokenizer.save`` does)."""
        (Path(directory) / TEMPLATE_FILE).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, raw: Any, where: str = "chat template") -> ChatTemplate:
        if not isinstance(raw, dict) or raw.get("format") != TEMPLATE_FORMAT:
            raise ChatTemplateError(f'{where}: expected an object with "format": {TEMPLATE_FORMAT!r}')
        extra = set(raw) - {"format", "bos", "roles", "generation_prompt", "stop"}
        if extra:
            raise ChatTemplateError(f"{where}: unknown keys {sorted(extra)}")
        roles = raw.get("roles")
        if not isinstance(roles, dict) or not roles:
            raise ChatTemplateError(f'{where}: "roles" must map each role to [before, after]')
        pairs: dict[str, tuple[str, str]] = {}
        for role, pair in roles.items():
            if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(s, str) for s in pair)):
                raise ChatTemplateError(f"{where}: role {role!r} must map to two strings [before, after]")
            pairs[str(role)] = (pair[0], pair[1])
        bos, gen, stop = raw.get("bos", ""), raw.get("generation_prompt", ""), raw.get("stop", [])
        if not isinstance(bos, str) or not isinstance(gen, str):
            raise ChatTemplateError(f'{where}: "bos" and "generation_prompt" must be strings')
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise ChatTemplateError(f'{where}: "stop" must be a list of non-empty strings')
        return cls(bos, pairs, gen, tuple(stop))

    @classmethod
    def load(cls, model_dir: str | Path | None) -> ChatTemplate:
        """The model directory's ``chat_template.json`` when it has one, else the built-in template."""
        if model_dir is not None:
            path = Path(model_dir) / TEMPLATE_FILE
            if path.is_file():
                try:
                    raw = json.loads(path.read_text())
                except (OSError, json.JSONDecodeError) as e:
                    raise ChatTemplateError(f"{path}: {e}") from e
                return cls.from_dict(raw, str(path))
        return BUILTIN_TEMPLATE

    def render(self, messages: Sequence[tuple[str, str]], tokenizer: ByteTokenizer) -> list[int]:
        """Prompt ids of `messages` [(role, content), ...] followed by the generation prompt."""
        if not messages:
            raise ChatTemplateError("messages must hold at least one message", "messages")
        ids = _encode_template(self.bos, tokenizer)
        for i, (role, content) in enumerate(messages):
            if role not in self.roles:
                raise ChatTemplateError(
                    f"messages[{i}].role {role!r} is not supported; use one of {sorted(self.roles)}",
                    f"messages[{i}].role",
                )
            before, after = self.roles[role]
            ids += _encode_template(before, tokenizer)
            ids += tokenizer.encode(content)
            ids += _encode_template(after, tokenizer)
        return ids + _encode_template(self.generation_prompt, tokenizer)

    def stop_token_ids(self, tokenizer: ByteTokenizer) -> tuple[int, ...]:
        """Stop entries that name a special of `tokenizer`, as ids."""
        return tuple(tokenizer.special_ids[s] for s in self.stop if s in tokenizer.special_ids)

    def stop_strings(self, tokenizer: ByteTokenizer) -> tuple[str, ...]:
        """The other stop entries: matched on the generated text."""
        return tuple(s for s in self.stop if s not in tokenizer.special_ids)


def _encode_template(text: str, tokenizer: ByteTokenizer) -> list[int]:
    """Template text → ids: special names become special ids, everything else UTF-8 bytes."""
    if not text:
        return []
    pattern = "(" + "|".join(re.escape(s) for s in tokenizer.specials) + ")"
    ids: list[int] = []
    for piece in re.split(pattern, text):
        if piece in tokenizer.special_ids:
            ids.append(tokenizer.special_ids[piece])
        elif piece:
            ids += tokenizer.encode(piece)
    return ids


BUILTIN_TEMPLATE = ChatTemplate(
    bos="<|bos|>",
    roles={
        "system": ("<|system|>", "<|end|>"),
        "user": ("<|user|>", "<|end|>"),
        "assistant": ("<|assistant|>", "<|end|>"),
        "tool": ("<|tool|>", "<|end|>"),
    },
    generation_prompt="<|assistant|>",
    stop=("<|end|>", "<|eos|>"),
)
