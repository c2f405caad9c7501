"""Data pipeline: byte tokenizer, local TFDS ArrayRecord builder, token sources and batches.

``get_source(spec, data_dir)`` returns a :class:`TokenSource` for ``--data`` (``shakespeare``,
``text:DIR`` or ``tfds:NAME[:VERSION]``); ``batch_iterator`` turns it into deterministic,
resumable, per-process batches of ``seq_len + 1`` tokens. No TensorFlow is imported.
"""

from gift_jax.data.errors import DataError
from gift_jax.data.pipeline import batch_iterator
from gift_jax.data.source import TokenSource, get_source
from gift_jax.data.tokenizer import SEPARATOR, VOCAB_SIZE, ByteTokenizer

__all__ = [
    "SEPARATOR",
    "VOCAB_SIZE",
    "ByteTokenizer",
    "DataError",
    "TokenSource",
    "batch_iterator",
    "get_source",
]
