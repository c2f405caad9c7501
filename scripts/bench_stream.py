"""The streaming pipeline at scale (data.pipeline=stream): a generated corpus of --gigabytes of
JSON-lines text and its TFDS ArrayRecord copy, then

* time to the first batch with --tokenizer (default spm:32000) and no prior cache: training
  the tokenizer on the first 20 MB of the train split, starting the workers, reading and
  tokenizing the documents of the first batch;
* steady-state tokens/s of the pipeline per host with each --workers count, against the
  config's train step on this host (``step_times`` on one CPU device, at --train_batch
  sequences), and the pipeline's peak memory (this process and its workers);
* the same pipeline reading its ids from a complete per-shard id cache (``data.id_cache``;
  the time to build it for the whole train split in one process is reported too);
* today's grid pipeline for comparison: its first batch needs the whole train split tokenized
  (rate measured on the validation split, single process);
* arithmetic for a pod: time to the first step and the host cores the pipeline needs for
  --pod_config on --pod_chips chips (4 per host) at --mfu of the chip's --peak_tflops.

    python scripts/bench_stream.py --out /tmp/bench_stream            # 1 GB, spm:32000
    python scripts/bench_stream.py --out /tmp/s --gigabytes 0.05 --tokenizer spm:1000 --batches 2
"""

import argparse
import json
import pathlib
import shutil
import sys
import time

import jax

from gift_jax.apps.step_timing import step_times
from gift_jax.data import get_source, stream_batches
from gift_jax.data.id_cache import ShardedIds, build_shards, cache_folder
from gift_jax.data.source import artifact_dir
from gift_jax.data.stream import default_workers
from gift_jax.data.synthetic import write_corpus
from gift_jax.data.throughput import stream_tokens_per_s, tokenize_tokens_per_s
from gift_jax.data.tokenized import stream_dtype
from gift_jax.models import count_params, model_config_of
from gift_jax.training.config import apply_overrides, complete_config, load_config
from gift_jax.training.mesh import make_mesh

CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="corpus, TFDS copy and results go here")
    ap.add_argument("--gigabytes", type=float, default=1.0, help="size of the generated corpus")
    ap.add_argument("--config", default="llama_60m", help="the train step and batch shape")
    ap.add_argument("--tokenizer", default="spm:32000")
    ap.add_argument("--workers", default=f"1,2,{default_workers()}",
                    help="comma list of worker counts")
    ap.add_argument("--batches", type=int, default=10, help="timed pipeline batches")
    ap.add_argument("--train_batch", type=int, default=8, help="sequences of the timed step")
    ap.add_argument("--repeats", type=int, default=3, help="timed train steps")
    ap.add_argument("--pod_config", default="gift_llama_600m")
    ap.add_argument("--pod_chips", type=int, default=64, help="v5p-128: 64 chips, 16 hosts")
    ap.add_argument("--peak_tflops", type=float, default=459.0, help="v5p bf16 peak per chip")
    ap.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilization")
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out).resolve()
    command = "python " + " ".join(["scripts/bench_stream.py", *(argv or sys.argv[1:])])
    config = complete_config(load_config(args.config, CONFIGS))
    tc = config.train
    result = {"command": command, "host_cores": default_workers()}

    start = time.perf_counter()
    total = int(args.gigabytes * 2**30)  # in 16+ files: about 1/20 of them is validation
    files = write_corpus(out / "corpus", total, file_bytes=min(64 << 20, total // 16))
    result["corpus_bytes"] = sum(f.stat().st_size for f in files)
    result["generate_s"] = time.perf_counter() - start
    start = time.perf_counter()
    spec, data_dir = f"text:{out / 'corpus'}", str(out / "tfds")
    byte_source = get_source(spec, data_dir)  # the ArrayRecord copy (once, like C4's)
    result["prepare_s"] = time.perf_counter() - start
    result["train_documents"] = byte_source.num_docs("train")
    print(json.dumps(result), flush=True)

    # the train step first, while no worker process competes for the cores
    step_config = apply_overrides(config, [("train.global_batch_size", str(args.train_batch)),
                                           ("mesh.data", "1")])
    mesh = make_mesh(devices=jax.devices()[:1])
    row = step_times({"train": step_config}, mesh, repeats=args.repeats)[0]
    step_tps = args.train_batch * tc.seq_len / row["ordinary_median"]
    result["train_step_tokens_per_s"] = step_tps

    shutil.rmtree(artifact_dir(byte_source), ignore_errors=True)  # no prior cache
    workers = [int(w) for w in args.workers.split(",")]
    start = time.perf_counter()
    source = get_source(spec, data_dir, tokenizer=args.tokenizer)
    result["tokenizer_s"] = time.perf_counter() - start
    first = stream_batches(source, "train", tc.global_batch_size, tc.seq_len,
                           workers=max(workers))
    batch = next(first)
    result["first_batch_s"] = time.perf_counter() - start
    assert batch.shape == (tc.global_batch_size, tc.seq_len + 1)
    del first  # its worker processes end before the timed runs
    print(json.dumps(result), flush=True)

    result["rows"] = []
    for count in dict.fromkeys(workers):
        tps, peak = stream_tokens_per_s(source, tc.global_batch_size, tc.seq_len,
                                        workers=count, batches=args.batches)
        result["rows"].append({"workers": count, "tokens_per_s": tps, "peak_bytes": peak,
                               "over_step": tps / step_tps})
        print(json.dumps(result["rows"][-1]), flush=True)

    reader = source.source.reader("train")  # the id cache, built whole, then read
    cache = ShardedIds(cache_folder(str(out / "ids"), source.tokenizer, source.source,
                                    "train", len(reader)), stream_dtype(source.vocab_size))
    shutil.rmtree(cache.folder, ignore_errors=True)
    start = time.perf_counter()
    build_shards(reader, source.tokenizer, cache, list(range(cache.num_shards(len(reader)))))
    result["id_cache_build_s"] = time.perf_counter() - start
    count = max(workers)
    tps, peak = stream_tokens_per_s(source, tc.global_batch_size, tc.seq_len, workers=count,
                                    batches=args.batches, id_cache=str(out / "ids"))
    result["rows"].append({"workers": count, "id_cache": True, "tokens_per_s": tps,
                           "peak_bytes": peak, "over_step": tps / step_tps})
    print(json.dumps(result["rows"][-1]), flush=True)

    rate, tokens = tokenize_tokens_per_s(source.source, source.tokenizer)
    val_bytes = sum(len(d) for d in source.source.documents("validation"))
    train_tokens = tokens / val_bytes * (result["corpus_bytes"] - val_bytes)
    result["grid"] = {"tokenize_tokens_per_s": rate, "tokens_per_byte": tokens / val_bytes,
                      "first_batch_s": result["tokenizer_s"] + train_tokens / rate}

    pod = complete_config(load_config(args.pod_config, CONFIGS))
    step_tokens = pod.train.global_batch_size * pod.train.seq_len
    flops = 6 * count_params(model_config_of(pod.model)) * step_tokens
    step_s = flops / (args.pod_chips * args.peak_tflops * 1e12 * args.mfu)
    per_host = step_tokens / step_s / (args.pod_chips / 4)
    per_worker = max(r["tokens_per_s"] / max(r["workers"], 1) for r in result["rows"]
                     if not r.get("id_cache"))
    result["pod"] = {"config": args.pod_config, "chips": args.pod_chips, "step_s": step_s,
                     "host_tokens_per_s": per_host, "cores_needed": per_host / per_worker}
    (out / "bench_stream.json").write_text(json.dumps(result, indent=1))
    md = _markdown(result, args)
    (out / "bench_stream.md").write_text(md)
    print(md)


def _markdown(r: dict, args) -> str:
    rows = "\n".join(
        f"| {x['workers']}{' (id cache)' if x.get('id_cache') else ''} | "
        f"{x['tokens_per_s']:,.0f} | {x['over_step']:.1f} | {x['peak_bytes'] / 2**20:,.0f} |"
        for x in r["rows"])
    grid, pod = r["grid"], r["pod"]
    return f"""<!-- {r['command']} -->
Corpus: {r['corpus_bytes'] / 2**30:.2f} GiB of generated JSON lines, {r['train_documents']:,}
train documents; TFDS ArrayRecord copy prepared in {r['prepare_s']:.0f} s (once, like a C4
copy). Host: {r['host_cores']} cores. Tokenizer `{args.tokenizer}`, no prior cache.

- **Time to the first batch (stream): {r['first_batch_s']:.1f} s**, of which
  {r['tokenizer_s']:.1f} s train the tokenizer on the first 20 MB.
- Today's grid pipeline would first tokenize the whole train split: {grid['first_batch_s']:,.0f} s
  here ({grid['tokenize_tokens_per_s']:,.0f} tokens/s in one process,
  {grid['tokens_per_byte']:.3f} tokens per byte).

The id cache of the whole train split (`data.id_cache`) took {r['id_cache_build_s']:,.0f} s to
build in one process; the row marked "id cache" reads every id from it.

Train step of `{args.config}` here: {r['train_step_tokens_per_s']:,.0f} tokens/s.

| workers | pipeline tokens/s | pipeline / train step | peak MiB |
|---:|---:|---:|---:|
{rows}

A {pod['config']} run on {pod['chips']} chips ({pod['chips'] // 4} hosts) at {args.mfu:.0%} of
{args.peak_tflops:.0f} TFLOP/s per chip steps every {pod['step_s']:.2f} s and consumes
{pod['host_tokens_per_s']:,.0f} tokens/s per host: **{pod['cores_needed']:.2f} host cores** of
this pipeline per host.
"""


if __name__ == "__main__":
    main()
