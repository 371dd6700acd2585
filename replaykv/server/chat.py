"""Chat templates: chat messages → prompt token ids, with the tokenizer's specials.

A model directory's template, first found of: ``chat_template.json`` (ours, below),
``chat_template.jinja``, the ``chat_template`` of ``tokenizer_config.json`` (the Jinja templates
every Hugging Face model ships, rendered as transformers' ``apply_chat_template`` does:
:class:`JinjaChatTemplate`), else the built-in one.

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

A Jinja template is rendered with each message's content replaced by a placeholder; the text
around the placeholders is tokenized with specials recognised, each content as plain text, so
content cannot forge a turn boundary there either. (A template that rewrites content beyond
recognition of the placeholder is rendered with the real content, specials recognised, as
transformers does; such a template cannot take images.)

Images: a message's content may be a sequence of text pieces and :class:`ImageSlot` entries. A slot
becomes its span, ``length`` copies of the model's image token id, at that place in the content;
:meth:`ChatTemplate.render_with_images` also returns where each span starts. Text cannot forge
an image: the model reads image vectors only at the spans a request names (text that happens to
encode to the image token id stays a text embedding), and cache keys hash each span's pixels.
The same messages always give the same ids and spans, so a turn that re-sends an earlier turn's
images extends that turn's prefix.

Not for: tokenizing anything but chat (see :mod:`replaykv.tokenizer`).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

from replaykv.tokenizer import GENERATION_CONFIG_FILE, TOKENIZER_CONFIG_FILE, Tokenizer

TEMPLATE_FILE = "chat_template.json"
JINJA_TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_FORMAT = "replaykv.chat_template.v1"
_PLACEHOLDER = re.compile("\ue000([0-9]+)\ue001")


@dataclass(frozen=True)
class ImageSlot:
    """An image's place in a message's content: its span of `length` positions, each carrying
    `token_id` (the model's image token). `index` numbers the request's images, so that the
    rendered starts can be matched to them."""

    index: int
    length: int
    token_id: int


Content: TypeAlias = str | tuple[str | ImageSlot, ...]
"""A message's content: text, or text pieces and image slots in order."""


def encode_content(content: Content, tokenizer: Tokenizer, ids: list[int], starts: dict[int, int]) -> None:
    """Append the ids of `content` to `ids` (text as plain bytes, a slot as its span) and record
    each slot's first position in `starts` (image index → position)."""
    if isinstance(content, str):
        ids += tokenizer.encode(content)
        return
    for piece in content:
        if isinstance(piece, ImageSlot):
            starts[piece.index] = len(ids)
            ids += [piece.token_id] * piece.length
        else:
            ids += tokenizer.encode(piece)


def _text_of(content: Content) -> str:
    """The text of `content`, for a template that must see it (images refused)."""
    if isinstance(content, str):
        return content
    if any(isinstance(piece, ImageSlot) for piece in content):
        raise ChatTemplateError(
            "this model's chat template rewrites message content, so images cannot be placed in it",
            "messages",
        )
    return "".join(piece for piece in content if isinstance(piece, str))


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
    def load(cls, model_dir: str | Path | None) -> ChatTemplate | JinjaChatTemplate:
        """The model directory's template (the order in the module docstring), else the built-in."""
        if model_dir is not None:
            path = Path(model_dir) / TEMPLATE_FILE
            if path.is_file():
                return cls.from_dict(_read_json(path), str(path))
            jinja = JinjaChatTemplate.load(model_dir)
            if jinja is not None:
                return jinja
        return BUILTIN_TEMPLATE

    def render(self, messages: Sequence[tuple[str, Content]], tokenizer: Tokenizer) -> list[int]:
        """Prompt ids of `messages` [(role, content), ...] followed by the generation prompt."""
        return self.render_with_images(messages, tokenizer)[0]

    def render_with_images(
        self, messages: Sequence[tuple[str, Content]], tokenizer: Tokenizer
    ) -> tuple[list[int], dict[int, int]]:
        """Prompt ids of `messages` and the first position of each image slot (index → start)."""
        if not messages:
            raise ChatTemplateError("messages must hold at least one message", "messages")
        ids = _encode_template(self.bos, tokenizer)
        starts: dict[int, int] = {}
        for i, (role, content) in enumerate(messages):
            if role not in self.roles:
                raise ChatTemplateError(
                    f"messages[{i}].role {role!r} is not supported; use one of {sorted(self.roles)}",
                    f"messages[{i}].role",
                )
            before, after = self.roles[role]
            ids += _encode_template(before, tokenizer)
            encode_content(content, tokenizer, ids, starts)
            ids += _encode_template(after, tokenizer)
        return ids + _encode_template(self.generation_prompt, tokenizer), starts

    def stop_token_ids(self, tokenizer: Tokenizer) -> tuple[int, ...]:
        """Stop entries that name a special of `tokenizer`, as ids."""
        return tuple(tokenizer.special_ids[s] for s in self.stop if s in tokenizer.special_ids)

    def stop_strings(self, tokenizer: Tokenizer) -> tuple[str, ...]:
        """The other stop entries: matched on the generated text."""
        return tuple(s for s in self.stop if s not in tokenizer.special_ids)


@dataclass(frozen=True)
class JinjaChatTemplate:
    """A Hugging Face Jinja chat template. `variables`: the special-token names of
    ``tokenizer_config.json`` (``bos_token``, ``eos_token``, …) the template may use; `stop`: the
    token names generation stops on (``eos_token`` and ``generation_config.json``'s ids)."""

    source: str
    variables: Mapping[str, str]
    stop: tuple[str, ...] = ()
    stop_ids: tuple[int, ...] = ()

    @classmethod
    def load(cls, model_dir: str | Path) -> JinjaChatTemplate | None:
        """The Jinja template of a model directory, None when it has none."""
        directory = Path(model_dir)
        config_path = directory / TOKENIZER_CONFIG_FILE
        config = _read_json(config_path) if config_path.is_file() else {}
        if not isinstance(config, dict):
            raise ChatTemplateError(f"{config_path}: expected a JSON object")
        source: Any = config.get("chat_template")
        if (directory / JINJA_TEMPLATE_FILE).is_file():
            source = (directory / JINJA_TEMPLATE_FILE).read_text()
        if isinstance(source, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if source is None:
            return None
        if not isinstance(source, str):
            raise ChatTemplateError(
                f"{config_path}: chat_template must be a string or a list of named templates"
            )
        variables: dict[str, str] = {}
        for key, value in config.items():
            name = value.get("content") if isinstance(value, dict) else value
            if key.endswith("_token") and isinstance(name, str):
                variables[key] = name
        stop = (variables["eos_token"],) if "eos_token" in variables else ()
        stop_ids: tuple[int, ...] = ()
        generation_path = directory / GENERATION_CONFIG_FILE
        if generation_path.is_file():
            eos = _read_json(generation_path).get("eos_token_id")
            stop_ids = tuple(eos) if isinstance(eos, list) else (eos,) if isinstance(eos, int) else ()
        template = cls(source, variables, stop, stop_ids)
        template._compiled()  # a syntax error is reported at load time
        return template

    def _compiled(self) -> Any:
        return _compile_jinja(self.source)

    def render_text(
        self,
        messages: Sequence[tuple[str, str]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The prompt as text, as transformers' ``apply_chat_template(..., tokenize=False)``
        (`tools`, OpenAI's tool definitions, passed as the template's ``tools``)."""
        import jinja2

        listed = [{"role": role, "content": content} for role, content in messages]
        extra: dict[str, Any] = {"tools": list(tools)} if tools else {}
        try:
            return str(
                self._compiled().render(
                    messages=listed, add_generation_prompt=add_generation_prompt, **extra, **self.variables
                )
            )
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(str(e), "messages") from e

    def render(
        self,
        messages: Sequence[tuple[str, Content]],
        tokenizer: Tokenizer,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Prompt ids of `messages` [(role, content), ...] followed by the generation prompt."""
        return self.render_with_images(messages, tokenizer, tools)[0]

    def render_with_images(
        self,
        messages: Sequence[tuple[str, Content]],
        tokenizer: Tokenizer,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> tuple[list[int], dict[int, int]]:
        """Prompt ids of `messages` and the first position of each image slot (index → start)."""
        if not messages:
            raise ChatTemplateError("messages must hold at least one message", "messages")
        held = [(role, f"\ue000{i}\ue001") for i, (role, _) in enumerate(messages)]
        text = self.render_text(held, tools=tools)
        pieces = _PLACEHOLDER.split(text)
        starts: dict[int, int] = {}
        if sorted(int(i) for i in pieces[1::2]) != list(range(len(messages))):
            plain = [(role, _text_of(content)) for role, content in messages]
            return _encode_template(self.render_text(plain, tools=tools), tokenizer), starts
        ids: list[int] = []
        for k, piece in enumerate(pieces):
            if k % 2:
                encode_content(messages[int(piece)][1], tokenizer, ids, starts)
            else:
                ids += _encode_template(piece, tokenizer)
        return ids, starts

    def stop_token_ids(self, tokenizer: Tokenizer) -> tuple[int, ...]:
        named = tuple(tokenizer.special_ids[s] for s in self.stop if s in tokenizer.special_ids)
        return tuple(dict.fromkeys((*self.stop_ids, *named)))

    def stop_strings(self, tokenizer: Tokenizer) -> tuple[str, ...]:
        return ()


@functools.lru_cache(maxsize=8)
def _compile_jinja(source: str) -> Any:
    """`source` compiled in the environment transformers renders chat templates in."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template: {e}") from e


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ChatTemplateError(f"{path}: {e}") from e


def _encode_template(text: str, tokenizer: Tokenizer) -> list[int]:
    """Template text → ids: special names become special ids, everything else UTF-8 bytes."""
    if not text:
        return []
    if not tokenizer.specials:
        return tokenizer.encode(text)
    longest_first = sorted(tokenizer.specials, key=len, reverse=True)
    pattern = "(" + "|".join(re.escape(s) for s in longest_first) + ")"
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
