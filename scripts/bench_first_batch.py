"""Time to the first training batch, and to step 2 of the trainer, with the default
``data.pipeline`` at several corpus sizes; the pipelines' steady-state tokens/s.

For each --megabytes size: a generated corpus (``gift_jax.data.synthetic``) under --out, made
once and reused: --layout ``books`` (the default) writes plain-text files of
--file_megabytes each (paragraphs separated by blank lines: books, dumps, scraped text),
``jsonl`` JSON-lines files of one short document per line (allenai/c4's layout). Then, per
size:

* ``to_step_2_s`` (``--to_step 2``): the trainer run as a user runs it, in a fresh data
  directory: ``scripts/train.py --config tiny --data text:DIR --tokenizer --stop_after 2``,
  8 simulated devices, timed from start to exit (the corpus's one-time ArrayRecord copy, the
  tokenizer's training, compiling, two steps, evaluation and a checkpoint included); the
  pipeline ``auto`` chose is read from its log;
* ``trainer_tokens_per_s``: the same trainer's steady-state training tokens/s over
  --train_steps steps with ``data.pipeline=stream`` and ``grid`` (the corpus and tokenizer
  made by the run above; the mean of ``metrics.jsonl``'s windows in the run's second half,
  after the stream's workers have started): whether the pipeline holds the step back;
* for each of --pipelines: seconds from nothing to the first batch of ``[--batch, --seq_len
  + 1]`` tokens, as the trainer resolves the setting (``auto``), the ArrayRecord copy and the
  tokenizer already made, in a fresh process state; and the pipeline's own tokens/s over
  --batches batches after its first (``stream`` with the trainer's default worker count, the
  host's cores, tokenizing as it goes; ``grid`` reading its tokenized stream).

    python scripts/bench_first_batch.py --out /tmp/first_batch               # 30 and 300 MB
    python scripts/bench_first_batch.py --out /tmp/fb1 --megabytes 50 --file_megabytes 50
    python scripts/bench_first_batch.py --out /tmp/fb --megabytes 3 --pipelines auto --to_step 0
"""

import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"


def _batches(spec: str, data_dir: str, tokenizer: str, pipeline: str):
    """``(resolved pipeline, batch function)`` as the trainer resolves ``pipeline``."""
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
    batches, _, _ = data_batches(spec, data_dir, tokenizer, config.data.pipeline, -1, "")
    return config.data.pipeline, batches


def first_batch_s(spec: str, data_dir: str, tokenizer: str, pipeline: str, batch: int,
                  seq_len: int, timed_batches: int = 0) -> tuple[str, float, float | None]:
    """``(resolved pipeline, seconds to the first batch, steady tokens/s)`` of ``spec``.

    Args:
      spec: the ``--data`` corpus.
      data_dir: ``--data_dir``.
      tokenizer: ``data.tokenizer``.
      pipeline: ``data.pipeline`` (``auto`` is resolved as the trainer resolves it).
      batch: sequences per batch.
      seq_len: tokens per sequence (windows of ``seq_len + 1``).
      timed_batches: batches timed after the first for the steady-state rate (0: none).

    Returns:
      The pipeline that ran, the seconds from building the batch function to the first
      batch, and the training tokens per second of the timed batches (``None`` without).
    """
    start = time.perf_counter()
    ran, batches = _batches(spec, data_dir, tokenizer, pipeline)
    it = batches("train", batch, seq_len, seed=0, start_step=0, process_index=0,
                 process_count=1)
    next(it)
    seconds = time.perf_counter() - start
    rate = None
    if timed_batches:
        t0 = time.perf_counter()
        for _ in range(timed_batches):
            next(it)
        rate = batch * seq_len * timed_batches / (time.perf_counter() - t0)
    close = getattr(it, "close", None)
    if close is not None:
        close()
    return ran, seconds, rate


