"""``skippipe node run --train ...``: the trainer's flags and the service they build.

Kept apart from :mod:`node.cli.node_cmd` (the daemon's flags) so the two evolve separately;
``node_cmd`` only calls :func:`add_training_arguments` and :func:`training_services_from_args`.
Every member of a run must pass the same hyper-parameters (model, corpus, lr, seed, microbatch
size, sequence length, iterations); the trainer compares them with every member of its schedule
epoch before the first iteration and stops with a clear error if they differ (docs/training.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from node.cli.emulation_args import add_emulation_arguments, emulation_from_args
from node.errors import UserError

__all__ = ["add_training_arguments", "training_services_from_args", "DEFAULT_TRAIN_ITERATIONS"]

DEFAULT_TRAIN_ITERATIONS = 100


def add_training_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training (with --train)")
    g.add_argument("--train", action="store_true", help="run a trainer for this node's stage inside the daemon")
    g.add_argument("--model", default="tiny", choices=["tiny", "small", "500m"],
                   help="model size (its stage count follows the run's --num-stages)")
    g.add_argument("--corpus", default="shakespeare", choices=["shakespeare", "sotu"], help="data nodes' corpus")
    g.add_argument("--iterations", type=int, default=DEFAULT_TRAIN_ITERATIONS,
                   help="iterations to train in total (default %(default)s)")
    g.add_argument("--checkpoint-dir", type=Path, default=None, help="folder for this node's checkpoints")
    g.add_argument("--checkpoint-every", type=int, default=10, help="iterations between checkpoints (0 = at exit only)")
    g.add_argument("--resume", action="store_true", help="continue from the checkpoint in --checkpoint-dir")
    g.add_argument("--min-members", type=int, default=1,
                   help="start training only on a schedule epoch with at least this many members")
    g.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default 1e-3)")
    g.add_argument("--seed", type=int, default=0, help="model initialisation and data order seed")
    g.add_argument("--microbatch-size", type=int, default=8, help="sequences per microbatch")
    g.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: 64 for tiny, else the context)")
    g.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="compute precision (autocast; fp32 master weights); auto: bf16 on a GPU that supports "
                        "it, else fp32. All members of a run must use the same")
    g.add_argument("--wire", default="fp32", choices=["fp32", "bf16", "fp16", "int8"],
                   help="wire format of activations and gradients (int8: blockwise 8-bit with per-block scales); "
                        "the replicas' averaging uses the matching hivemind compression. All members must agree")
    g.add_argument("--node-name", default=None, help="checkpoint file name (default: the peer id)")
    g.add_argument("--threads", type=int, default=None, help="torch threads of this process")
    g.add_argument("--iteration-timeout", type=float, default=600.0,
                   help="seconds an iteration may take before training stops as stalled")
    g.add_argument("--start-debounce", type=float, default=None,
                   help="seconds the schedule epoch must stay current before training pins it (default 3 heartbeats)")
    g.add_argument("--agreement-timeout", type=float, default=600.0,
                   help="seconds to wait for every member of the pinned epoch to confirm it")
    g.add_argument("--drain-timeout", type=float, default=60.0, metavar="S",
                   help="on SIGTERM keep training until a schedule epoch without this node starts, at most "
                        "this long, so no in-flight microbatch is lost (default %(default)s)")
    g.add_argument("--inject", action="append", default=[], metavar="SPEC",
                   help="fault injection for rehearsals and tests (repeatable): "
                        "ACTION@iteration=I[,hop=J][,direction=forward|backward][,microbatch=M][,delay=S][,times=N] "
                        "with ACTION drop, delay or kill, e.g. kill@iteration=3,hop=2,direction=backward")
    add_emulation_arguments(p, location=False)  # node run has its own --location (advertised to peers)


def training_services_from_args(args: argparse.Namespace) -> list:
    """``[TrainerService]`` for ``--train``, else ``[]``; bad values raise :class:`UserError`."""
    if not getattr(args, "train", False):
        return []
    if args.iterations < 1:
        raise UserError("--iterations must be at least 1")
    if args.checkpoint_every < 0:
        raise UserError("--checkpoint-every must be >= 0")
    if args.min_members < 1:
        raise UserError("--min-members must be at least 1")
    if args.resume and args.checkpoint_dir is None:
        raise UserError("--resume needs --checkpoint-dir")
    if args.microbatch_size < 1 or (args.seq_len is not None and args.seq_len < 2):
        raise UserError("--microbatch-size must be >= 1 and --seq-len >= 2")
    if args.lr is not None and args.lr <= 0:
        raise UserError("--lr must be positive")
    if args.iteration_timeout <= 0 or args.agreement_timeout <= 0:
        raise UserError("--iteration-timeout and --agreement-timeout must be positive")
    if getattr(args, "drain_timeout", 60.0) < 0:
        raise UserError("--drain-timeout must be >= 0")
    from node.testing.faults import FaultInjector, parse_fault

    faults = FaultInjector([parse_fault(spec) for spec in getattr(args, "inject", None) or []]) or None

    from node.train.averaging import AveragingConfig, averaging_compression_for_wire
    from node.train.data import DataConfig
    from node.train.model import model_config
    from node.train.precision import resolve_device, resolve_precision
    from node.train.runtime import OptimConfig
    from node.train.trainer import TrainerConfig, TrainerService

    mcfg = model_config(args.model)
    seq_len = args.seq_len if args.seq_len is not None else (min(mcfg.context, 64) if args.model == "tiny" else mcfg.context)
    if seq_len > mcfg.context:
        raise UserError(f"--seq-len {seq_len} exceeds the {args.model} context of {mcfg.context}")
    optim = OptimConfig() if args.lr is None else OptimConfig(lr=args.lr)
    try:  # device, precision and wire format (docs/training.md, "GPUs, precision and wire formats")
        device = resolve_device(getattr(args, "device", "cpu"))
        precision = resolve_precision(getattr(args, "precision", "auto"), device)
        wire = getattr(args, "wire", "fp32")
        averaging = AveragingConfig(compression=averaging_compression_for_wire(wire))
    except ValueError as e:
        raise UserError(str(e)) from None
    config = TrainerConfig(
        run_id=args.run_id,
        model=mcfg,
        optim=optim,
        data=DataConfig(corpus=args.corpus, microbatch_size=args.microbatch_size, seq_len=seq_len, seed=args.seed),
        seed=args.seed,
        device=device, precision=precision, wire=wire, averaging=averaging,
        checkpoint_dir=str(args.checkpoint_dir.expanduser()) if args.checkpoint_dir else None,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        iteration_timeout_s=args.iteration_timeout,
    )
    return [TrainerService(config, args.iterations, node_name=args.node_name, min_members=args.min_members,
                           start_debounce_s=args.start_debounce, agreement_timeout_s=args.agreement_timeout,
                           threads=args.threads, emulation=emulation_from_args(args), faults=faults,
                           drain_timeout_s=float(getattr(args, "drain_timeout", 60.0)))]
