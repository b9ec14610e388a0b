"""Token ids as text through the server's local tokenizer (``--tokenizer`` / ``ADV_TOKENIZER``):
the viewer shows tokens with it, and terms that can find their inputs in the text (HICRA's
planning tokens) read the decoded vocabulary from it."""

from __future__ import annotations

import threading
from pathlib import Path


class TokenText:
    """Token ids as text through a local ``tokenizer.json`` (the ``tokenizers`` library; the
    file is read once, nothing is downloaded)."""

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise RuntimeError(
                "ADV_TOKENIZER needs the tokenizers package: pip install tokenizers"
            ) from exc
        if not Path(path).is_file():
            raise RuntimeError(f"ADV_TOKENIZER: {path!r} is not a file (a local tokenizer.json)")
        self.path = path
        self._tokenizer = Tokenizer.from_file(path)
        self._lock = threading.Lock()
        self._vocabulary: tuple[str, ...] | None = None

    @property
    def name(self) -> str:
        return Path(self.path).parent.name or Path(self.path).name

    def texts(self, ids: list[int]) -> dict[str, str]:
        """id -> the text it decodes to alone (a byte-level piece of a character: U+FFFD)."""
        size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        with self._lock:  # (a Tokenizer is not documented as thread-safe)
            return {
                str(i): self._tokenizer.decode([i], skip_special_tokens=False)
                if 0 <= i < size
                else ""
                for i in ids
            }

    def vocabulary(self) -> tuple[str, ...]:
        """What every id decodes to alone, by id: decoded once, on first use (the same tuple
        after: terms cache what they make of it by its identity)."""
        with self._lock:
            if self._vocabulary is None:
                size = self._tokenizer.get_vocab_size(with_added_tokens=True)
                self._vocabulary = tuple(
                    self._tokenizer.decode_batch(
                        [[i] for i in range(size)], skip_special_tokens=False
                    )
                )
            return self._vocabulary


__all__ = ["TokenText"]
