"""A byte-level tokenizer that works offline: ids 0..255 are bytes, then a few special tokens.

Not for: the released DeepSeek vocabularies (load those with their own tokenizer files).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SPECIALS = ("<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>", "<|tool|>", "<|end|>")


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

    def save(self, directory: str | Path) -> None:
        spec = {"type": "byte", "specials": list(self.specials)}
        (Path(directory) / "tokenizer.json").write_text(json.dumps(spec, indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> ByteTokenizer:
        path = Path(directory) / "tokenizer.json"
        if not path.exists():
            return cls()
        spec = json.loads(path.read_text())
        if spec.get("type") != "byte":
            raise ValueError(
                f"{path}: only byte-level tokenizers are supported, got type {spec.get('type')!r}"
            )
        return cls(tuple(spec.get("specials", SPECIALS)))
