"""Tokenizers: our byte-level one (works offline) and any Hugging Face ``tokenizer.json``.

:class:`ByteTokenizer`: ids 0..255 are bytes, then a few special tokens. ``save`` writes it as a
real ``tokenizers`` file (a byte-level BPE without merges) with a ``tokenizer_config.json`` that
carries the Jinja chat template, so ``transformers.AutoTokenizer.from_pretrained`` loads an
exported model and produces the same ids. :class:`HFTokenizer` wraps any other ``tokenizer.json``
through the ``tokenizers`` library. :func:`load_tokenizer` picks between them for a model directory
(the older ``{"type": "byte"}`` file still loads as a :class:`ByteTokenizer`).

Both encode *text* as plain text (a special's name in it is never that special); chat templates
insert specials through :mod:`replaykv.server.chat`. Not for: chat rendering.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HFTokenizerFile

SPECIALS = ("<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>", "<|tool|>", "<|end|>")
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"

# The byte tokenizer's chat template in Jinja, the same prompt as replaykv.server.chat's built-in:
#   <|bos|><|system|>…<|end|><|user|>…<|end|><|assistant|>…<|end|><|tool|>…<|end|><|assistant|>
BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('messages[' ~ loop.index0 ~ '].role ' ~ message['role'] ~ ' is not supported; "
    "use one of assistant, system, tool, user') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


class Tokenizer(Protocol):
    """What the engine and the server need of a tokenizer."""

    @property
    def specials(self) -> tuple[str, ...]: ...
    @property
    def special_ids(self) -> dict[str, int]: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def bos_id(self) -> int | None: ...
    def encode(self, text: str, bos: bool = False) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def token_text(self, token_id: int) -> str: ...
    def token_bytes(self, token_id: int) -> list[int]: ...


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in of each byte (the ``ByteLevel`` alphabet of ``tokenizers``):
    printable Latin-1 bytes stand for themselves, the other 68 for code points from 256 up."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars: dict[int, str] = {b: chr(b) for b in kept}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


BYTE_CHARS = _byte_chars()
_CHAR_BYTES = {c: b for b, c in enumerate(BYTE_CHARS)}


@dataclass(frozen=True)
class ByteTokenizer:
    """Bytes map to ids 0..255; specials follow at 256.. in the order of `specials`."""

    specials: tuple[str, ...] = SPECIALS
    special_ids: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "special_ids", {s: 256 + i for i, s in enumerate(self.specials)})

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.specials)

    @property
    def bos_id(self) -> int:
        return self.special_ids["<|bos|>"]

    @property
    def eos_id(self) -> int:
        return self.special_ids["<|eos|>"]

    def encode(self, text: str, bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_id, *ids] if bos else ids

    def decode(self, ids: list[int]) -> str:
        out = bytearray()
        for i in ids:
            if 0 <= i < 256:
                out.append(i)
        return out.decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        """A unique printable name of one token: ASCII bytes as themselves, other bytes as
        ``bytes:\\xNN`` (OpenAI's convention for partial characters), specials by name, ids of a
        padded model vocabulary beyond the tokenizer's as ``<|unused_N|>``."""
        if 0 <= token_id < 128:
            return chr(token_id)
        if 128 <= token_id < 256:
            return f"bytes:\\x{token_id:02x}"
        if 256 <= token_id < self.vocab_size:
            return self.specials[token_id - 256]
        if token_id < 0:
            raise ValueError(f"token id {token_id} is negative")
        return f"<|unused_{token_id}|>"  # a model vocabulary padded past the tokenizer's

    def token_bytes(self, token_id: int) -> list[int]:
        """The bytes a token stands for (a special's name in UTF-8)."""
        if 0 <= token_id < 256:
            return [token_id]
        return list(self.token_text(token_id).encode("utf-8"))

    def to_tokenizers(self) -> HFTokenizerFile:
        """This tokenizer as a ``tokenizers.Tokenizer``: a byte-level BPE without merges whose id
        of each byte is the byte, the specials added at 256.. and a post-processor that puts
        ``<|bos|>`` first when special tokens are asked for."""
        from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
        from tokenizers import Tokenizer as HFTokenizerFile

        tok = HFTokenizerFile(models.BPE(vocab={c: b for b, c in enumerate(BYTE_CHARS)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in self.specials])
        bos = "<|bos|>"
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, self.bos_id)]
        )
        return tok

    def save(self, directory: str | Path) -> None:
        """Write ``tokenizer.json`` (``tokenizers`` format), ``tokenizer_config.json`` (special
        tokens and the Jinja chat template) and, when absent, ``generation_config.json`` (generation
        stops on ``<|end|>`` or ``<|eos|>``)."""
        out = Path(directory)
        self.to_tokenizers().save(str(out / TOKENIZER_FILE))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<|bos|>",
            "eos_token": "<|eos|>",
            "add_bos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1 << 20,
            "chat_template": BYTE_CHAT_TEMPLATE,
        }
        (out / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        generation = out / GENERATION_CONFIG_FILE
        if not generation.exists() and "<|end|>" in self.special_ids:
            stops = [self.special_ids["<|end|>"], self.eos_id]
            generation.write_text(json.dumps({"bos_token_id": self.bos_id, "eos_token_id": stops}) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> ByteTokenizer:
        """The byte tokenizer saved in `directory` (either file format); the default one when
        there is no ``tokenizer.json``. ValueError when the file holds another tokenizer."""
        path = Path(directory) / TOKENIZER_FILE
        if not path.exists():
            return cls()
        spec = json.loads(path.read_text())
        if spec.get("type") == "byte":  # the format before tokenizers files
            return cls(tuple(spec.get("specials", SPECIALS)))
        specials = _byte_layout_specials(spec)
        if specials is None:
            raise ValueError(f"{path}: not a byte-level tokenizer (load it with load_tokenizer)")
        return cls(specials)


def _byte_layout_specials(spec: dict[str, Any]) -> tuple[str, ...] | None:
    """The specials of a ``tokenizers`` file written by ``ByteTokenizer.save``; None for others."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("merges") or model.get("vocab") != {
        c: b for b, c in enumerate(BYTE_CHARS)
    }:
        return None
    added = sorted(spec.get("added_tokens") or [], key=lambda t: t["id"])
    if [t["id"] for t in added] != list(range(256, 256 + len(added))) or not all(t["special"] for t in added):
        return None
    specials = tuple(t["content"] for t in added)
    return specials if "<|bos|>" in specials and "<|eos|>" in specials else None


def _token_name(config: dict[str, Any], key: str) -> str | None:
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """Any Hugging Face ``tokenizer.json`` through the ``tokenizers`` library, with the
    ``bos_token`` / ``eos_token`` of ``tokenizer_config.json``. Specials are its added tokens
    marked special."""

    def __init__(self, tokenizer: HFTokenizerFile, config: dict[str, Any] | None = None) -> None:
        self._tok = tokenizer
        self._tok.encode_special_tokens = True  # text is plain text: a special's name stays text
        config = config or {}
        added = tokenizer.get_added_tokens_decoder()
        self._special_ids = {t.content: i for i, t in sorted(added.items()) if t.special}
        self._byte_level = json.loads(tokenizer.to_str()).get("decoder", {}) or {}
        self._byte_level = self._byte_level.get("type") == "ByteLevel"
        bos, eos = _token_name(config, "bos_token"), _token_name(config, "eos_token")
        self.bos_token, self.eos_token = bos, eos
        self._bos_id = tokenizer.token_to_id(bos) if bos else None
        self._eos_id = tokenizer.token_to_id(eos) if eos else None

    @classmethod
    def load(cls, directory: str | Path) -> HFTokenizer:
        from tokenizers import Tokenizer as HFTokenizerFile

        directory = Path(directory)
        config_path = directory / TOKENIZER_CONFIG_FILE
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        return cls(HFTokenizerFile.from_file(str(directory / TOKENIZER_FILE)), config)

    @property
    def specials(self) -> tuple[str, ...]:
        return tuple(self._special_ids)

    @property
    def special_ids(self) -> dict[str, int]:
        return dict(self._special_ids)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    def encode(self, text: str, bos: bool = False) -> list[int]:
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        return [self._bos_id, *ids] if bos and self._bos_id is not None else ids

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def token_text(self, token_id: int) -> str:
        """The token's text; a byte-level piece that is not whole UTF-8 as ``bytes:\\xNN…``."""
        if token_id < 0:
            raise ValueError(f"token id {token_id} is negative")
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return f"<|unused_{token_id}|>"
        if piece in self._special_ids:
            return piece
        raw = bytes(self.token_bytes(token_id))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def token_bytes(self, token_id: int) -> list[int]:
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return list(f"<|unused_{token_id}|>".encode())
        if self._byte_level and piece not in self._special_ids and all(c in _CHAR_BYTES for c in piece):
            return [_CHAR_BYTES[c] for c in piece]
        return list(self._tok.decode([token_id], skip_special_tokens=False).encode("utf-8"))


def load_tokenizer(directory: str | Path | None) -> ByteTokenizer | HFTokenizer:
    """The tokenizer of a model directory: our byte tokenizer when ``tokenizer.json`` is one (or
    missing), else the Hugging Face tokenizer it holds."""
    if directory is None:
        return ByteTokenizer()
    try:
        return ByteTokenizer.load(directory)
    except ValueError:
        return HFTokenizer.load(directory)
