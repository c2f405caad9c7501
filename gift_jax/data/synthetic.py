"""A generated text corpus of any size, for data-pipeline benchmarks (``bench_stream.py``,
``bench_first_batch.py``).

Documents are paragraphs of sentences over a Zipf-distributed vocabulary of pronounceable
words (``s ∝ rank^-1.1``, 60 000 words of 1–4 syllables), lengths drawn like web text (a
log-normal number of sentences per document: median ≈ 14 sentences, about 1.3 kB, a long
tail), written as JSON lines (C4's raw layout: one ``{"text": ...}`` document per line, read
by the local ``text:DIR`` builder as one record each), so a subword tokenizer sees
natural-looking input: a 32 000-piece SentencePiece learns real merges on it. Deterministic
in ``seed``.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

_ONSETS = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v",
           "w", "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "st", "str", "th", "tr"]
_NUCLEI = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "oo", "ou", "ie"]
_CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "rt", "st", "ck", "x"]


def vocabulary(size: int = 60_000, seed: int = 0) -> list[str]:
    """``size`` distinct pronounceable words, the most frequent (shortest) first.

    Args:
      size: the number of words.
      seed: the random seed.

    Returns:
      The words (1–4 syllables each), sorted by length (stable among equal lengths), i.e. in
      the Zipf rank order :func:`documents` uses.
    """
    rng = np.random.default_rng(seed)
    words: dict[str, None] = {}
    while len(words) < size:
        syllables = 1 + min(3, int(rng.exponential(0.9)))
        word = "".join(_ONSETS[rng.integers(len(_ONSETS))] + _NUCLEI[rng.integers(len(_NUCLEI))]
                       + _CODAS[rng.integers(len(_CODAS))] for _ in range(syllables))
        words.setdefault(word)
    return sorted(words, key=len)


def documents(count: int, seed: int = 0, words: list[str] | None = None) -> list[str]:
    """``count`` generated documents (see the module doc).

    Args:
      count: the number of documents.
      seed: the random seed (the words use ``seed``, the text ``seed + 1``).
      words: the vocabulary in rank order; ``None``: ``vocabulary(seed=seed)``.

    Returns:
      The documents: sentences of 3–60 words, capitalized, ending in ``.``, ``?`` or ``!``
      and joined by spaces.
    """
    words = vocabulary(seed=seed) if words is None else words
    rng = np.random.default_rng(seed + 1)
    cdf = np.cumsum(np.arange(1, len(words) + 1) ** -1.1)
    lexicon = np.asarray(words, dtype=object)
    sentences = np.maximum(1, rng.lognormal(np.log(14), 0.9, count).astype(int))
    lengths = np.clip(rng.normal(16, 7, int(sentences.sum())).astype(int), 3, 60)
    tokens = lexicon[np.searchsorted(cdf, rng.random(int(lengths.sum())) * cdf[-1])]
    ends = rng.choice(np.asarray([". ", ". ", "? ", "! "], dtype=object), len(lengths))
    out, word, sentence = [], 0, 0
    for n_sentences in sentences:
        parts = []
        for n in lengths[sentence:sentence + n_sentences]:
            text = " ".join(tokens[word:word + n])
            parts.append(text[:1].upper() + text[1:] + ends[sentence + len(parts)])
            word += n
        sentence += n_sentences
        out.append("".join(parts).rstrip())
    return out


def write_corpus(directory: str | pathlib.Path, total_bytes: int, *, seed: int = 0,
                 file_bytes: int = 64 << 20) -> list[pathlib.Path]:
    """Writes at least ``total_bytes`` of generated documents as ``.jsonl`` files of about
    ``file_bytes`` under ``directory``; returns them. Files already there are kept (rerunning
    adds nothing). Each file is written under a hidden temporary name (``.part-NNNNN.jsonl.tmp``)
    and renamed when complete, so an interrupted run leaves nothing a ``text:DIR`` corpus reads.

    Args:
      directory: the output directory (created if missing).
      total_bytes: the least total size of the files, in bytes (existing files count).
      seed: the random seed (file ``i``'s documents depend on ``seed + 1000 * i``).
      file_bytes: each new file's least size, in bytes (filled in batches of 512 documents).

    Returns:
      The paths ``directory/part-NNNNN.jsonl``, in order.
    """
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    words = vocabulary(seed=seed)
    files, written, index = [], 0, 0
    while written < total_bytes:
        path = directory / f"part-{index:05d}.jsonl"
        if not path.exists():
            chunks, size, batch = [], 0, 0
            while size < file_bytes:
                docs = documents(512, seed=seed + 1000 * index + batch, words=words)
                text = "".join(json.dumps({"text": d}) + "\n" for d in docs)
                chunks.append(text)
                size += len(text.encode())
                batch += 1
            # hidden (a leading dot): a text:DIR corpus skips it if a run stops before the
            # rename (gift_jax.data.text_files.list_text_files)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text("".join(chunks))
            tmp.rename(path)
        files.append(path)
        written += path.stat().st_size
        index += 1
    return files


def write_books(directory: str | pathlib.Path, total_bytes: int, *, seed: int = 0,
                file_bytes: int = 5 << 20) -> list[pathlib.Path]:
    """Writes at least ``total_bytes`` of generated documents as plain-text "books" of about
    ``file_bytes`` each under ``directory`` (``book-NNNNN.txt``: the documents as paragraphs
    separated by blank lines, the layout of books, dumps and scraped text); returns them.
    Files already there are kept; each is written under a hidden temporary name first, as in
    :func:`write_corpus`.

    Args:
      directory: the output directory (created if missing).
      total_bytes: the least total size of the files, in bytes (existing files count).
      seed: the random seed (file ``i``'s paragraphs depend on ``seed + 1000 * i``).
      file_bytes: each new file's least size, in bytes (filled in batches of 512 paragraphs).

    Returns:
      The paths ``directory/book-NNNNN.txt``, in order.
    """
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    words = vocabulary(seed=seed)
    files, written, index = [], 0, 0
    while written < total_bytes:
        path = directory / f"book-{index:05d}.txt"
        if not path.exists():
            paragraphs, size, batch = [], 0, 0
            while size < file_bytes:
                docs = documents(512, seed=seed + 1000 * index + batch, words=words)
                paragraphs += docs
                size += sum(len(d.encode()) + 2 for d in docs)
                batch += 1
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text("\n\n".join(paragraphs) + "\n")
            tmp.rename(path)
        files.append(path)
        written += path.stat().st_size
        index += 1
    return files
