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
from node.cli.run_args import MODEL_DATA_FIELDS, MODEL_SIZE_NAMES, PRECISION_WIRE_FIELDS, add_run_arguments
from node.cli.validate import MAX_DURATION_S, float_range
from node.errors import UserError
from node.spec import DEFAULT_TRAIN_ITERATIONS, TrainSpec

__all__ = ["add_training_arguments", "model_and_data_from_args", "model_and_data_from_spec",
           "training_services_from_args", "DEFAULT_TRAIN_ITERATIONS", "MODEL_SIZE_NAMES", "default_tokenizer"]

#: BPE vocabulary the named ``500m`` size trains by default (its vocab in the paper).
LARGE_MODEL_BPE = "bpe:32000"
#: ``--ban S``: the longest ban is this many times the first (the default 30 s / 300 s keeps it too)
BAN_MAX_FACTOR = 10


def default_tokenizer(model: str) -> str:
    return LARGE_MODEL_BPE if model == "500m" else "bytes"


def model_and_data_from_args(args: argparse.Namespace, resolve_tokenizer: bool = True):
    """:func:`model_and_data_from_spec` of a parsed command line."""
    return model_and_data_from_spec(TrainSpec.from_args(args), resolve_tokenizer)


def model_and_data_from_spec(run: TrainSpec, resolve_tokenizer: bool = True):
    """``(ModelConfig, DataConfig)`` of a run: the tokenizer is resolved (trained once if needed) and its
    hash recorded in the DataConfig, the model's vocabulary is the tokenizer's, and ``--model-config``'s
    stages must agree with ``--num-stages``. Bad values raise UserError."""
    from dataclasses import replace

    from node.train.data import DataConfig, resolve_data_config, tokenizer_spec_of
    from node.train.model import load_model_config_file, model_config
    from node.train.tokenizer import parse_tokenizer_spec

    model = run.model
    spec = parse_tokenizer_spec(run.tokenizer or default_tokenizer(model))
    data = DataConfig(corpus=str(run.corpus), tokenizer=spec.config_name,
                      bpe_vocab_size=spec.vocab_size if spec.kind == "bpe" else DataConfig.bpe_vocab_size,
                      microbatch_size=run.microbatch_size, seed=run.seed, text_field=run.text_field)
    tokenizer_spec_of(data)  # validates a tokenizer path early
    vocab = None
    if resolve_tokenizer:
        stages = run.stages
        reads_corpus = not (stages and not run.auto and 0 not in stages)
        data, tok = resolve_data_config(data, reads_corpus=reads_corpus)
        vocab = tok.vocab_size
    model_file = run.model_config
    if model_file is not None:
        mcfg = load_model_config_file(model_file, vocab_size=vocab)
        name = str(model_file)
    else:
        mcfg = model_config(model, vocab_size=vocab)
        name = model
    num_stages = run.num_stages
    if model_file is not None and num_stages is not None and num_stages != mcfg.n_stages:
        raise UserError(f"--num-stages {num_stages} differs from the {mcfg.n_stages} stages of --model-config {model_file}")
    seq_len = run.seq_len
    if seq_len is None:
        seq_len = min(mcfg.context, 64) if (model == "tiny" and model_file is None) else mcfg.context
    if seq_len > mcfg.context:
        raise UserError(f"--seq-len {seq_len} exceeds the {name} context of {mcfg.context}")
    return mcfg, replace(data, seq_len=seq_len)


def add_training_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training (with --train)")
    add_run_arguments(g, ("train", *MODEL_DATA_FIELDS, "iterations", "checkpoint_dir", "checkpoint_every", "resume",
                          "min_members", "lr", "seed", "microbatch_size", "seq_len", *PRECISION_WIRE_FIELDS,
                          "branch_scaling"))
    g.add_argument("--node-name", default=None, help="checkpoint file name (default: the peer id)")
    add_run_arguments(g, ("threads", "iteration_timeout", "deadlines", "hedging"))
    g.add_argument("--start-debounce", type=float_range(0, MAX_DURATION_S), default=None,
                   help="seconds the schedule epoch must stay current before training pins it (default 3 heartbeats)")
    add_run_arguments(g, ("agreement_timeout",))
    g.add_argument("--drain-timeout", type=float_range(0, MAX_DURATION_S), default=60.0, metavar="S",
                   help="on SIGTERM keep training until a schedule epoch without this node starts, at most "
                        "this long, so no in-flight microbatch is lost (default %(default)s)")
    g.add_argument("--ban", type=float_range(0, MAX_DURATION_S, lo_open=True), default=None, metavar="S",
                   help="seconds a peer this node suspects (dead, or sent poison) stays off its routes the first "
                        "time; doubles on each repeat up to 10x (default 30)")
    g.add_argument("--inject", action="append", default=[], metavar="SPEC",
                   help="fault injection for rehearsals and tests (repeatable): "
                        "ACTION@iteration=I[,hop=J][,direction=forward|backward][,microbatch=M][,attempt=A][,delay=S][,times=N] "
                        "with ACTION drop, delay or kill, e.g. kill@iteration=3,hop=2,direction=backward; or "
                        "corrupt@iteration=I,target=activations|gradients|average|norm,fill=V|scale=V[,times=N] "
                        "to rehearse a bad member")
    add_emulation_arguments(p, location=False)  # node run has its own --location (advertised to peers)


