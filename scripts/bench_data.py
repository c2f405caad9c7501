"""Data-pipeline tokens/s with each tokenizer vs the train step's tokens/s (tokenizer issue).

For each ``--tokenizers`` entry the corpus is prepared and tokenized first (not timed), then:

* pipeline: training batches of the config's ``[global_batch, seq_len + 1]`` from the
  tokenized stream (:func:`gift_jax.data.throughput.pipeline_tokens_per_s`) -- the per-step
  host cost of the data pipeline;
* on-the-fly tokenize: the tokenization pass over the validation split
  (:func:`gift_jax.data.throughput.tokenize_tokens_per_s`) -- what a step would cost if text
  were tokenized while training instead of once at prepare time;

and the config's whole train step (:func:`gift_jax.apps.step_timing.step_times`; median of
``--repeats``) at ``--train_batch`` sequences (default: the config's global batch; on a CPU
pass a small one: tokens/s per sequence barely depends on it there).

    python scripts/bench_data.py --out /tmp/bench_data --train_batch 8 --repeats 3
    python scripts/bench_data.py --config tiny --tokenizers byte,spm:512 --out /tmp/x
"""

import argparse
import json
import pathlib
import sys

from gift_jax.utils.cpu_devices import simulate_cpu_devices

simulate_cpu_devices(8)  # a data-parallel mesh on a CPU host (an XLA_FLAGS count wins)

import jax  # noqa: E402

from gift_jax.apps.step_timing import step_times  # noqa: E402
from gift_jax.data import get_source  # noqa: E402
from gift_jax.data.throughput import pipeline_tokens_per_s, tokenize_tokens_per_s  # noqa: E402
from gift_jax.training.config import (  # noqa: E402
    apply_overrides,
    complete_config,
    load_config,
)
from gift_jax.training.mesh import make_mesh  # noqa: E402

CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default="llama_60m", help="config name under configs/ or a path")
    ap.add_argument("--data", default=None, help="corpus spec (default: the config's)")
    ap.add_argument("--data_dir", default=None)
    ap.add_argument("--tokenizers", default="byte,spm:32000",
                    help="comma list of data.tokenizer values")
    ap.add_argument("--batches", type=int, default=20, help="timed pipeline batches")
    ap.add_argument("--train_batch", type=int, default=None,
                    help="global batch of the timed train step (default: the config's)")
    ap.add_argument("--repeats", type=int, default=3, help="timed train steps")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="config override (repeatable)")
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python " + " ".join(["scripts/bench_data.py", *(argv or sys.argv[1:])])
    sets = [tuple(kv.split("=", 1)) for kv in args.set]
    config = apply_overrides(complete_config(load_config(args.config, CONFIGS)), sets)
    tc, data = config.train, args.data or config.data.source

    train_batch = args.train_batch or tc.global_batch_size
    step_config = apply_overrides(config, [("train.global_batch_size", str(train_batch))])
    row = step_times({"train": step_config}, make_mesh(), repeats=args.repeats)[0]
    step_tps = train_batch * tc.seq_len / row["ordinary_median"]

    md = [f"<!-- {command} -->",
          f"platform {jax.default_backend()}, {len(jax.devices())} devices, config "
          f"`{args.config}`, data `{data}`; pipeline batches [{tc.global_batch_size}, "
          f"{tc.seq_len + 1}]; train step at global batch {train_batch}: "
          f"{1e3 * row['ordinary_median']:.0f} ms = {step_tps:,.0f} tokens/s", "",
          "| tokenizer | vocab | pipeline tokens/s | on-the-fly tokenize tokens/s | "
          "train step tokens/s | pipeline / step | tokenize / step |",
          "|---|---|---|---|---|---|---|"]
    result = {"command": command, "train_step": {**row, "tokens_per_s": step_tps,
                                                 "global_batch": train_batch}, "rows": []}
    for name in args.tokenizers.split(","):
        source = get_source(data, args.data_dir, tokenizer=name)
        source.num_tokens("train")  # prepare and tokenize, untimed
        tokenizer = getattr(source, "tokenizer", None)
        byte_source = getattr(source, "source", source)
        if tokenizer is None:
            from gift_jax.data import ByteTokenizer

            tokenizer = ByteTokenizer()
        pipe = pipeline_tokens_per_s(source, tc.global_batch_size, tc.seq_len,
                                     batches=args.batches, seed=config.data.shuffle_seed)
        tok, _ = tokenize_tokens_per_s(byte_source, tokenizer)
        r = {"tokenizer": name, "vocab": source.vocab_size, "pipeline_tokens_per_s": pipe,
             "tokenize_tokens_per_s": tok, "pipeline_over_step": pipe / step_tps,
             "tokenize_over_step": tok / step_tps}
        result["rows"].append(r)
        md.append(f"| {name} | {r['vocab']} | {pipe:,.0f} | {tok:,.0f} | {step_tps:,.0f} | "
                  f"{r['pipeline_over_step']:.1f} | {r['tokenize_over_step']:.2f} |")
        print(md[-1], flush=True)
    (out / "bench_data.md").write_text("\n".join(md) + "\n")
    (out / "bench_data.json").write_text(json.dumps(result, indent=1))
    print("\n".join(md))


if __name__ == "__main__":
    main()
