"""``skippipe node run``: start this machine's daemon (a new swarm, or join one)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from pathlib import Path

from node.swarm.config import DEFAULT_HOST_MADDRS, DaemonConfig, default_identity_path
from node.dataplane.relay import RelayMode
from node.swarm.replan import ReplanPolicy
from node.errors import UserError
from node.spec import TrainSpec
from node.cli.run_args import add_run_arguments
from node.cli.validate import MAX_DURATION_S, MAX_STAGES, float_range, int_range, maddr_list_item, port

__all__ = ["register", "add_node_run_arguments", "run_spec_from_args", "config_from_args", "emulated_location_cost",
           "SCHEDULE_POLICIES"]

#: Bound on ``microbatches x path length^2`` of a run (the coordinator's path search grows with it).
MAX_RUN_SCHEDULE_WORK = 65536
#: Multiaddrs one flag accepts.
MAX_MADDRS = 64
#: Values of --schedule-policy (RunConfig.schedule_policy).
SCHEDULE_POLICIES = ("skippipe", "full", "random")
#: hivemind logs at INFO by default; the daemon's own INFO lines are what an operator wants.
HIVEMIND_LOG_LEVEL = "WARNING"


def _stage_list(text: str) -> tuple[int, ...]:
    if len(text) > 4096:
        raise argparse.ArgumentTypeError("--stages: too long")
    try:
        stages = tuple(int(x) for x in text.split(",") if x.strip() != "")
    except ValueError:
        raise argparse.ArgumentTypeError(f"--stages wants comma-separated integers, got {text!r}") from None
    if not stages or any(s < 0 for s in stages):
        raise argparse.ArgumentTypeError(f"--stages wants non-negative integers, got {text!r}")
    if any(s >= MAX_STAGES for s in stages):
        raise argparse.ArgumentTypeError(f"--stages: a run has at most {MAX_STAGES} stages, got {text!r}")
    return stages


def add_node_run_arguments(p: argparse.ArgumentParser) -> None:
    """The ``node run`` flags (shared with commands that start daemons, e.g. ``skippipe up``)."""
    p.add_argument("--initial-peers", nargs="+", default=[], metavar="MADDR", type=maddr_list_item,
                   help="multiaddrs (ending in /p2p/<id>) of swarm members to join through")
    p.add_argument("--new-swarm", action="store_true", help="start a new swarm (the default without --initial-peers)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--stages", type=_stage_list, metavar="K[,K...]", help="stages this node holds, e.g. 0 or 2,3")
    group.add_argument("--auto", action="store_true",
                       help="join the bottleneck stage (an empty one, else the fewest replicas or, with --replan on, "
                            "the least measured capacity); the coordinator may move the node later (default)")
    add_run_arguments(p, ("num_stages", "path_length", "microbatches"))
    p.add_argument("--schedule-policy", default="skippipe", metavar="POLICY",
                   help="how epochs route microbatches (new swarm): skippipe (default), full (aligned full "
                        "pipelines, no skipping) or random (network-blind skipping); baselines for benchmarks")
    p.add_argument("--schedule-cost", default="measured", metavar="SOURCE",
                   help="what the coordinator schedules for (new swarm): measured (link probes, default) or "
                        "emulation (the --network-profile links and --compute-s-per-sample-per-layer this run "
                        "emulates, by each member's --location; link probes are not emulated)")
    p.add_argument("--schedule-budget", type=float_range(0, 3600.0, lo_open=True), default=None, metavar="S",
                   help="safety cap in seconds on the coordinator's path search per epoch (default 15; the search "
                        "stops on a work budget first)")
    p.add_argument("--replan", choices=["on", "off"], default="off",
                   help="as coordinator, plan with the compute speed members measure while training and re-plan "
                        "when it moves (a slow replica gets fewer microbatches): on, or off (default: the start-up "
                        "benchmark only). Off by default because daemons sharing one host measure each other's "
                        "CPU contention, not their own speed (docs/operations.md)")
    p.add_argument("--replan-interval", type=float_range(0, MAX_DURATION_S), default=None, metavar="S",
                   help=f"seconds an epoch runs at least before a re-plan replaces it (default "
                        f"{ReplanPolicy().min_interval_s:g})")
    p.add_argument("--relay", choices=[m.value for m in RelayMode], default=RelayMode.AUTO.value,
                   help="relay data-plane frames between members behind NAT that cannot connect to each other: on, "
                        "off, or auto (default: on unless this node learned that nobody can dial it)")
    add_run_arguments(p, ("memory_slots",))
    p.add_argument("--host-maddrs", nargs="+", type=maddr_list_item, default=list(DEFAULT_HOST_MADDRS), metavar="MADDR",
                   help="where p2pd listens (default %(default)s)")
    p.add_argument("--announce-maddrs", nargs="+", type=maddr_list_item, default=[], metavar="MADDR", help="public addresses to advertise")
    p.add_argument("--gossip-port", type=port(allow_zero=True), default=0, help="TCP port of the gossip host (default: ephemeral)")
    p.add_argument("--identity", type=Path, default=None,
                   help=f"RSA identity file, created on first use (default {default_identity_path()})")
    add_run_arguments(p, ("run_id", "device"))
    p.add_argument("--location", default=None, help="free-form location label shown to peers")
    p.add_argument("--rpc-port", type=port(allow_zero=True, allow_off=True), default=0, help="local HTTP RPC port on 127.0.0.1 (0 = ephemeral, -1 = off)")
    add_run_arguments(p, ("heartbeat",))
    p.add_argument("--swarm-key", type=Path, default=None, metavar="FILE",
                   help="shared secret of a private swarm; peers without it cannot advertise, gossip or send data")
    p.add_argument("--allow-peers", type=Path, default=None, metavar="FILE",
                   help="allowlist of peer ids (one per line, # comments); others are ignored")
    p.add_argument("--rpc-rate", type=float_range(0, 1e6, lo_open=True), default=None, metavar="REQ_PER_S",
                   help="per-peer RPC rate limit, libp2p and HTTP (default 20/s over libp2p, 50/s over HTTP)")
    p.add_argument("--rpc-burst", type=float_range(1, 1e9), default=None, metavar="N",
                   help="per-peer RPC burst allowance (default 2 s worth of --rpc-rate)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--exit-when-done", action="store_true",
                   help="leave the swarm and exit 0 once training has finished (default: stay, idle, and say so)")
    # Hidden knobs for tests and the local-swarm launcher.
    p.add_argument("--ready-file", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--protocol-version", type=int_range(0, 2**31 - 1), default=None, help=argparse.SUPPRESS)
    p.add_argument("--no-access-handshake", action="store_true", help=argparse.SUPPRESS)


def emulated_location_cost(args: argparse.Namespace, spec: TrainSpec | None = None) -> dict | None:
    """``RunConfig.location_cost`` for ``--schedule-cost emulation``: per location, the emulated
    forward seconds per microbatch and, per ordered pair of locations, latency + activation bytes /
    bandwidth + hop overhead, exactly as :mod:`node.dataplane.emulation` delays them (scaled profile, the
    trainer's model and microbatch shape, from ``spec``: read from ``args`` when not given). None for
    ``measured``."""
    spec = spec if spec is not None else TrainSpec.from_args(args)
    source = args.schedule_cost
    if source == "measured":
        return None
    if source != "emulation":
        raise UserError(f"--schedule-cost must be measured or emulation, got {source!r}")
    from node.cli.emulation_args import emulation_from_args

    settings = emulation_from_args(args, require_location=False)
    if settings is None or settings.network_profile is None or settings.compute_s_per_sample_per_layer is None:
        raise UserError("--schedule-cost emulation needs --network-profile and --compute-s-per-sample-per-layer")
    from node.train.model import model_config
    from protocol.compression import wire_bytes_per_element
    from scheduler.cost import GIB, ModelShape, activation_bytes, transfer_time_s

    profile = settings.load_profile()
    model = spec.model
    mcfg = model_config(model)
    seq_len = spec.seq_len or (min(mcfg.context, 64) if model == "tiny" else mcfg.context)
    shape = ModelShape(layers_per_stage=mcfg.layers_per_stage, d_model=mcfg.d_model, seq_len=seq_len,
                       samples_per_microbatch=spec.microbatch_size,
                       bytes_per_element=wire_bytes_per_element(spec.wire))  # --wire's real size
    nbytes = activation_bytes(shape)
    locs = list(profile.locations)

    def link_s(a: str, b: str) -> float:
        lk = profile.link(a, b)
        return transfer_time_s(lk.latency_ms * settings.latency_scale, lk.bandwidth_GiBps * GIB * settings.bandwidth_scale,
                               nbytes, settings.hop_overhead_s)

    forward = settings.compute_s_per_sample_per_layer * shape.layers_per_stage * shape.samples_per_microbatch
    return {"locations": locs, "compute_s": [forward] * len(locs), "link_s": [[link_s(a, b) for b in locs] for a in locs]}


def _model_file_stages(spec: TrainSpec) -> int | None:
    """The stage count of ``--model-config`` (with ``--train``): the run's ``--num-stages`` unless given."""
    path = spec.model_config
    if path is None or not spec.train:
        return None
    from node.train.model import load_model_config_file

    return load_model_config_file(path, vocab_size=1).n_stages if _has_no_vocab(path) else load_model_config_file(path).n_stages


def _has_no_vocab(path) -> bool:
    import json

    try:
        raw = json.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False  # load_model_config_file reports it
    return isinstance(raw, dict) and "vocab" not in raw and "vocab_size" not in raw


def run_spec_from_args(args: argparse.Namespace) -> TrainSpec:
    """The run's settings of a parsed ``node run``, ``--device auto`` resolved to this machine's device (an
    unusable device is one error line)."""
    from dataclasses import replace

    from node.train.precision import resolve_device

    spec = TrainSpec.from_args(args)
    try:
        return replace(spec, device=resolve_device(spec.device))
    except ValueError as e:
        raise UserError(str(e)) from None


def config_from_args(args: argparse.Namespace, spec: TrainSpec | None = None) -> DaemonConfig:
    """The daemon's config: the run's settings from ``spec`` (read from ``args`` when not given), this
    machine's own (addresses, identity, ports, access, the founder's schedule policy) from ``args``."""
    spec = spec if spec is not None else run_spec_from_args(args)
    for flag, values in (("--initial-peers", args.initial_peers), ("--host-maddrs", args.host_maddrs),
                         ("--announce-maddrs", args.announce_maddrs)):
        if len(values) > MAX_MADDRS:
            raise UserError(f"{flag}: at most {MAX_MADDRS} multiaddrs, got {len(values)}")
    if spec.heartbeat <= 0:
        raise UserError("--heartbeat must be positive")
    if args.rpc_rate is not None and args.rpc_rate <= 0:
        raise UserError("--rpc-rate must be positive")
    if args.rpc_burst is not None and args.rpc_burst < 1:
        raise UserError("--rpc-burst must be at least 1")
    limits = {}
    if args.rpc_rate is not None:
        burst = args.rpc_burst if args.rpc_burst is not None else max(1.0, 2 * args.rpc_rate)
        limits = dict(rpc_rate_per_s=args.rpc_rate, rpc_burst=burst, http_rate_per_s=args.rpc_rate, http_burst=burst)
    elif args.rpc_burst is not None:
        limits = dict(rpc_burst=args.rpc_burst, http_burst=args.rpc_burst)
    policy = args.schedule_policy
    if policy not in SCHEDULE_POLICIES:
        raise UserError(f"--schedule-policy must be one of {', '.join(SCHEDULE_POLICIES)}, got {policy!r}")
    budget = args.schedule_budget
    if budget is not None and budget <= 0:
        raise UserError("--schedule-budget must be positive")
    if spec.num_stages is not None and spec.stages is not None and max(spec.stages) >= spec.num_stages:
        raise UserError(f"--stages {','.join(map(str, spec.stages))} needs --num-stages > {max(spec.stages)}")
    stages_guess = spec.num_stages or (max(spec.stages) + 1 if spec.stages else 2)
    path_length = spec.path_length or stages_guess
    if spec.microbatches * path_length * path_length > MAX_RUN_SCHEDULE_WORK:
        raise UserError(f"--microbatches {spec.microbatches} x path length {path_length} squared is over "
                        f"{MAX_RUN_SCHEDULE_WORK}: the coordinator could not schedule an epoch in time; "
                        "use fewer microbatches or a shorter --path-length")
    location_cost = emulated_location_cost(args, spec)
    return DaemonConfig(
        run_id=spec.run_id,
        initial_peers=tuple(args.initial_peers),
        new_swarm=args.new_swarm,
        stages=None if spec.auto or spec.stages is None else tuple(spec.stages),
        num_stages=spec.num_stages if spec.num_stages is not None else _model_file_stages(spec),
        path_length=spec.path_length,
        microbatches_per_data_node=spec.microbatches,
        schedule_policy=policy,
        location_cost=location_cost,
        **({"schedule_budget_s": budget} if budget is not None else {}),
        replan=replan_policy(args),
        relay=RelayMode(getattr(args, "relay", RelayMode.AUTO.value)),
        memory_slots=spec.memory_slots,
        host_maddrs=tuple(args.host_maddrs),
        announce_maddrs=tuple(args.announce_maddrs),
        gossip_port=args.gossip_port,
        identity_path=(args.identity or default_identity_path()).expanduser(),
        device=spec.device,
        location=args.location,
        rpc_port=None if args.rpc_port is not None and args.rpc_port < 0 else args.rpc_port,
        protocol_version=args.protocol_version,
        ready_file=args.ready_file,
        heartbeat_s=spec.heartbeat,
        swarm_key_path=args.swarm_key.expanduser() if args.swarm_key else None,
        allow_peers_path=args.allow_peers.expanduser() if args.allow_peers else None,
        access_handshake=not args.no_access_handshake,
        **limits,
    )


def replan_policy(args: argparse.Namespace) -> ReplanPolicy:
    """``--replan`` and ``--replan-interval`` as the coordinator's policy (commands without them: the default)."""
    policy = ReplanPolicy(enabled=getattr(args, "replan", "off") == "on")
    interval = getattr(args, "replan_interval", None)
    return dataclasses.replace(policy, min_interval_s=float(interval)) if interval is not None else policy


def setup_logging(level: str) -> None:
    os.environ.setdefault("HIVEMIND_LOGLEVEL", HIVEMIND_LOG_LEVEL)
    logging.basicConfig(level=logging.getLevelName(level), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("libp2p", "multiaddr", "hivemind", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLevelName(level)))


def _run(args: argparse.Namespace) -> int:
    from node.net.lifetime import install_fork_guard, parent_watchdog_from_env, tolerate_broken_stdio

    tolerate_broken_stdio()  # a dead reader of our stdout must not break (or block) the clean stop
    install_fork_guard()  # the forked DHT process (and any other forked child) dies with us
    parent_watchdog_from_env()  # started by a harness: do not outlive it
    setup_logging(args.log_level)
    spec = run_spec_from_args(args)  # the run's settings, read once; both configs are built from them
    config = config_from_args(args, spec)
    from node.cli.train_args import training_services_from_args

    services = training_services_from_args(args, spec)
    if services:  # before the event loop: see import_optimizer_machinery
        from node.train.runtime import import_optimizer_machinery

        import_optimizer_machinery()
    from node.swarm.daemon import run_daemon  # heavy imports only when actually running

    return run_daemon(config, services, exit_when_done=args.exit_when_done)


def register(subparsers) -> None:
    node = subparsers.add_parser("node", help="run this machine's swarm daemon")
    sub = node.add_subparsers(dest="node_command", metavar="ACTION")
    run = sub.add_parser("run", help="start the daemon: a new swarm, or join one with --initial-peers",
                         description="Start the node daemon. Without --initial-peers it starts a new swarm and "
                                     "prints the address others join with.")
    add_node_run_arguments(run)
    from node.cli.train_args import add_training_arguments

    add_training_arguments(run)
    run.set_defaults(func=_run)