def training_services_from_args(args: argparse.Namespace, spec: TrainSpec | None = None) -> list:
    """``[TrainerService]`` for ``--train``, else ``[]``: the run's settings from ``spec`` (read from ``args``
    when not given), this node's own (name, debounce, drain, ban, faults, emulation) from ``args``; bad values
    raise :class:`UserError`."""
    spec = spec if spec is not None else TrainSpec.from_args(args)
    if not spec.train:
        return []
    from dataclasses import replace

    if spec.iterations < 1:
        raise UserError("--iterations must be at least 1")
    if spec.checkpoint_every < 0:
        raise UserError("--checkpoint-every must be >= 0")
    if spec.min_members < 1:
        raise UserError("--min-members must be at least 1")
    if spec.resume and spec.checkpoint_dir is None:
        raise UserError("--resume needs --checkpoint-dir")
    if spec.microbatch_size < 1 or (spec.seq_len is not None and spec.seq_len < 2):
        raise UserError("--microbatch-size must be >= 1 and --seq-len >= 2")
    if spec.lr is not None and spec.lr <= 0:
        raise UserError("--lr must be positive")
    if spec.iteration_timeout <= 0 or spec.agreement_timeout <= 0:
        raise UserError("--iteration-timeout and --agreement-timeout must be positive")
    if args.drain_timeout < 0:
        raise UserError("--drain-timeout must be >= 0")
    from node.train.faults import FaultInjector, parse_fault

    faults = FaultInjector([parse_fault(text) for text in args.inject or []]) or None

    from node.train.averaging import AveragingConfig, averaging_compression_for_wire
    from node.train.deadlines import ObservedDeadlineConfig
    from node.train.hedging import HedgeConfig
    from node.train.precision import resolve_device, resolve_precision
    from node.train.runtime import OptimConfig
    from node.train.service import TrainerService
    from node.train.trainer import TrainerConfig

    mcfg, data = model_and_data_from_spec(spec)
    optim = OptimConfig() if spec.lr is None else OptimConfig(lr=spec.lr)
    try:  # device, precision and wire format (docs/training.md, "GPUs, precision and wire formats")
        device = resolve_device(spec.device)
        precision = resolve_precision(spec.precision, device)
        wire = spec.wire
        averaging = AveragingConfig(compression=averaging_compression_for_wire(wire))
    except ValueError as e:
        raise UserError(str(e)) from None
    config = TrainerConfig(
        run_id=spec.run_id,
        model=mcfg,
        optim=optim,
        data=data,
        seed=spec.seed,
        device=device, precision=precision, wire=wire, averaging=averaging, branch_scaling=spec.branch_scaling,
        checkpoint_dir=str(Path(spec.checkpoint_dir).expanduser()) if spec.checkpoint_dir else None,
        checkpoint_every=spec.checkpoint_every,
        resume=spec.resume,
        iteration_timeout_s=spec.iteration_timeout,
        observed_deadlines=ObservedDeadlineConfig(enabled=spec.deadlines == "observed"),
        hedging=HedgeConfig(enabled=spec.hedging == "on"),
        **({} if args.ban is None else {"ban_s": args.ban, "ban_max_s": BAN_MAX_FACTOR * args.ban}),
    )
    service = TrainerService(config, spec.iterations, node_name=args.node_name, min_members=spec.min_members,
                             start_debounce_s=args.start_debounce, agreement_timeout_s=spec.agreement_timeout,
                             threads=spec.threads, emulation=emulation_from_args(args), faults=faults,
                             drain_timeout_s=float(args.drain_timeout))
    # what the founder's banner tells joiners to pass, with the precision this node resolved "auto" to
    service.join_flags = replace(spec, precision=precision).join_argv()
    return [service]
