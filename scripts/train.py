"""Train a Llama data-parallel with faithful low-precision gradient communication.

    python scripts/train.py --config configs/tiny.py --workdir /tmp/run \
        --config.comm.codec=fp8_e4m3 --config.comm.method=gift --config.train.num_steps=100 \
        [--resume]

Any config field can be overridden with ``--config.<group>.<field>=<value>``; communication is
``comm.codec`` (fp32 | bf16 | fp8_e4m3 | fp8_e5m2 | mxfp8 | nvfp4) + ``comm.method`` (none |
gift | plumage). ``--tokenizer`` sets ``data.tokenizer``: ``byte``, a SentencePiece ``PATH.model``,
a Hugging Face ``PATH/tokenizer.json``, or ``spm:N`` / ``bpe:N`` trained on the train split
(``model.vocab_size`` must be its vocabulary padded to a multiple of 128). Multi-host: pass
``--coordinator_address HOST:PORT --num_processes N --process_id I`` (or set
``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``) on every process.
Bad settings end with one ``error:`` line naming the setting and what is allowed.
"""

from __future__ import annotations

import argparse
import logging
import sys


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[tuple[str, str]]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="config file defining get_config()")
    parser.add_argument("--workdir", default=None, help="checkpoints, metrics, summary")
    parser.add_argument("--data", default=None, help="corpus spec (default: data.source)")
    parser.add_argument("--data_dir", default=None, help="where the corpus lives")
    parser.add_argument("--tokenizer", default=None,
                        help="data.tokenizer: byte | PATH.model | PATH/tokenizer.json | spm:N | "
                             "bpe:N (default: the config's)")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    parser.add_argument("--coordinator_address", default=None, help="HOST:PORT of process 0")
    parser.add_argument("--num_processes", type=int, default=None)
    parser.add_argument("--process_id", type=int, default=None)
    parser.add_argument("--no_progress", action="store_true", help="hide the progress bar")
    args, rest = parser.parse_known_args(argv)
    overrides: list[tuple[str, str]] = []
    i = 0
    while i < len(rest):
        item = rest[i]
        if not item.startswith("--config."):
            parser.error(f"unrecognized argument {item!r}")
        name, eq, value = item[len("--config."):].partition("=")
        if not eq:
            if i + 1 >= len(rest):
                parser.error(f"{item} needs a value")
            value, i = rest[i + 1], i + 1
        overrides.append((name, value))
        i += 1
    if args.tokenizer is not None:
        overrides.append(("data.tokenizer", args.tokenizer))
    return args, overrides


def main(argv: list[str] | None = None) -> int:
    args, overrides = _parse(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax's per-save chatter

    from gift_jax.training import initialize_distributed
    from gift_jax.training.config import (
        ConfigError,
        apply_overrides,
        complete_config,
        load_config,
    )

    try:
        config = load_config(args.config)
        config = apply_overrides(complete_config(config), overrides)
        initialize_distributed(args.coordinator_address, args.num_processes, args.process_id)

        from gift_jax.training import CheckpointMismatchError, train

        try:
            from gift_jax.data import DataError
        except ImportError:  # the data pipeline is optional for injected batches
            DataError = ConfigError

        try:
            train(config, args.workdir, resume=args.resume, data=args.data,
                  data_dir=args.data_dir, show_progress=not args.no_progress)
        except (CheckpointMismatchError, DataError) as e:
            raise ConfigError(str(e)) from e
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(f"stopped: {e}", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
