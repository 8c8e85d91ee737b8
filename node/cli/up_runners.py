"""The two runners of ``skippipe up``: real daemons (the default) and the in-process harness.

:func:`run_up_swarm` starts one ``skippipe node run --train`` process per node on 127.0.0.1
(:class:`node.launch.process_swarm.ProcessSwarm`) and reads progress from the data nodes'
``training`` RPC; :func:`run_up` (``--in-process``) trains on
:class:`node.launch.inproc_swarm.InProcessSwarm` with a hand-built or loopback-scheduled schedule
(:mod:`node.launch.schedules`). Both write a progress line per iteration, ``loss.png``,
``history.json`` and ``summary.json`` under ``--out`` and return the summary.
"""

from __future__ import annotations

import json
import logging
import pathlib
import sys
import time
import types
from dataclasses import asdict, dataclass, replace
from typing import Callable, Dict, List, Optional

from node.cli.emulation_args import emulation_node_args, round_robin_emulation_for
from node.errors import UserError
from node.spec import TrainSpec
from node.ops.plotting import load_pyplot
from node.launch.inproc_swarm import InProcessSwarm
from node.launch.schedules import build_schedule, scheduler_schedule

__all__ = ["UpOptions", "UP_SPEC", "run_up", "run_up_swarm", "RUN_ID", "NODES_DIR", "align_checkpoints"]

logger = logging.getLogger(__name__)

#: Where the daemons of ``skippipe up`` keep identities, logs and ready files (under --out).
NODES_DIR = "nodes"
RUN_ID = "up"
#: Layout of ``skippipe up``: 2 data nodes + stages 1..5 of the tiny model, two replicas for stages 1 and 2.
DEFAULT_DATA_NODES = 2
DEFAULT_REPLICAS = "2,2,1,1,1"
#: The run ``skippipe up`` trains without flags: the tiny model on Shakespeare, 40 iterations at lr 3e-3, paths
#: of 4 stages out of 6 (skip ratio 1/3), 4 microbatches per data node, 2 in flight per node; about a minute on
#: 2 CPU cores. Its daemons beat every 2 s (a loopback swarm notices a death fast), use one torch thread each
#: (a node per core would oversubscribe a laptop) and give up on an iteration after 180 s.
UP_SPEC = TrainSpec(train=True, iterations=40, lr=3e-3, path_length=4, microbatches=4, memory_slots=2, run_id=RUN_ID,
                    heartbeat=2.0, threads=1, iteration_timeout=180.0)
#: Validation batches used for the before/after loss of the full model.
VAL_BATCHES = 8


@dataclass
class UpOptions:
    """What ``skippipe up`` runs: the run (``spec``, the flags every daemon gets) and the local swarm around it."""

    spec: TrainSpec = UP_SPEC
    out: str = "skippipe-up"
    data_nodes: int = DEFAULT_DATA_NODES
    replicas: str = DEFAULT_REPLICAS
    reorder: bool = True
    scheduler: str = "skippipe"  # "skippipe" (scheduler.paths) or "builtin" (build_schedule)
    quiet: bool = False
    in_process: bool = False  # the in-process harness instead of one daemon process per node
    start_timeout_s: float = 480.0  # daemon mode: until the first iteration is committed
    stall_timeout_s: float = 240.0  # daemon mode: longest wait for the next iteration
    emulation: Optional[object] = None  # node.cli.emulation_args.EmulationSettings; None = no WAN/compute emulation


def _compute_config(opts: UpOptions) -> dict:
    """TrainerConfig fields for --device/--precision/--wire (checked: one error line if unusable)."""
    from node.train.averaging import AveragingConfig, averaging_compression_for_wire
    from node.train.precision import resolve_device, resolve_precision

    spec = opts.spec
    try:
        device = resolve_device(spec.device)
        return dict(device=device, precision=resolve_precision(spec.precision, device), wire=spec.wire,
                    branch_scaling=spec.branch_scaling, averaging=AveragingConfig(compression=averaging_compression_for_wire(spec.wire)))
    except ValueError as e:
        raise UserError(str(e)) from None


