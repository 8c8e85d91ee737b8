"""``skippipe up``: train a tiny model on a local swarm, with no flags needed.

By default (:func:`run_up_swarm`) every node is a real daemon: one ``skippipe node run --train``
process per node on 127.0.0.1, started and stopped by :class:`node.testing.process_swarm.LocalSwarm`, with
progress read from the data nodes' ``training`` RPC. ``--in-process`` keeps the older harness,
:class:`LocalSwarm` here: one real hivemind ``P2P`` (its own p2pd) and ``DHT`` per node in this
process plus a bootstrap peer, each node a :class:`node.train.trainer.TrainerNode` exactly as the daemon
runs it, with a hand-built or loopback-scheduled schedule (:func:`build_schedule`); tests and the
benchmark use it. Outputs: a progress line per iteration, ``loss.png``, ``history.json`` and
``summary.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import math
import os
import pathlib
import signal
import sys
import time
import types
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Dict, List, Optional, Sequence

from node.cli.emulation_args import (add_emulation_arguments, emulation_from_args, emulation_node_args,
                                  round_robin_emulation_for)
from node.errors import UserError
from node.ops.plotting import load_pyplot

__all__ = ["register", "build_schedule", "scheduler_schedule", "LocalSwarm", "UpOptions", "run_up", "run_up_swarm"]

logger = logging.getLogger(__name__)

#: Defaults of ``skippipe up``: 2 data nodes + stages 1..5 of the tiny model, two replicas for
#: stages 1 and 2, paths of 4 stages out of 6 (skip ratio 1/3); about a minute on 2 CPU cores.
DEFAULT_ITERATIONS = 40
DEFAULT_DATA_NODES = 2
DEFAULT_REPLICAS = "2,2,1,1,1"
DEFAULT_PATH_LENGTH = 4
DEFAULT_MICROBATCHES = 4
DEFAULT_MEMORY = 2
DEFAULT_LR = 3e-3
#: Validation batches used for the before/after loss of the full model.
VAL_BATCHES = 8


def build_schedule(n_stages: int, data_nodes: int, replicas: Sequence[int], path_length: int,
                   microbatches: int, memory: int, reorder: bool = False) -> dict:
    """A schedule JSON (docs/CONTRACTS.md) with balanced paths, built by hand.

    Node ids: ``0..data_nodes-1`` are the data nodes, then stage 1's replicas, stage 2's, ...
    Microbatch ``g`` (counted over all data nodes) visits the ``g``-th combination (cyclically) of
    ``path_length - 1`` of the stages ``1..n_stages-1`` in increasing order, each stage at its
    replicas in round-robin; with ``reorder`` every fourth path swaps its last two stages.
    """
    if len(replicas) != n_stages - 1:
        raise UserError(f"need replica counts for stages 1..{n_stages - 1}, got {len(replicas)}")
    if not 1 <= path_length <= n_stages:
        raise UserError(f"path length must be in 1..{n_stages}, got {path_length}")
    if data_nodes < 1 or min(replicas, default=1) < 1 or microbatches < 1 or memory < 1:
        raise UserError("data nodes, replicas, microbatches and memory must be positive")
    stages = [list(range(data_nodes))]
    nxt = data_nodes
    for r in replicas:
        stages.append(list(range(nxt, nxt + r)))
        nxt += r
    combos = list(itertools.combinations(range(1, n_stages), path_length - 1))
    use_count: Dict[int, int] = {s: 0 for s in range(1, n_stages)}
    paths = []
    g = 0
    for j in range(microbatches):
        for d in range(data_nodes):
            order = list(combos[g % len(combos)])
            if reorder and g % 4 == 3 and len(order) >= 2:
                order[-1], order[-2] = order[-2], order[-1]
            route = [d]
            for s in order:
                route.append(stages[s][use_count[s] % len(stages[s])])
                use_count[s] += 1
            paths.append({"data_node": d, "route": route, "microbatches": 1})
            g += 1
    paths.sort(key=lambda p: p["data_node"])  # stable: microbatch order per data node kept
    n = nxt
    return {"stages": stages, "path_length": path_length, "memory": memory, "paths": paths,
            "cost": {"compute_s": [0.0] * n, "link_s": [[0.0] * n for _ in range(n)]}}


#: Loopback cost model handed to the SkipPipe path scheduler by ``skippipe up``: all nodes equal,
#: every link equal (seconds per microbatch); only the relative sizes matter to the search.
LOOPBACK_COMPUTE_S = 0.01
LOOPBACK_LINK_S = 0.002
SCHEDULER_BUDGET_S = 2.0
#: Grace period for a DHT process to exit before it is killed.
DHT_SHUTDOWN_TIMEOUT_S = 5.0


def scheduler_schedule(builtin: dict, path_length: int, microbatches: int, memory: int, seed: int = 0) -> dict:
    """Same allocation as ``builtin``, paths from :func:`scheduler.paths.schedule_paths`."""
    from scheduler.cost import CostMatrix
    from scheduler.paths import schedule_paths

    n = sum(len(s) for s in builtin["stages"])
    cost = CostMatrix(tuple([LOOPBACK_COMPUTE_S] * n),
                      tuple(tuple(0.0 if i == j else LOOPBACK_LINK_S for j in range(n)) for i in range(n)))
    try:
        sched = schedule_paths(builtin["stages"], cost, path_length, microbatches, memory, seed=seed,
                               budget_s=SCHEDULER_BUDGET_S)
    except Exception as e:  # ScheduleError names the violated constraint
        raise UserError(f"the path scheduler found no schedule: {e}")
    return sched.to_json()


class LocalSwarm:
    """A swarm of :class:`TrainerNode` on 127.0.0.1, all in this process (one p2pd + DHT each)."""

    def __init__(self, schedule: dict, config, splits=None, threads_per_node: Optional[int] = 1,
                 on_iteration: Optional[Callable] = None,
                 emulation_for: Optional[Callable[[int, Sequence[str]], object]] = None,
                 faults_for: Optional[Callable[[int], object]] = None):
        """``emulation_for(i, members)``: optional per-node :class:`node.dataplane.emulation.Emulation` (off by default).
        ``self.epoch`` may be replaced between iterations (same allocation) to switch schedules."""
        self.emulation_for = emulation_for
        #: ``faults_for(i)``: optional per-node :class:`node.testing.faults.FaultInjector` (deterministic fault tests)
        self.faults_for = faults_for
        #: peer ids of nodes that were killed; stands in for the daemon's view (advert expiry) here
        self.dead: set = set()
        self.schedule, self.config, self.splits = schedule, config, splits
        self.threads_per_node = threads_per_node
        self.on_iteration = on_iteration
        self.n_nodes = sum(len(s) for s in schedule["stages"])
        self.p2ps: list = []
        self.dhts: list = []
        self.nodes: list = []
        self._bootstrap = None
        self._bootstrap_dht = None

    async def start(self) -> None:
        import torch

        from node.compat import import_hivemind
        from node.train.trainer import TrainerNode
        from protocol import ScheduleEpoch

        hivemind = import_hivemind()
        if self.threads_per_node:
            torch.set_num_threads(self.threads_per_node)
        loop = asyncio.get_running_loop()
        local = ["/ip4/127.0.0.1/tcp/0"]
        self._bootstrap = await hivemind.p2p.P2P.create(host_maddrs=local)
        self._bootstrap_dht = await loop.run_in_executor(
            None, lambda: hivemind.DHT(p2p=self._bootstrap, start=True))
        initial = [str(a) for a in await self._bootstrap.get_visible_maddrs()]

        async def make_node():
            p2p = await hivemind.p2p.P2P.create(host_maddrs=local, initial_peers=initial)
            dht = await loop.run_in_executor(None, lambda: hivemind.DHT(p2p=p2p, initial_peers=initial, start=True))
            return p2p, dht

        for _ in range(self.n_nodes):  # sequential: forking DHT processes concurrently is not faster on 2 cores
            p2p, dht = await make_node()
            self.p2ps.append(p2p)
            self.dhts.append(dht)
        maddrs = [p._visible_maddrs for p in self.p2ps]  # without the /p2p/ suffix p2pd expects
        for i, j in itertools.combinations(range(self.n_nodes), 2):
            await self.p2ps[i]._client.connect(self.p2ps[j].peer_id, maddrs[j])
        members = tuple(str(p.peer_id) for p in self.p2ps)
        self.epoch = ScheduleEpoch(self.config.run_id, 0, str(self._bootstrap.peer_id), time.time(), members,
                                   self.schedule, b"")
        for i, (p2p, dht) in enumerate(zip(self.p2ps, self.dhts)):
            node = TrainerNode(p2p=p2p, dht=dht, peer_id=members[i], epoch=lambda: self.epoch, config=self.config,
                               splits=self.splits, node_name=f"node{i}",
                               on_iteration=self.on_iteration if i == 0 else None,
                               emulation=self.emulation_for(i, members) if self.emulation_for else None,
                               alive=self.is_alive, faults=self.faults_for(i) if self.faults_for else None,
                               on_kill=lambda i=i: self._on_kill(i))
            await node.setup()
            self.nodes.append(node)
        logger.info("local swarm of %d nodes ready", self.n_nodes)
        starts = {n.current_iteration for n in self.nodes}
        if len(starts) != 1:
            raise UserError(f"checkpoints disagree on the iteration to resume from: {sorted(starts)}")

    @property
    def start_iteration(self) -> int:
        return self.nodes[0].current_iteration

    def is_alive(self, peer_id: str) -> bool:
        return peer_id not in self.dead

    def _on_kill(self, i: int) -> None:
        """A node died (fault injection): its p2pd goes away, so streams to it break like a dead host's."""
        self.dead.add(str(self.p2ps[i].peer_id))
        asyncio.ensure_future(self._kill_p2p(i))

    async def _kill_p2p(self, i: int) -> None:
        node = self.nodes[i] if i < len(self.nodes) else None
        if node is not None and node.dataplane.transport is not None:
            with contextlib.suppress(Exception):
                await node.dataplane.transport.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.p2ps[i].shutdown(), DHT_SHUTDOWN_TIMEOUT_S)

    def kill(self, i: int) -> None:
        """Kill node ``i`` now, mid-whatever (its trainer stops, its p2pd is shut down)."""
        self.nodes[i].kill()

    async def train(self, iterations: int):
        """Run all nodes to ``iterations`` committed iterations; returns node 0's history."""
        from node.train.trainer import NodeKilled

        async def run(n):
            try:
                return await n.run(iterations)
            except NodeKilled:
                return None

        tasks = [asyncio.create_task(run(n)) for n in self.nodes]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return results[0]

    def stage_modules(self):
        """Replica 0 of every stage, in stage order (for evaluation and comparisons)."""
        return [self.nodes[nodes[0]].runtime.module for nodes in self.schedule["stages"]]

    async def close(self) -> None:
        """Stop every node, DHT and p2pd, in parallel; a DHT child that lingers is killed."""
        t0 = time.perf_counter()

        async def stop_node(n):
            try:
                await n.shutdown()
            except Exception:
                logger.exception("shutting down %s", n.node_name)

        await asyncio.gather(*(stop_node(n) for n in self.nodes))
        loop = asyncio.get_running_loop()

        async def stop_dht(d):
            try:
                await asyncio.wait_for(loop.run_in_executor(None, d.shutdown), DHT_SHUTDOWN_TIMEOUT_S)
            except Exception:
                pass
            if d.is_alive():  # forked children may ignore SIGTERM (inherited handlers)
                d.kill()
                await loop.run_in_executor(None, d.join, DHT_SHUTDOWN_TIMEOUT_S)

        await asyncio.gather(*(stop_dht(d) for d in self.dhts + ([self._bootstrap_dht] if self._bootstrap_dht else [])))
        for p in self.p2ps + ([self._bootstrap] if self._bootstrap else []):
            try:
                await asyncio.wait_for(p.shutdown(), DHT_SHUTDOWN_TIMEOUT_S)
            except Exception:
                pass
        self.nodes, self.dhts, self.p2ps = [], [], []
        self._bootstrap = self._bootstrap_dht = None
        logger.info("local swarm closed in %.1f s", time.perf_counter() - t0)

    async def __aenter__(self) -> "LocalSwarm":
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