def run_trainer(spec: str, tokenizer: str, steps: int, work: pathlib.Path, *,
                fresh: bool, pipeline: str = "auto") -> tuple[float, str, list[dict]]:
    """``(seconds, pipeline, train records of metrics.jsonl)`` of ``scripts/train.py --config
    tiny`` on ``spec`` run to step ``steps`` (evaluation at the end only) in a new workdir
    under ``work``;
    ``fresh``: from a new data directory (the corpus's ArrayRecord copy and the tokenizer made
    in the run)."""
    vocab = int(tokenizer.partition(":")[2] or 256)
    shutil.rmtree(work / "run", ignore_errors=True)
    if fresh:
        shutil.rmtree(work / "tfds", ignore_errors=True)
    cmd = [sys.executable, str(ROOT / "scripts" / "train.py"), "--config", "tiny",
           "--data", spec, "--data_dir", str(work / "tfds"), "--tokenizer", tokenizer,
           f"--config.model.vocab_size={vocab}", f"--config.data.pipeline={pipeline}",
           "--config.train.eval_every=0", "--stop_after", str(steps),
           "--workdir", str(work / "run"), "--no_progress"]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"train.py failed ({done.returncode}): {done.stderr[-2000:]}")
    chosen = re.search(r"data\.pipeline=auto -> '(\w+)'", done.stdout + done.stderr)
    records = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text()
               .splitlines() if '"tokens_per_s"' in line]
    return seconds, chosen.group(1) if chosen else pipeline, records


def steady_tokens_per_s(records: list[dict], steps: int) -> float:
    """The mean training tokens/s of the logged windows in the second half of a run."""
    late = [r["tokens_per_s"] for r in records if r["step"] > steps // 2]
    return sum(late) / max(len(late), 1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="corpora, TFDS copies and results go here")
    ap.add_argument("--megabytes", default="30,300", help="comma list of corpus sizes")
    ap.add_argument("--layout", choices=("books", "jsonl"), default="books")
    ap.add_argument("--file_megabytes", type=float, default=5.0, help="size of each file")
    ap.add_argument("--tokenizer", default="spm:1024")
    ap.add_argument("--pipelines", default="auto,grid,stream",
                    help="comma list of data.pipeline")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq_len", type=int, default=128)
    ap.add_argument("--batches", type=int, default=400, help="timed batches after the first")
    ap.add_argument("--to_step", type=int, default=2, help="run the trainer to this step (0: no)")
    ap.add_argument("--train_steps", type=int, default=100,
                    help="steps of the trainer's tokens/s runs (0: none)")
    args = ap.parse_args(argv)

    from gift_jax.data import get_source, get_tokenizer
    from gift_jax.data.source import artifact_dir
    from gift_jax.data.synthetic import write_books, write_corpus

    out = pathlib.Path(args.out).resolve()
    write = write_books if args.layout == "books" else write_corpus
    rows = []
    for mb in (float(x) for x in args.megabytes.split(",")):
        root = out / f"{mb:g}mb_{args.layout}_{args.file_megabytes:g}"
        total = int(mb * (1 << 20))
        write(root / "corpus", total, file_bytes=int(args.file_megabytes * (1 << 20)))
        spec = f"text:{root / 'corpus'}"
        row = {"megabytes": mb, "layout": args.layout, "file_megabytes": args.file_megabytes}
        work = root / "trainer"
        if args.to_step:
            seconds, chosen, _ = run_trainer(spec, args.tokenizer, args.to_step, work,
                                             fresh=True)
            row |= {f"to_step_{args.to_step}_s": round(seconds, 1), "trainer_auto": chosen}
            print(json.dumps(row), flush=True)
        if args.train_steps:
            row["trainer_tokens_per_s"] = {
                pipeline: round(steady_tokens_per_s(run_trainer(
                    spec, args.tokenizer, args.train_steps, work, fresh=False,
                    pipeline=pipeline)[2], args.train_steps))
                for pipeline in ("stream", "grid")}
            print(json.dumps(row), flush=True)
        data_dir = str(root / "tfds")
        start = time.perf_counter()
        source = get_source(spec, data_dir)  # the ArrayRecord copy, once
        get_tokenizer(args.tokenizer, source, artifact_dir(source))  # trained once
        row["prepare_s"] = round(time.perf_counter() - start, 1)
        for pipeline in args.pipelines.split(","):
            ran, seconds, rate = first_batch_s(spec, data_dir, args.tokenizer, pipeline,
                                               args.batch, args.seq_len, args.batches)
            row[pipeline] = {"ran": ran, "first_batch_s": round(seconds, 1),
                             "tokens_per_s": round(rate)}
            print(json.dumps(row), flush=True)
        rows.append(row)
    (out / "first_batch.json").write_text(json.dumps(
        {"command": "python scripts/bench_first_batch.py " + " ".join(
            argv if argv is not None else sys.argv[1:]), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
