"""The files of a ``text:DIR`` corpus and the documents they hold, without TFDS.

Every non-empty, non-hidden regular file under the directory (recursive, hidden directories
skipped) is decoded as UTF-8 (invalid bytes replaced, NUL removed). A ``.jsonl``,
``.jsonl.gz`` or ``.json.gz`` file holds one document per line (the ``"text"`` field of each
JSON object: the layout of allenai/c4's files); any other file is one text. A text longer
than :data:`DOCUMENT_CHARS` is cut into consecutive documents of at most that many
characters (:func:`bounded_pieces`): books, dumps and scraped pages come as files of many
megabytes, and the stream pipeline tokenizes a document whole for the one row (lane) that
reads it. The local TFDS builder (:mod:`gift_jax.data.builder`) writes these documents as
records; ``data.pipeline='auto'`` reads the corpus's size here (:func:`corpus_bytes`) without
importing TFDS.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator

from gift_jax.data.errors import DataError

#: Files of one JSON document per line (``{"text": ...}``; allenai/c4's ``*.json.gz``).
JSON_LINES = (".jsonl", ".jsonl.gz", ".json.gz")
#: The longest document of a ``text:DIR`` corpus, in characters (32 Ki: about 8 k subword
#: tokens, several windows of any config's ``seq_len``); longer texts are cut
#: (:func:`bounded_pieces`).
DOCUMENT_CHARS = 1 << 15
def list_text_files(directory: str) -> list[str]:
    """Returns the sorted relative paths of the non-empty, non-hidden regular files under
    ``directory``.

    Args:
      directory: the text directory, searched recursively; hidden directories are skipped.

    Returns:
      The paths relative to ``directory`` of its non-empty, non-hidden regular files, sorted.

    Raises:
      DataError: ``directory`` does not exist (or is not a directory).
    """
    if not os.path.isdir(directory):
        raise DataError(f"--data text:DIR: directory {directory!r} does not exist")
    files = []
    for root, dirs, names in os.walk(directory):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            path = os.path.join(root, name)
            if not name.startswith(".") and os.path.isfile(path) and os.path.getsize(path):
                files.append(os.path.relpath(path, directory))
    return sorted(files)


def corpus_bytes(directory: str) -> int | None:
    """The bytes of a ``text:DIR`` corpus's files (what its documents are made of), from the
    file system alone.

    Args:
      directory: the text directory.

    Returns:
      The summed sizes of :func:`list_text_files`, or ``None`` where ``directory`` does not
      exist (the data pipeline reports that when it opens the corpus).
    """
    try:
        files = list_text_files(directory)
    except DataError:
        return None
    return sum(os.path.getsize(os.path.join(directory, f)) for f in files)


def bounded_pieces(text: str, limit: int | None = None) -> list[str]:
    """Cuts ``text`` into consecutive pieces of at most ``limit`` characters.

    Each cut falls after the last blank line (``"\\n\\n"``) in the piece's first ``limit``
    characters, else after its last line break, else after its last space, else at ``limit``;
    a cut that would leave a piece under a quarter of ``limit`` moves on to the next kind, so
    one short paragraph does not make a short document. Nothing is dropped or changed:
    ``"".join(bounded_pieces(t)) == t``.

    Args:
      text: the text of one file or JSON line.
      limit: the longest piece, in characters (``>= 4``); ``None``: :data:`DOCUMENT_CHARS`.

    Returns:
      The pieces (``[text]`` when it is not longer than ``limit``; ``[]`` for ``""``).
    """
    limit = DOCUMENT_CHARS if limit is None else limit
    pieces, start, n = [], 0, len(text)
    while n - start > limit:
        window_end = start + limit
        cut = -1
        for separator in ("\n\n", "\n", " "):
            at = text.rfind(separator, start + limit // 4, window_end)
            if at >= 0:
                cut = at + len(separator)
                break
        cut = window_end if cut < 0 else cut
        pieces.append(text[start:cut])
        start = cut
    if start < n:
        pieces.append(text[start:])
    return pieces


def file_documents(directory: str, rel: str) -> Iterator[tuple[str, str]]:
    """``(id, text)`` of each document of one corpus file, in file order.

    Args:
      directory: the text directory.
      rel: the file's path relative to ``directory``.

    Yields:
      For a JSON-lines file (:data:`JSON_LINES`), each line's ``"text"``; for any other file,
      its text. A text longer than :data:`DOCUMENT_CHARS` comes as its
      :func:`bounded_pieces`, ids ``ID@0``, ``ID@1``, ...; otherwise whole, id ``ID``
      (``rel``, or ``rel:LINE`` for a JSON line).

    Raises:
      DataError: a JSON line that is not an object with a ``"text"`` field.
    """
    path = os.path.join(directory, rel)
    if rel.endswith(JSON_LINES):  # one document per line, C4's raw layout
        texts = _json_lines(path, rel)
    else:
        with open(path, "rb") as f:
            texts = [(rel, f.read().decode("utf-8", errors="replace").replace("\x00", ""))]
    for doc_id, text in texts:
        pieces = bounded_pieces(text)
        if len(pieces) == 1:
            yield doc_id, pieces[0]
        else:
            yield from ((f"{doc_id}@{k}", piece) for k, piece in enumerate(pieces))


def _json_lines(path: str, rel: str) -> Iterator[tuple[str, str]]:
    """``(rel:LINE, text)`` of each JSON line of ``path`` (its ``"text"`` field)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (ValueError, KeyError, TypeError):
                raise DataError(f"--data text:DIR: {path} line {number} is not a JSON object "
                                f'with a "text" field ({", ".join(JSON_LINES)} files hold one '
                                "document per line)") from None
            yield f"{rel}:{number}", str(text).replace("\x00", "")
