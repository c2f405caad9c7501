"""Data artifacts through etils.epath with JAX-runtime coordination (gift_jax.data.storage):
built once by process 0 and written atomically, reused afterwards; storage that cannot be
reached (a path under a file, object storage without its client or credentials) is one line."""

import pytest

from gift_jax.data import DataError, get_source
from gift_jax.data.storage import cached


def test_artifact_is_built_once_atomically_and_reused(tmp_path):
    built = []

    def build(tmp):
        assert tmp.parent == tmp_path / "cache" and tmp.name.endswith(".tmp")
        built.append(tmp.name)
        tmp.write_bytes(b"model")

    path = cached(tmp_path / "cache" / "spm.model", build, "the tokenizer")
    assert path.read_bytes() == b"model" and len(built) == 1
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["spm.model"]  # no leftovers
    cached(tmp_path / "cache" / "spm.model", lambda tmp: pytest.fail("rebuilt"), "the tokenizer")


def test_unreachable_storage_is_one_line(tmp_path, gcs_bucket):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(DataError) as err:
        cached(tmp_path / "file" / "spm.model", lambda tmp: tmp.write_bytes(b""), "the tokenizer")
    assert "the tokenizer" in str(err.value) and "cannot be written" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(DataError) as err:  # a bucket this account cannot see
        get_source("tfds:c4/en", "gs://gift-jax-no-such-bucket/tfds")
    message = str(err.value)
    assert message.startswith("--data_dir 'gs://gift-jax-no-such-bucket/tfds' does not exist")
    assert "credentials" in message and "\n" not in message
