"""Data pipeline: tokenizers, local TFDS ArrayRecord builder, token sources and batches.

``get_source(spec, data_dir, tokenizer=...)`` returns a token source for ``--data``
(``shakespeare``, ``text:DIR`` or ``tfds:NAME[:VERSION]``) under a ``data.tokenizer``
(``byte``, a SentencePiece or ``tokenizer.json`` file, or ``spm:N`` / ``bpe:N`` trained on the
train split); ``batch_iterator`` turns it into deterministic, resumable, per-process batches of
``seq_len + 1`` tokens. No TensorFlow is imported.
"""

from gift_jax.data.errors import DataError
from gift_jax.data.pipeline import batch_iterator
from gift_jax.data.source import TokenSource, get_source
from gift_jax.data.stream import stream_batches
from gift_jax.data.tokenized import TokenizedSource
from gift_jax.data.tokenizer import (
    SEPARATOR,
    VOCAB_SIZE,
    ByteTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    padded_vocab_size,
    vocab_mismatch,
)
from gift_jax.data.train_tokenizer import get_tokenizer

__all__ = [
    "SEPARATOR",
    "VOCAB_SIZE",
    "ByteTokenizer",
    "DataError",
    "HFTokenizer",
    "SentencePieceTokenizer",
    "TokenSource",
    "TokenizedSource",
    "Tokenizer",
    "batch_iterator",
    "get_source",
    "get_tokenizer",
    "padded_vocab_size",
    "stream_batches",
    "vocab_mismatch",
]
