"""Byte-level tokenizer: token ids are the UTF-8 bytes of the text (vocab 256, no downloads)."""

from __future__ import annotations

import numpy as np

VOCAB_SIZE = 256
#: The byte that joins documents in a token stream. NUL never occurs in ordinary text.
SEPARATOR = 0


class ByteTokenizer:
    """Maps text to its UTF-8 bytes and back.

    ``decode(encode(s)) == s`` for every string; decoding arbitrary ids replaces invalid UTF-8
    sequences with U+FFFD, so sampled model output always decodes.
    """

    vocab_size: int = VOCAB_SIZE
    separator: int = SEPARATOR

    def encode(self, text: str | bytes) -> np.ndarray:
        """Returns the int32 token ids of ``text`` (a ``str`` is UTF-8 encoded first)."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        """Returns the text of a sequence of ids in ``[0, 256)``."""
        arr = np.asarray(ids)
        if arr.size and (arr.min() < 0 or arr.max() >= VOCAB_SIZE):
            raise ValueError(f"byte tokenizer ids must lie in [0, {VOCAB_SIZE}), got {arr}")
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