# ---------------------------------------------------------------------- the command
@dataclass
class UpOptions:
    iterations: int = DEFAULT_ITERATIONS
    out: str = "skippipe-up"
    model: str = "tiny"
    corpus: str = "shakespeare"
    data_nodes: int = DEFAULT_DATA_NODES
    replicas: str = DEFAULT_REPLICAS
    path_length: int = DEFAULT_PATH_LENGTH
    microbatches: int = DEFAULT_MICROBATCHES
    microbatch_size: int = 8
    memory: int = DEFAULT_MEMORY
    lr: float = DEFAULT_LR
    seed: int = 0
    checkpoint_every: int = 10
    resume: bool = False
    reorder: bool = True
    scheduler: str = "skippipe"  # "skippipe" (scheduler.paths) or "builtin" (build_schedule)
    quiet: bool = False
    in_process: bool = False  # the in-process harness instead of one daemon process per node
    heartbeat_s: float = 2.0  # daemons' heartbeat (daemon mode)
    start_timeout_s: float = 480.0  # daemon mode: until the first iteration is committed
    stall_timeout_s: float = 240.0  # daemon mode: longest wait for the next iteration
    emulation: Optional[object] = None  # node.cli.emulation_args.EmulationSettings; None = no WAN/compute emulation
    device: str = "cpu"  # cpu | cuda | auto (every node of the local swarm on it)
    precision: str = "auto"  # auto | fp32 | bf16 | fp16
    wire: str = "fp32"  # fp32 | bf16 | fp16 | int8


