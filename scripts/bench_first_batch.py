"""Time to the first training batch with the default ``data.pipeline`` at several corpus sizes.

For each --megabytes size: a generated JSON-lines corpus (``gift_jax.data.synthetic``) and its
TFDS ArrayRecord copy under --out (made once, reused; the one-time preparation of a
``text:DIR`` corpus, like C4's TFDS build), the tokenizer trained once (its 20 MB prefix is the
same work at every size), then for each of --pipelines the seconds from nothing to the first
batch of ``[--batch, --seq_len + 1]`` tokens, as the trainer resolves the setting
(``auto``, the default: ``stream`` for a ``text:`` corpus) and, for comparison, ``grid``
(its whole train split tokenized first; cached after its first run, so measured once per
size). Every pipeline starts from a fresh process state; the tokenizer load is included.

    python scripts/bench_first_batch.py --out /tmp/first_batch               # 30 and 300 MB
    python scripts/bench_first_batch.py --out /tmp/fb --megabytes 3 --pipelines auto
"""

import argparse
import json
import pathlib
import sys
import time

CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"


def first_batch_s(spec: str, data_dir: str, tokenizer: str, pipeline: str, batch: int,
                  seq_len: int) -> tuple[str, float]:
    """``(resolved pipeline, seconds to the first batch)`` of ``spec`` under ``pipeline``.

    Args:
      spec: the ``--data`` corpus.
      data_dir: ``--data_dir``.
      tokenizer: ``data.tokenizer``.
      pipeline: ``data.pipeline`` (``auto`` is resolved as the trainer resolves it).
      batch: sequences per batch.
      seq_len: tokens per sequence (windows of ``seq_len + 1``).

    Returns:
      The pipeline that ran and the seconds from building the batch function to the first
      batch.
    """
    from gift_jax.training.config import (
        complete_config,
        load_config,
        resolve_data_pipeline,
        set_fields,
    )
    from gift_jax.training.loop import data_batches

    config = set_fields(complete_config(load_config("tiny", CONFIGS)),
                        {"data.source": spec, "data.pipeline": pipeline})
    resolve_data_pipeline(config)
    start = time.perf_counter()
    batches, _, _ = data_batches(spec, data_dir, tokenizer, config.data.pipeline, -1, "")
    it = batches("train", batch, seq_len, seed=0, start_step=0, process_index=0,
                 process_count=1)
    next(it)
    seconds = time.perf_counter() - start
    close = getattr(it, "close", None)
    if close is not None:
        close()
    return config.data.pipeline, seconds


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="corpora, TFDS copies and results go here")
    ap.add_argument("--megabytes", default="30,300", help="comma list of corpus sizes")
    ap.add_argument("--tokenizer", default="spm:1024")
    ap.add_argument("--pipelines", default="auto,grid", help="comma list of data.pipeline")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq_len", type=int, default=128)
    args = ap.parse_args(argv)

    from gift_jax.data import get_source, get_tokenizer
    from gift_jax.data.source import artifact_dir
    from gift_jax.data.synthetic import write_corpus

    out = pathlib.Path(args.out).resolve()
    rows = []
    for mb in (int(x) for x in args.megabytes.split(",")):
        root = out / f"{mb}mb"
        total = mb << 20
        start = time.perf_counter()
        write_corpus(root / "corpus", total, file_bytes=min(64 << 20, total // 16))
        spec, data_dir = f"text:{root / 'corpus'}", str(root / "tfds")
        source = get_source(spec, data_dir)  # the ArrayRecord copy, once
        # trained once: the same 20 MB prefix at every size
        get_tokenizer(args.tokenizer, source, artifact_dir(source))
        prepared = time.perf_counter() - start
        for pipeline in args.pipelines.split(","):
            ran, seconds = first_batch_s(spec, data_dir, args.tokenizer, pipeline, args.batch,
                                         args.seq_len)
            row = {"megabytes": mb, "pipeline": pipeline, "ran": ran,
                   "first_batch_s": round(seconds, 1), "prepare_s": round(prepared, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    (out / "first_batch.json").write_text(json.dumps(
        {"command": "python scripts/bench_first_batch.py " + " ".join(
            argv if argv is not None else sys.argv[1:]), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