def _model_and_data(opts: UpOptions):
    """``(ModelConfig, DataConfig)`` exactly as every ``node run --train`` of this swarm resolves them
    (the tokenizer is trained/cached here once, before the daemons start), with ``--num-stages``."""
    from node.cli.train_args import model_and_data_from_spec

    num_stages = opts.spec.num_stages
    if num_stages is not None and num_stages < 2:
        raise UserError(f"--num-stages must be at least 2, got {num_stages}")
    mcfg, data_cfg = model_and_data_from_spec(opts.spec)
    if num_stages is not None and num_stages != mcfg.n_stages:
        mcfg = replace(mcfg, n_stages=num_stages).validate()  # layers per stage stay those of the size
    return mcfg, data_cfg


def _parse_replicas(text: str, n_stages: int) -> List[int]:
    if text == DEFAULT_REPLICAS and n_stages != len(text.split(",")) + 1:
        text = ",".join((["2", "2"] + ["1"] * n_stages)[: n_stages - 1])  # the default layout, resized
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--replicas must be comma-separated integers, got {text!r}")
    if len(values) == 1:
        values = values * (n_stages - 1)
    if len(values) != n_stages - 1 or min(values) < 1:
        raise UserError(f"--replicas needs {n_stages - 1} positive counts (stages 1..{n_stages - 1}), got {text!r}")
    return values


class _Progress:
    """One status line per iteration (rewritten in place on a terminal)."""

    def __init__(self, total: int, stream=None, quiet: bool = False):
        stream = sys.stderr if stream is None else stream  # looked up now: an import-time default can be closed
        self.total, self.stream, self.quiet = total, stream, quiet
        self.tty = stream.isatty()

    def __call__(self, s) -> None:
        if self.quiet:
            return
        width = 24
        filled = int(width * (s.iteration + 1) / self.total)
        bar = "#" * filled + "-" * (width - filled)
        line = (f"[{bar}] iter {s.iteration + 1}/{self.total}  loss {s.loss:.4f}  "
                f"{s.tokens / max(s.seconds, 1e-9):,.0f} tok/s  {s.seconds:.2f} s/it  nodes {s.active_nodes}")
        if self.tty:
            self.stream.write("\r" + line)
            if s.iteration + 1 >= self.total:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def _plot(history: List[dict], path: pathlib.Path, title: str) -> bool:
    plt = load_pyplot("loss curve")
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([h["iteration"] + 1 for h in history], [h["loss"] for h in history], label="train (swarm)")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