def _parse_replicas(text: str, n_stages: int) -> List[int]:
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

    def __init__(self, total: int, stream=sys.stderr, quiet: bool = False):
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
    from node.train.data import DataConfig, load_splits, validation_batches
    from node.train.model import model_config
    from node.train.reference import evaluate_loss
    from node.train.runtime import OptimConfig
    from node.train.trainer import TrainerConfig

    if opts.iterations < 1:
        raise UserError("--iterations must be at least 1")
    out = pathlib.Path(opts.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create output folder {out}: {e}")
    data_cfg = DataConfig(corpus=opts.corpus, microbatch_size=opts.microbatch_size, seed=opts.seed)
    splits = load_splits(data_cfg)
    mcfg = model_config(opts.model, vocab_size=max(splits.vocab_size, 256) if opts.model != "500m" else None)
    data_cfg = replace(data_cfg, seq_len=min(mcfg.context, 64 if opts.model == "tiny" else mcfg.context))
    replicas = _parse_replicas(opts.replicas, mcfg.n_stages)
    schedule = build_schedule(mcfg.n_stages, opts.data_nodes, replicas, opts.path_length, opts.microbatches,
                              opts.memory, reorder=opts.reorder)
    if opts.scheduler == "skippipe":
        t_sched = time.perf_counter()
        schedule = scheduler_schedule(schedule, opts.path_length, opts.microbatches, opts.memory, opts.seed)
        logger.info("path scheduler took %.1f s", time.perf_counter() - t_sched)
    elif opts.scheduler != "builtin":
        raise UserError(f"unknown scheduler {opts.scheduler!r}; choose 'skippipe' or 'builtin'")
    config = TrainerConfig(run_id="up", model=mcfg, optim=OptimConfig(lr=opts.lr), data=data_cfg, seed=opts.seed,
                           checkpoint_dir=str(out / "checkpoints"), checkpoint_every=opts.checkpoint_every,
                           resume=opts.resume, **_compute_config(opts))
    val = validation_batches(splits, data_cfg, VAL_BATCHES)
    n_nodes = sum(len(s) for s in schedule["stages"])
    if not opts.quiet:
        print(f"starting a local swarm: bootstrap + {n_nodes} nodes ({opts.data_nodes} data nodes, stage replicas "
              f"{replicas}), model {opts.model}, path length {opts.path_length}/{mcfg.n_stages}, corpus {opts.corpus}, "
              f"{opts.scheduler} schedule",
              file=sys.stderr)
    progress = _Progress(opts.iterations, quiet=opts.quiet)
    t_start = time.perf_counter()
    emulation_for = round_robin_emulation_for(opts.emulation) if opts.emulation is not None else None
    async with LocalSwarm(schedule, config, splits, on_iteration=progress, emulation_for=emulation_for) as swarm:
        t_ready = time.perf_counter()
        first = swarm.start_iteration
        if first >= opts.iterations:
            raise UserError(f"checkpoints are already at iteration {first}; ask for more --iterations")
        val_before = evaluate_loss(swarm.stage_modules(), val)
        stats = await swarm.train(opts.iterations)
        val_after = evaluate_loss(swarm.stage_modules(), val)
    t_end = time.perf_counter()
    history = [asdict(s) for s in stats]
    prev = out / "history.json"
    if opts.resume and prev.exists():
        old = [h for h in json.loads(prev.read_text()) if h["iteration"] < first]
        history = old + history
    prev.write_text(json.dumps(history, indent=1))
    plotted = _plot(history, out / "loss.png", f"skippipe up: {opts.model} on {opts.corpus}")
    train_s = sum(s.seconds for s in stats)
    summary = {
        "iterations": opts.iterations, "resumed_from": first, "nodes": n_nodes, "data_nodes": opts.data_nodes,
        "replicas": replicas, "path_length": opts.path_length, "n_stages": mcfg.n_stages, "model": opts.model,
        "corpus": opts.corpus, "scheduler": opts.scheduler, "first_loss": history[0]["loss"], "final_loss": history[-1]["loss"],
        "val_loss_before": val_before, "val_loss_after": val_after,
        "tokens_per_s": sum(s.tokens for s in stats) / max(train_s, 1e-9),
        "mean_iteration_s": train_s / max(len(stats), 1), "startup_s": t_ready - t_start,
        "wall_s": t_end - t_start, "loss_png": str(out / "loss.png") if plotted else None,
        "checkpoints": str(out / "checkpoints"),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


# ---------------------------------------------------------------------- daemon mode
#: Where the daemons of ``skippipe up`` keep identities, logs and ready files (under --out).
NODES_DIR = "nodes"
RUN_ID = "up"
_POLL_S = 1.0


def _layout(opts: UpOptions):
    """Model config, data config, replica counts (flag checks shared with the in-process harness)."""
    from node.train.data import DataConfig
    from node.train.model import model_config

    if opts.iterations < 1:
        raise UserError("--iterations must be at least 1")
    mcfg = model_config(opts.model)
    replicas = _parse_replicas(opts.replicas, mcfg.n_stages)
    build_schedule(mcfg.n_stages, opts.data_nodes, replicas, opts.path_length, opts.microbatches, opts.memory)
    if opts.scheduler != "skippipe":
        raise UserError("--scheduler builtin needs --in-process (the daemons' coordinator uses the SkipPipe scheduler)")
    data_cfg = DataConfig(corpus=opts.corpus, microbatch_size=opts.microbatch_size, seed=opts.seed,
                          seq_len=min(mcfg.context, 64) if opts.model == "tiny" else mcfg.context)
    return mcfg, data_cfg, replicas


def _compute_config(opts: UpOptions) -> dict:
    """TrainerConfig fields for --device/--precision/--wire (checked: one error line if unusable)."""
    from node.train.averaging import AveragingConfig, averaging_compression_for_wire
    from node.train.precision import resolve_device, resolve_precision

    try:
        device = resolve_device(opts.device)
        return dict(device=device, precision=resolve_precision(opts.precision, device), wire=opts.wire,
                    averaging=AveragingConfig(compression=averaging_compression_for_wire(opts.wire)))
    except ValueError as e:
        raise UserError(str(e)) from None


def _node_args(opts: UpOptions, out: pathlib.Path, n_nodes: int) -> Callable[[int], List[str]]:
    def args(i: int) -> List[str]:
        a = ["--train", "--model", opts.model, "--corpus", opts.corpus, "--iterations", str(opts.iterations),
             "--checkpoint-dir", str(out / "checkpoints"), "--checkpoint-every", str(opts.checkpoint_every),
             "--node-name", f"node{i}", "--min-members", str(n_nodes), "--lr", repr(opts.lr), "--seed", str(opts.seed),
             "--microbatch-size", str(opts.microbatch_size), "--microbatches", str(opts.microbatches),
             "--memory-slots", str(opts.memory), "--threads", "1", "--iteration-timeout", "180",
             "--agreement-timeout", str(int(opts.start_timeout_s)), "--log-level", "INFO"]
        compute = ["--device", opts.device, "--precision", opts.precision, "--wire", opts.wire]
        return a + compute + (["--resume"] if opts.resume else []) + emulation_node_args(opts.emulation, i)
    return args


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


def run_up_swarm(opts: UpOptions) -> dict:
    """``skippipe up`` on real daemons: one ``skippipe node run --train`` process per node.

    Node 0 founds the swarm (it is also data node 0), the rest join through it; all run with
    ``--min-members`` = the node count, so they train on the one epoch that holds everybody.
    Progress comes from the data nodes' ``training`` RPC. Every daemon is stopped (process groups,
    so no p2pd survives) on success, failure, Ctrl+C and SIGTERM.
    """
    from node.train.data import load_splits, validation_batches
    from node.testing.process_swarm import LocalSwarm as DaemonSwarm
    from node.train.reference import evaluate_loss
    from node.net.rpc import call_http

    mcfg, data_cfg, replicas = _layout(opts)
    out = pathlib.Path(opts.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create output folder {out}: {e}")
    stage_sizes = [opts.data_nodes] + replicas
    n_nodes = sum(stage_sizes)
    # replica 0 of stage k is the first node index of that stage (LocalSwarm's layout)
    first_of = {k: f"node{sum(stage_sizes[:k])}" for k in range(len(stage_sizes))}
    splits = load_splits(data_cfg)
    val = validation_batches(splits, data_cfg, VAL_BATCHES)
    ckpt_root = out / "checkpoints"
    # a fresh run starts from the initial weights even where an earlier run left checkpoints in --out
    # (the daemons overwrite them); only --resume starts from them
    before, ck_iters = _stage_modules_from_checkpoints(ckpt_root if opts.resume else None, mcfg, opts.seed, first_of)
    if opts.resume and min(ck_iters) + 1 >= opts.iterations:
        raise UserError(f"checkpoints are already at iteration {min(ck_iters) + 1}; ask for more --iterations")
    val_before = evaluate_loss(before, val)  # initial weights, or the checkpoints resumed from
    swarm = DaemonSwarm(n_nodes, stage_sizes, base_dir=out / NODES_DIR, run_id=RUN_ID, heartbeat_s=opts.heartbeat_s,
                        path_length=opts.path_length, extra_args=_node_args(opts, out, n_nodes))
    if not opts.quiet:
        print(f"starting a local swarm of {n_nodes} daemons ({opts.data_nodes} data nodes, stage replicas {replicas}; "
              f"node 0 founds it), model {opts.model}, path length {opts.path_length}/{mcfg.n_stages}, "
              f"corpus {opts.corpus}; logs in {out / NODES_DIR}", file=sys.stderr)
    progress = _Progress(opts.iterations, quiet=opts.quiet)
    t_start = time.perf_counter()
    history: List[dict] = []
    first: Optional[int] = None
    t_ready = t_first = None
    leftover: List[int] = []
    try:
        swarm.start(timeout=opts.start_timeout_s)
        t_ready = time.perf_counter()
        data_nodes = [n for n in swarm.nodes if n.stage == 0]
        lead = data_nodes[0]
        last_progress = time.monotonic()
        last_full_check = 0.0
        states: Dict[int, dict] = {}
        while True:
            for node in swarm.nodes:
                if not node.alive:
                    raise UserError(f"node {node.index} (stage {node.stage}) exited: {swarm.last_error(node)}")
            check_all = time.monotonic() - last_full_check > 5.0
            for node in (swarm.nodes if check_all else data_nodes):
                try:
                    states[node.index] = call_http(node.rpc_url, "training",
                                                   {"since": history[-1]["iteration"] if history else -1}
                                                   if node is lead else {"limit": 1}, timeout=10.0)
                except Exception:  # noqa: BLE001 - a busy node answers next time
                    continue
            if check_all:
                last_full_check = time.monotonic()
            for idx, st in states.items():
                if st.get("state") == "error":
                    raise UserError(f"training failed on node {idx}: {st.get('error')}")
            lead_state = states.get(lead.index, {})
            if first is None and lead_state.get("start_iteration") is not None:
                first = int(lead_state["start_iteration"])
            for h in lead_state.get("history", []):
                if not history or h["iteration"] > history[-1]["iteration"]:
                    history.append(h)
                    last_progress = time.monotonic()
                    t_first = t_first or time.perf_counter()
                    progress(types.SimpleNamespace(**h))
            lead_state["history"] = []
            if all(states.get(n.index, {}).get("state") == "done" for n in swarm.nodes):
                break
            if all(states.get(n.index, {}).get("state") == "done" for n in data_nodes):
                last_full_check = 0.0  # the others finish the same iteration: ask them at once
            waited = time.monotonic() - last_progress
            if not history and waited > opts.start_timeout_s:
                raise UserError(f"training did not start within {opts.start_timeout_s:.0f} s "
                                f"(states: {_state_line(states, swarm)}); see the logs in {out / NODES_DIR}")
            if history and waited > opts.stall_timeout_s:
                raise UserError(f"training stalled at iteration {history[-1]['iteration'] + 1}: no progress for "
                                f"{waited:.0f} s (states: {_state_line(states, swarm)}); logs in {out / NODES_DIR}")
            time.sleep(_POLL_S)
    finally:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl+C must not abort the clean stop
        try:
            swarm.stop()
            leftover = [p for n in swarm.nodes for p in n.group_pids()]
        finally:
            signal.signal(signal.SIGINT, previous)
    t_end = time.perf_counter()
    after, _ = _stage_modules_from_checkpoints(ckpt_root, mcfg, opts.seed, first_of)
    val_after = evaluate_loss(after, val)
    first = first if first is not None else 0
    prev = out / "history.json"
    if opts.resume and prev.exists():
        old = [h for h in json.loads(prev.read_text()) if h["iteration"] < first]
        history = old + [h for h in history if h["iteration"] >= first]
    prev.write_text(json.dumps(history, indent=1))
    plotted = _plot(history, out / "loss.png", f"skippipe up: {opts.model} on {opts.corpus} ({n_nodes} daemons)")
    trained = [h for h in history if h["iteration"] >= first]
    train_s = sum(h["seconds"] for h in trained)
    summary = {
        "mode": "daemons", "iterations": opts.iterations, "resumed_from": first, "nodes": n_nodes,
        "data_nodes": opts.data_nodes, "replicas": replicas, "path_length": opts.path_length,
        "n_stages": mcfg.n_stages, "model": opts.model, "corpus": opts.corpus, "scheduler": "skippipe",
        "first_loss": history[0]["loss"], "final_loss": history[-1]["loss"],
        "val_loss_before": val_before, "val_loss_after": val_after,
        "tokens_per_s": sum(h["tokens"] for h in trained) / max(train_s, 1e-9),
        "mean_iteration_s": train_s / max(len(trained), 1),
        "startup_s": (t_first or t_end) - t_start, "daemons_ready_s": (t_ready or t_end) - t_start,
        "wall_s": t_end - t_start, "loss_png": str(out / "loss.png") if plotted else None,
        "checkpoints": str(ckpt_root), "leftover_processes": len(leftover),
        "epoch": states.get(lead.index, {}).get("epoch") if t_ready else None,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def _state_line(states: Dict[int, dict], swarm) -> str:
    parts = []
    for n in swarm.nodes:
        st = states.get(n.index)
        parts.append(f"node{n.index}=" + (f"{st.get('state')}@{st.get('committed_iteration')}" if st else "?"))
    return " ".join(parts)


def _print_summary(summary: dict, out: str) -> None:
    print(f"done: {summary['iterations']} iterations on {summary['nodes']} nodes in {summary['wall_s']:.1f} s "
          f"(startup {summary['startup_s']:.1f} s)")
    print(f"  train loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f};  validation loss (full model) "
          f"{summary['val_loss_before']:.4f} -> {summary['val_loss_after']:.4f}")
    print(f"  {summary['tokens_per_s']:,.0f} tokens/s, {summary['mean_iteration_s']:.2f} s per iteration")
    print(f"  loss curve: {summary['loss_png']}  summary: {pathlib.Path(out) / 'summary.json'}")


def _handler(args: argparse.Namespace) -> int:
    opts = UpOptions(iterations=args.iterations, out=args.out, model=args.model, corpus=args.corpus,
                     data_nodes=args.data_nodes, replicas=args.replicas, path_length=args.path_length,
                     microbatches=args.microbatches, microbatch_size=args.microbatch_size, memory=args.memory,
                     lr=args.lr, seed=args.seed, checkpoint_every=args.checkpoint_every, resume=args.resume,
                     reorder=not args.no_reorder, scheduler=args.scheduler, quiet=args.quiet,
                     in_process=args.in_process, emulation=emulation_from_args(args, require_location=False),
                     device=args.device, precision=args.precision, wire=args.wire)
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
    p.add_argument("--iterations", type=int, default=DEFAULT_ITERATIONS, help="total iterations (default %(default)s)")
    p.add_argument("--out", default="skippipe-up", help="output folder (default ./%(default)s)")
    p.add_argument("--model", default="tiny", choices=["tiny", "small", "500m"])
    p.add_argument("--corpus", default="shakespeare", choices=["shakespeare", "sotu"])
    p.add_argument("--data-nodes", type=int, default=DEFAULT_DATA_NODES)
    p.add_argument("--replicas", default=DEFAULT_REPLICAS,
                   help="replicas of stages 1..S-1, comma-separated or one number (default %(default)s)")
    p.add_argument("--path-length", type=int, default=DEFAULT_PATH_LENGTH,
                   help="stages per microbatch incl. stage 0 (default %(default)s; = stages for no skipping)")
    p.add_argument("--microbatches", type=int, default=DEFAULT_MICROBATCHES, help="per data node per iteration")
    p.add_argument("--microbatch-size", type=int, default=8, help="sequences per microbatch")
    p.add_argument("--memory", type=int, default=DEFAULT_MEMORY, help="in-flight microbatches per node")
    p.add_argument("--lr", type=float, default=DEFAULT_LR)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--resume", action="store_true", help="continue from the checkpoints in --out")
    p.add_argument("--scheduler", default="skippipe", choices=["skippipe", "builtin"],
                   help="paths from the SkipPipe path scheduler (default) or a fixed round-robin of stage subsets")
    p.add_argument("--no-reorder", action="store_true", help="builtin scheduler: keep every path in stage order")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--in-process", action="store_true",
                   help="run every node in this process (the test/benchmark harness) instead of one daemon per node")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"],
                   help="torch device of every node (auto: cuda when available; default cpu)")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="compute precision (auto: bf16 on a GPU that supports it, else fp32)")
    p.add_argument("--wire", default="fp32", choices=["fp32", "bf16", "fp16", "int8"],
                   help="wire format of activations and gradients (default fp32)")
    add_emulation_arguments(p, location=False)  # nodes get the profile's locations round-robin
    p.set_defaults(func=_handler)
