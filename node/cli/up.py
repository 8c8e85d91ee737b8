"""``skippipe up``: train a tiny model on a local swarm, with no flags needed.

The command line only: the runners are in :mod:`node.cli.up_runners` (real daemons by default,
``--in-process`` for the in-process harness).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import pathlib
import signal

from node.cli.emulation_args import add_emulation_arguments, emulation_from_args
from node.spec import TrainSpec
from node.cli.run_args import MODEL_DATA_FIELDS, PRECISION_WIRE_FIELDS, add_run_arguments
from node.cli.validate import int_range
from node.cli.up_runners import (DEFAULT_DATA_NODES, DEFAULT_REPLICAS, UP_SPEC, UpOptions, _compute_config, run_up,
                                 run_up_swarm)

__all__ = ["register"]


def _print_summary(summary: dict, out: str) -> None:
    print(f"done: {summary['iterations']} iterations on {summary['nodes']} nodes in {summary['wall_s']:.1f} s "
          f"(startup {summary['startup_s']:.1f} s)")
    print(f"  train loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f};  validation loss (full model) "
          f"{summary['val_loss_before']:.4f} -> {summary['val_loss_after']:.4f}")
    print(f"  {summary['tokens_per_s']:,.0f} tokens/s, {summary['mean_iteration_s']:.2f} s per iteration")
    print(f"  loss curve: {summary['loss_png']}  summary: {pathlib.Path(out) / 'summary.json'}")


def _handler(args: argparse.Namespace) -> int:
    # the run's flags (named as node run's) into one spec, up's defaults for the rest; the local swarm's own
    opts = UpOptions(spec=TrainSpec.from_args(args, base=UP_SPEC), out=args.out, data_nodes=args.data_nodes,
                     replicas=args.replicas, reorder=not args.no_reorder, scheduler=args.scheduler, quiet=args.quiet,
                     in_process=args.in_process, emulation=emulation_from_args(args, require_location=False))
    _compute_config(opts)  # an unusable --device/--precision/--wire: one error line before anything starts
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not opts.in_process:
        def on_term(signum, frame):
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGTERM, on_term)
        try:
            summary = run_up_swarm(opts)
        finally:
            signal.signal(signal.SIGTERM, previous)
        _print_summary(summary, args.out)
        return 0
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    summary = runner(run_up(opts))
    _print_summary(summary, args.out)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "up", help="train a tiny model on a local swarm (no flags needed)",
        description="Start a local swarm on 127.0.0.1 (bootstrap + data nodes + stage replicas), train the tiny "
                    "model on Shakespeare with stage skipping, write a loss curve and a summary, stop cleanly.")
    # the run's flags as node run declares them, with up's defaults (UP_SPEC)
    add_run_arguments(p, ("iterations",), UP_SPEC)
    p.add_argument("--out", default="skippipe-up", help="output folder (default ./%(default)s)")
    add_run_arguments(p, (*MODEL_DATA_FIELDS, "num_stages", "device", *PRECISION_WIRE_FIELDS, "branch_scaling"),
                      UP_SPEC,
                      help={"num_stages": "pipeline stages (default: the model's, 6 for the named sizes); as node run "
                                          "--num-stages", "device": "torch device of every node (auto: cuda when "
                                          "available; default {default})"})
    p.add_argument("--data-nodes", type=int_range(1, 64), default=DEFAULT_DATA_NODES)
    p.add_argument("--replicas", default=DEFAULT_REPLICAS,
                   help="replicas of stages 1..S-1, comma-separated or one number (default %(default)s)")
    add_run_arguments(p, ("path_length", "microbatches", "microbatch_size", "memory_slots", "lr", "seed",
                          "checkpoint_every", "resume"), UP_SPEC, flags={"memory_slots": "--memory"},
                      help={"path_length": "stages per microbatch incl. stage 0 (default {default}; = stages for no "
                                           "skipping)",
                            "memory_slots": "in-flight microbatches per node (node run's --memory-slots; default "
                                            "{default})",
                            "resume": "continue from the checkpoints in --out"})
    p.add_argument("--scheduler", default="skippipe", choices=["skippipe", "builtin"],
                   help="paths from the SkipPipe path scheduler (default) or a fixed round-robin of stage subsets")
    p.add_argument("--no-reorder", action="store_true", help="builtin scheduler: keep every path in stage order")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--in-process", action="store_true",
                   help="run every node in this process (the test/benchmark harness) instead of one daemon per node")
    add_emulation_arguments(p, location=False)  # nodes get the profile's locations round-robin
    p.set_defaults(func=_handler)