async def run_up(opts: UpOptions) -> dict:
    from node.train.data import load_splits, validation_batches
    from node.train.reference import evaluate_loss
    from node.train.runtime import OptimConfig
    from node.train.trainer import TrainerConfig

    run = opts.spec
    if run.iterations < 1:
        raise UserError("--iterations must be at least 1")
    out = pathlib.Path(opts.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create output folder {out}: {e}")
    mcfg, data_cfg = _model_and_data(opts)
    splits = load_splits(data_cfg)
    replicas = _parse_replicas(opts.replicas, mcfg.n_stages)
    schedule = build_schedule(mcfg.n_stages, opts.data_nodes, replicas, run.path_length, run.microbatches,
                              run.memory_slots, reorder=opts.reorder)
    if opts.scheduler == "skippipe":
        t_sched = time.perf_counter()
        schedule = scheduler_schedule(schedule, run.path_length, run.microbatches, run.memory_slots, run.seed)
        logger.info("path scheduler took %.1f s", time.perf_counter() - t_sched)
    elif opts.scheduler != "builtin":
        raise UserError(f"unknown scheduler {opts.scheduler!r}; choose 'skippipe' or 'builtin'")
    config = TrainerConfig(run_id=run.run_id, model=mcfg, optim=OptimConfig(lr=run.lr), data=data_cfg, seed=run.seed,
                           checkpoint_dir=str(out / "checkpoints"), checkpoint_every=run.checkpoint_every,
                           resume=run.resume, **_compute_config(opts))
    val = validation_batches(splits, data_cfg, VAL_BATCHES)
    n_nodes = sum(len(s) for s in schedule["stages"])
    if not opts.quiet:
        print(f"starting a local swarm: bootstrap + {n_nodes} nodes ({opts.data_nodes} data nodes, stage replicas "
              f"{replicas}), model {run.model}, path length {run.path_length}/{mcfg.n_stages}, corpus {run.corpus}, "
              f"{opts.scheduler} schedule",
              file=sys.stderr)
    progress = _Progress(run.iterations, quiet=opts.quiet)
    t_start = time.perf_counter()
    emulation_for = round_robin_emulation_for(opts.emulation) if opts.emulation is not None else None
    async with InProcessSwarm(schedule, config, splits, on_iteration=progress, emulation_for=emulation_for) as swarm:
        t_ready = time.perf_counter()
        first = swarm.start_iteration
        if first >= run.iterations:
            raise UserError(f"checkpoints are already at iteration {first}; ask for more --iterations")
        val_before = evaluate_loss(swarm.stage_modules(), val)
        stats = await swarm.train(run.iterations)
        val_after = evaluate_loss(swarm.stage_modules(), val)
    t_end = time.perf_counter()
    history = [asdict(s) for s in stats]
    prev = out / "history.json"
    if run.resume and prev.exists():
        old = [h for h in json.loads(prev.read_text()) if h["iteration"] < first]
        history = old + history
    prev.write_text(json.dumps(history, indent=1))
    plotted = _plot(history, out / "loss.png", f"skippipe up: {run.model} on {run.corpus}")
    train_s = sum(s.seconds for s in stats)
    summary = {
        "iterations": run.iterations, "resumed_from": first, "nodes": n_nodes, "data_nodes": opts.data_nodes,
        "replicas": replicas, "path_length": run.path_length, "n_stages": mcfg.n_stages, "model": run.model,
        "corpus": run.corpus, "scheduler": opts.scheduler, "first_loss": history[0]["loss"], "final_loss": history[-1]["loss"],
        "val_loss_before": val_before, "val_loss_after": val_after,
        "tokens_per_s": sum(s.tokens for s in stats) / max(train_s, 1e-9),
        "mean_iteration_s": train_s / max(len(stats), 1), "startup_s": t_ready - t_start,
        "wall_s": t_end - t_start, "loss_png": str(out / "loss.png") if plotted else None,
        "checkpoints": str(out / "checkpoints"),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


# ---------------------------------------------------------------------- daemon mode
_POLL_S = 1.0


def _layout(opts: UpOptions):
    """Model config, data config, replica counts (flag checks shared with the in-process harness)."""
    run = opts.spec
    if run.iterations < 1:
        raise UserError("--iterations must be at least 1")
    mcfg, data_cfg = _model_and_data(opts)
    replicas = _parse_replicas(opts.replicas, mcfg.n_stages)
    build_schedule(mcfg.n_stages, opts.data_nodes, replicas, run.path_length, run.microbatches, run.memory_slots)
    if opts.scheduler != "skippipe":
        raise UserError("--scheduler builtin needs --in-process (the daemons' coordinator uses the SkipPipe scheduler)")
    return mcfg, data_cfg, replicas


def _daemon_spec(opts: UpOptions, out: pathlib.Path, n_nodes: int) -> TrainSpec:
    """The run every daemon gets (``to_argv()`` on its command line): ``up``'s spec, training, checkpoints
    under ``--out``, started on the one epoch that holds every node, whose members confirm it within the
    start timeout."""
    return replace(opts.spec, train=True, run_id=RUN_ID, checkpoint_dir=out / "checkpoints", min_members=n_nodes,
                   agreement_timeout=float(opts.start_timeout_s))


def _node_args(opts: UpOptions) -> Callable[[int], List[str]]:
    """Node ``i``'s own flags after the run's: its checkpoint name and its emulated location."""
    return lambda i: ["--node-name", f"node{i}", *emulation_node_args(opts.emulation, i)]


def _stage_modules_from_checkpoints(ckpt_root: Optional[pathlib.Path], mcfg, seed: int, names: Dict[int, str]):
    """Replica ``names[k]`` of every stage from its checkpoint (initial weights where there is none,
    and everywhere when ``ckpt_root`` is None); returns ``(modules, iterations)``."""
    from node.train.checkpoint import CheckpointStore
    from node.train.model import build_stage
    from node.train.runtime import OptimConfig, StageRuntime

    modules, iters = [], []
    for k in range(mcfg.n_stages):
        rt = StageRuntime(build_stage(mcfg, k, seed), OptimConfig())
        ckpt = CheckpointStore(ckpt_root, RUN_ID, k, names[k]).load() if ckpt_root is not None else None
        if ckpt is not None:
            rt.load_state_dict(ckpt.state)
        iters.append(ckpt.iteration if ckpt is not None else -1)
        modules.append(rt.module)
    return modules, iters


def align_checkpoints(ckpt_root: pathlib.Path, stage_names: Dict[int, List[str]], run_id: str = None) -> Optional[int]:
    """Before ``--resume``: bring every replica's checkpoint to the latest iteration its stage has.

    A replica killed mid-run keeps an older checkpoint than the replicas that trained on (9 vs 13):
    it catches up by taking the checkpoint of a replica of its stage at the stage's latest
    iteration (replicas hold the same weights after averaging, as a joiner's state download
    would give it). Returns the iteration everyone resumes after (None: no checkpoints at all);
    UserError when the stages' latest iterations differ (a stage whose every replica died early:
    only the latest checkpoint is kept, so the others cannot go back to it)."""
    import shutil

    from node.train.checkpoint import CheckpointStore

    run_id = run_id or RUN_ID
    latest: Dict[int, tuple] = {}
    stores: Dict[int, list] = {}
    for k, names in stage_names.items():
        for name in names:
            store = CheckpointStore(ckpt_root, run_id, k, name)
            try:
                ckpt = store.load()
            except Exception as e:  # noqa: BLE001 - a torn or foreign file: that replica has none
                logger.warning("ignoring unreadable checkpoint %s: %s", store.path, e)
                ckpt = None
            it = ckpt.iteration if ckpt is not None else -1
            stores.setdefault(k, []).append((store, it))
            if it >= 0 and (k not in latest or it > latest[k][1]):
                latest[k] = (store, it)
    if not latest:
        return None
    missing = [k for k in stage_names if k not in latest]
    its = {k: it for k, (_, it) in latest.items()}
    if missing or len(set(its.values())) > 1:
        raise UserError("cannot resume: the stages' latest checkpoints are at different iterations ("
                        + ", ".join(f"stage {k}: {its.get(k, 'none')}" for k in sorted(stage_names))
                        + "); every replica of a stage stopped early. Start a fresh run (without --resume)")
    for k, entries in stores.items():
        source, it = latest[k]
        for store, mine in entries:
            if mine < it:
                store.path.parent.mkdir(parents=True, exist_ok=True)
                tmp = store.path.with_suffix(".catchup")
                shutil.copyfile(source.path, tmp)
                tmp.replace(store.path)
                logger.info("replica %s of stage %d catches up from %s: iteration %s -> %d", store.path.stem, k,
                            source.path.stem, mine if mine >= 0 else "none", it)
    return next(iter(its.values()))


def run_up_swarm(opts: UpOptions) -> dict:
    """``skippipe up`` on real daemons: one ``skippipe node run --train`` process per node.

    Node 0 founds the swarm (it is also data node 0), the rest join through it; all run with
    ``--min-members`` = the node count, so they train on the one epoch that holds everybody.
    Progress comes from the data nodes' ``training`` RPC. Every daemon is stopped (process groups,
    so no p2pd survives) on success, failure, Ctrl+C and SIGTERM.
    """
    from node.train.data import load_splits, validation_batches
    from node.launch.process_swarm import ProcessSwarm
    from node.launch.watch import TrainingWatch
    from node.train.reference import evaluate_loss

    run = opts.spec
    mcfg, data_cfg, replicas = _layout(opts)
    out = pathlib.Path(opts.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create output folder {out}: {e}")
    stage_sizes = [opts.data_nodes] + replicas
    n_nodes = sum(stage_sizes)
    # replica 0 of stage k is the first node index of that stage (ProcessSwarm's layout)
    first_of = {k: f"node{sum(stage_sizes[:k])}" for k in range(len(stage_sizes))}
    splits = load_splits(data_cfg)
    val = validation_batches(splits, data_cfg, VAL_BATCHES)
    ckpt_root = out / "checkpoints"
    # a fresh run starts from the initial weights even where an earlier run left checkpoints in --out
    # (the daemons overwrite them); only --resume starts from them
    if run.resume:  # replicas killed mid-run catch up from a replica of their stage first
        names = {k: [f"node{sum(stage_sizes[:k]) + r}" for r in range(size)] for k, size in enumerate(stage_sizes)}
        align_checkpoints(ckpt_root, names)
    before, ck_iters = _stage_modules_from_checkpoints(ckpt_root if run.resume else None, mcfg, run.seed, first_of)
    if run.resume and min(ck_iters) + 1 >= run.iterations:
        raise UserError(f"checkpoints are already at iteration {min(ck_iters) + 1}; ask for more --iterations")
    val_before = evaluate_loss(before, val)  # initial weights, or the checkpoints resumed from
    swarm = ProcessSwarm(n_nodes, stage_sizes, base_dir=out / NODES_DIR, spec=_daemon_spec(opts, out, n_nodes),
                         extra_args=_node_args(opts))
    if not opts.quiet:
        print(f"starting a local swarm of {n_nodes} daemons ({opts.data_nodes} data nodes, stage replicas {replicas}; "
              f"node 0 founds it), model {run.model}, path length {run.path_length}/{mcfg.n_stages}, "
              f"corpus {run.corpus}; logs in {out / NODES_DIR}", file=sys.stderr)
    progress = _Progress(run.iterations, quiet=opts.quiet)
    t_start = time.perf_counter()
    t_ready = None
    watch: Optional[TrainingWatch] = None
    leftover: List[int] = []
    try:
        swarm.start(timeout=opts.start_timeout_s)
        t_ready = time.perf_counter()
        watch = TrainingWatch(swarm, opts.start_timeout_s, opts.stall_timeout_s, logs=str(out / NODES_DIR),
                              on_iteration=lambda h: progress(types.SimpleNamespace(**h)))
        while not watch.poll():
            time.sleep(_POLL_S)
    finally:
        leftover = swarm.stop_shielded()
    history = watch.history if watch is not None else []
    first, t_first = (watch.first, watch.t_first) if watch is not None else (None, None)
    t_end = time.perf_counter()
    after, _ = _stage_modules_from_checkpoints(ckpt_root, mcfg, run.seed, first_of)
    val_after = evaluate_loss(after, val)
    first = first if first is not None else 0
    prev = out / "history.json"
    if run.resume and prev.exists():
        old = [h for h in json.loads(prev.read_text()) if h["iteration"] < first]
        history = old + [h for h in history if h["iteration"] >= first]
    prev.write_text(json.dumps(history, indent=1))
    plotted = _plot(history, out / "loss.png", f"skippipe up: {run.model} on {run.corpus} ({n_nodes} daemons)")
    trained = [h for h in history if h["iteration"] >= first]
    train_s = sum(h["seconds"] for h in trained)
    summary = {
        "mode": "daemons", "iterations": run.iterations, "resumed_from": first, "nodes": n_nodes,
        "data_nodes": opts.data_nodes, "replicas": replicas, "path_length": run.path_length,
        "n_stages": mcfg.n_stages, "model": run.model, "corpus": run.corpus, "scheduler": "skippipe",
        "first_loss": history[0]["loss"], "final_loss": history[-1]["loss"],
        "val_loss_before": val_before, "val_loss_after": val_after,
        "tokens_per_s": sum(h["tokens"] for h in trained) / max(train_s, 1e-9),
        "mean_iteration_s": train_s / max(len(trained), 1),
        "startup_s": (t_first or t_end) - t_start, "daemons_ready_s": (t_ready or t_end) - t_start,
        "wall_s": t_end - t_start, "loss_png": str(out / "loss.png") if plotted else None,
        "checkpoints": str(ckpt_root), "leftover_processes": len(leftover),
        "epoch": watch.states.get(watch.lead.index, {}).get("epoch") if watch is not None else None,
        "dead_nodes": sorted(watch.deaths.dead) if watch is not None else [],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
