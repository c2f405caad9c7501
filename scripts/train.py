"""Train a Llama data-parallel with faithful low-precision gradient communication.

    python scripts/train.py --config configs/tiny.py --workdir /tmp/run \
        --config.comm.codec=fp8_e4m3 --config.comm.method=gift --config.train.num_steps=100 \
        [--resume[=auto]] [--stop_after N]

Any config field can be overridden with ``--config.<group>.<field>=<value>``; communication is
``comm.codec`` (fp32 | bf16 | fp8_e4m3 | fp8_e5m2 | mxfp8 | nvfp4 | int8) + ``comm.method`` (none |
gift | plumage). ``--tokenizer`` sets ``data.tokenizer``: ``byte``, a SentencePiece ``PATH.model``,
a Hugging Face ``PATH/tokenizer.json``, or ``spm:N`` / ``bpe:N`` trained on the train split
(``model.vocab_size`` must be its vocabulary padded to a multiple of 128). Multi-host: pass
``--coordinator_address HOST:PORT --num_processes N --process_id I`` (or set
``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``) on every process, or
``--coordinator_address auto`` where JAX detects the cluster (SLURM, Open MPI, TPU pods).
Sharded training: ``--config.mesh.data/fsdp/tensor`` (docs/api/training.md).
On a CPU host the run is data-parallel over ``--cpu_devices`` simulated devices (8, as the
demo; an ``XLA_FLAGS`` setting ``--xla_force_host_platform_device_count`` wins): on one device
there is nothing to communicate. Bad settings end with one ``error:`` line naming the setting
and what is allowed. SIGTERM (a preemption notice) or Ctrl-C: every process finishes its step,
checkpoints it, prints one ``stopped:`` line naming the step and exits 0 (130 after a Ctrl-C);
``--resume`` continues bit-exactly.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import sys

#: What Ctrl-C reports when it stopped the run before the trainer could write a checkpoint.
NOT_SAVED = ("interrupted with no checkpoint written by this run (before the first step, or by "
             "a second Ctrl-C)")


def _positive(text: str) -> int:
    """An argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return value


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[tuple[str, str]]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True,
                        help="config file defining get_config(), or the name of one in "
                             "configs/ (tiny, llama_1b, ...)")
    parser.add_argument("--workdir", default=None, help="checkpoints, metrics, summary")
    parser.add_argument("--data", default=None, help="corpus spec (default: data.source)")
    parser.add_argument("--data_dir", default=None, help="where the corpus lives")
    parser.add_argument("--tokenizer", default=None,
                        help="data.tokenizer: byte | PATH.model | PATH/tokenizer.json | spm:N | "
                             "bpe:N (default: the config's)")
    parser.add_argument("--resume", nargs="?", const="yes", default="no",
                        choices=("yes", "auto", "no"),
                        help="continue from the last checkpoint (an error if there is none); "
                             "--resume=auto: continue if there is one, else start fresh")
    parser.add_argument("--stop_after", type=int, default=None,
                        help="stop after N steps of this call (checkpoint written; continue "
                             "with --resume)")
    parser.add_argument("--coordinator_address", default=None,
                        help="HOST:PORT of process 0, or 'auto' (JAX detects the cluster)")
    parser.add_argument("--num_processes", type=int, default=None)
    parser.add_argument("--process_id", type=int, default=None)
    parser.add_argument("--no_progress", action="store_true", help="hide the progress bar")
    parser.add_argument("--cpu_devices", type=_positive, default=8,
                        help="simulated data-parallel devices when JAX runs on the CPU "
                             "(default 8; ignored on GPU/TPU and when XLA_FLAGS sets "
                             "--xla_force_host_platform_device_count)")
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


_RESUME = {"yes": True, "auto": "auto", "no": False}


def main(argv: list[str] | None = None) -> int:
    args, overrides = _parse(sys.argv[1:] if argv is None else argv)
    if args.stop_after is not None and args.stop_after < 1:
        print(f"error: --stop_after={args.stop_after} must be a positive number of steps",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax's per-save chatter
    # "Unable to initialize backend 'tpu'" on every run without a TPU
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)

    from gift_jax.utils.cpu_devices import simulate_cpu_devices

    simulate_cpu_devices(args.cpu_devices)

    from gift_jax.training import (
        Preempted,
        TrainingStalledError,
        initialize_distributed,
    )
    from gift_jax.training.config import (
        ConfigError,
        apply_overrides,
        complete_config,
        load_config,
    )

    try:
        config = load_config(args.config, pathlib.Path(__file__).resolve().parents[1] / "configs")
        config = apply_overrides(complete_config(config), overrides)
        initialize_distributed(args.coordinator_address, args.num_processes, args.process_id)

        from gift_jax.training import CheckpointMismatchError, train

        try:
            from gift_jax.data import DataError
        except ImportError:  # the data pipeline is optional for injected batches
            DataError = ConfigError

        try:
            train(config, args.workdir, resume=_RESUME[args.resume], data=args.data,
                  data_dir=args.data_dir, stop_after=args.stop_after,
                  show_progress=not args.no_progress)
        except (CheckpointMismatchError, DataError) as e:
            raise ConfigError(str(e)) from e
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingStalledError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Preempted as e:  # SIGTERM (a preemption notice) or SIGINT: checkpoint written
        print(f"stopped: {e}", file=sys.stderr)
        return 130 if e.signal_name == "SIGINT" else 0
    except KeyboardInterrupt as e:
        print(f"stopped: {str(e) or NOT_SAVED}", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
