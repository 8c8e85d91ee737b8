"""Live WAN benchmark: full pipeline vs random skip vs SkipPipe on 20 emulated geo-distributed nodes.

Why: the scheduler's claim (SkipPipe iterations ~1/3 of a full pipeline's on the geo-distributed
profile) is a simulator result; this measures it on the real training runtime, with every
data-plane message delayed as the profile's links would delay it (:mod:`node.dataplane.emulation`) and
every compute step padded to the profile's GPU speed, and prints the simulator's prediction for
the very same schedule and cost matrix next to the measurement.

Setup (one invocation, back to back, same model, same data):

* 20 nodes, stage sizes 5,3,3,3,3,3, path length 4 of 6, 6 microbatches of 8 sequences per data
  node, memory 3, on the geo-distributed-12 profile. One node-to-stage allocation
  (:func:`scheduler.allocation.allocate` over the 20 round-robin placed nodes) decides which
  location holds which stage, the same for all three schedules.
* **Default harness: 20 real daemons** (``skippipe node run --train`` processes started by
  :class:`node.launch.process_swarm.ProcessSwarm`, one process group each), one fresh swarm per schedule
  policy, back to back: ``--schedule-policy full`` (:func:`scheduler.baselines.full_pipeline`),
  ``random`` (:func:`scheduler.baselines.random_skip`) and ``skippipe``
  (:func:`scheduler.paths.schedule_paths`), each computed by the swarm's own coordinator. Every
  daemon gets ``--network-profile FILE --location NAME`` (its allocated location) with the scaled
  latencies/bandwidths below and ``--compute-s-per-sample-per-layer``; the founder passes
  ``--schedule-cost emulation`` so the coordinator schedules for the emulated links (the daemons'
  link probes run over loopback and would otherwise make every schedule network-blind). Torch is
  limited to 1 thread per daemon. ``--in-process`` runs the older harness instead
  (:class:`node.launch.inproc_swarm.InProcessSwarm`: 20 nodes with real hivemind P2P + DHT in this process,
  schedules computed here, epochs switched on one swarm).
* Model: tiny (6 stages x 1 layer, d_model 64, context 64, fp32 activations of 8 x 64 x 64 x 4 =
  128 KiB). It stands in for the paper's setting (4 layers per stage, d_model 1024, context 1024:
  32 MiB activations) replayed ``1 / time_scale`` times faster:
  - compute: ``0.055 s/sample/layer x (4 / 1 layers) x time_scale`` per sample per tiny layer;
  - latency: profile latency x ``time_scale``; per-hop overhead ``0.35 s x time_scale`` (the cost
    model's fixed per-message cost, emulated as extra latency);
  - bandwidth: profile bandwidth x ``(128 KiB / 32 MiB) / time_scale``, so a tiny activation takes
    as long (scaled) as a paper-sized one.
  With the default time scale 0.2 an emulated SkipPipe iteration is ~15 s, far above the real
  compute of the tiny model, so the 2 shared cores mostly wait (sleeping compute threads, held
  frames).
* The prediction: the schedule the run actually used (the daemons' adopted epoch, read over RPC,
  or the in-process schedule) simulated (:func:`scheduler.simulator.simulate`) on the cost matrix
  of exactly these emulated quantities (:func:`scheduler.cost.build_cost` with the scaled profile,
  the tiny model's shape and each member's location), with transfers on one link queueing for it
  (``link_busy_s`` = bytes / bandwidth: the emulated links serialise concurrent sends, so the
  prediction does too). The reference's unshared-link prediction is printed next to it.
* Emulation fidelity: hop messages carry their emulated delivery time and compute is padded from
  when a step could start, so the host's real overheads run inside the emulated budgets instead of
  on top of them (:mod:`node.dataplane.emulation`). Where they do not fit, the run says by how much
  ("behind the emulation": compute overrun and late frames per iteration, summed over nodes).

Measured "iteration time" = the microbatch phase of an iteration (first forward to the last
backward, as every node learns it from the data nodes' ``IterationDone``;
``IterationStats.microbatch_s`` from each daemon's ``training`` RPC; the minimum over nodes),
which is what the simulator's ``iteration_time_s`` predicts. The whole iteration (data node 0's
``IterationStats.seconds``: microbatches, averaging, norm exchange, step; ``full_iteration_s``) is
printed next to the simulator's ``whole_iteration_s``: the same simulation plus a commit phase
(:func:`scheduler.simulator.commit_model`: each stage's all-reduce of its parameter bytes over the
slowest emulated link of its replica group, then one norm message over the slowest link between
members). The live run pads averaging to that same all-reduce time and sends the norm reports over
the emulated links (docs/emulation.md), so both sides model the same commit.

Run: ``python bench/wan.py`` (daemons; about 26 minutes on 2 cores, 3 swarms of 20 daemons one
after another); ``--in-process`` (about 4 minutes at ``--time-scale 0.05``); ``--time-scale``, ``--iterations``,
``--warmup``. Writes ``bench/results/wan.json`` and ``bench/results/wan.png``. No daemon or p2pd
survives the run (process groups are stopped, then killed; the count left is reported).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import pathlib
import platform
import signal
import statistics
import sys
import time
from dataclasses import asdict, replace
from typing import Dict, List, Sequence, Tuple

_HERE = pathlib.Path(__file__).resolve().parent
_ROOT = _HERE.parent

import node.compat  # noqa: F401  (before hivemind)
from node.ops.plotting import load_pyplot

__all__ = ["main", "scaled_profile", "build_setting"]

logger = logging.getLogger(__name__)

DEFAULT_PROFILE = "/work/shared/profiles/geo-distributed-12.json"
#: The paper's (reference) model shape the tiny model stands in for.
PAPER_LAYERS_PER_STAGE = 4
PAPER_D_MODEL = 1024
PAPER_SEQ_LEN = 1024
#: The cost model's per-hop overhead in the paper's setting (scheduler.cost.CostParams).
PAPER_HOP_OVERHEAD_S = 0.35
TINY_SEQ_LEN = 64
BYTES_PER_ELEMENT = 4
RUN_ID = "wan"


def scaled_profile(profile, latency_scale: float, bandwidth_scale: float, compute_s_per_sample_per_layer: float):
    """The profile as the emulation replays it (a new LinkProfile; the original is untouched)."""
    from scheduler.cost import Link

    def scale(link):
        return Link(link.latency_ms * latency_scale, link.bandwidth_GiBps * bandwidth_scale)

    return replace(profile, name=f"{profile.name}-scaled", links={k: scale(v) for k, v in profile.links.items()},
                   same_location=scale(profile.same_location),
                   default_compute_s_per_sample_per_layer=compute_s_per_sample_per_layer,
                   compute_s_per_sample_per_layer={})


def stage_param_bytes(mcfg) -> List[int]:
    """Bytes of each stage's parameters (= its gradient, fp32): what its replicas all-reduce."""
    from node.train.model import build_stage

    out = []
    for k in range(mcfg.n_stages):
        module = build_stage(mcfg, k)
        out.append(sum(p.numel() * p.element_size() for p in module.parameters()))
    return out


def commit_for(stages: Sequence[Sequence[int]], location_of_node: Sequence[str], setting: dict):
    """The simulator's commit phase for nodes at these locations on the emulated links (the links the
    live run's :class:`node.dataplane.emulation.Emulation` uses: scaled profile plus hop overhead)."""
    from node.dataplane.emulation import profile_link_spec
    from scheduler.simulator import commit_model

    n = len(location_of_node)
    specs = [[profile_link_spec(setting["emu_profile"], location_of_node[u], location_of_node[v],
                                hop_overhead_s=setting["hop_overhead_s"]) for v in range(n)] for u in range(n)]
    latency = [[0.0 if u == v else specs[u][v].latency_s for v in range(n)] for u in range(n)]
    bandwidth = [[specs[u][v].bandwidth_Bps for v in range(n)] for u in range(n)]
    return commit_model(stages, setting["stage_param_bytes"], latency, bandwidth)


def build_setting(args) -> dict:
    """Scaled profile, node locations, cost matrix, allocation and the three schedules."""
    from node.train.model import model_config
    from scheduler.allocation import allocate
    from scheduler.baselines import full_pipeline, random_skip
    from scheduler.cost import (CostParams, LinkProfile, ModelShape, activation_bytes, build_cost, link_busy_matrix,
                                nodes_round_robin)
    from scheduler.paths import schedule_paths_report
    from scheduler.simulator import simulate

    mcfg = model_config("tiny")
    profile = LinkProfile.load(args.profile)
    base_compute = profile.compute_for(profile.locations[0])
    tiny = ModelShape(layers_per_stage=mcfg.layers_per_stage, d_model=mcfg.d_model, seq_len=TINY_SEQ_LEN,
                      samples_per_microbatch=args.samples, bytes_per_element=BYTES_PER_ELEMENT)
    paper = ModelShape(layers_per_stage=PAPER_LAYERS_PER_STAGE, d_model=PAPER_D_MODEL, seq_len=PAPER_SEQ_LEN,
                       samples_per_microbatch=args.samples, bytes_per_element=BYTES_PER_ELEMENT)
    ts = args.time_scale
    compute = base_compute * PAPER_LAYERS_PER_STAGE / mcfg.layers_per_stage * ts
    bandwidth_scale = activation_bytes(tiny) / activation_bytes(paper) / ts
    hop = PAPER_HOP_OVERHEAD_S * ts
    emu_profile = scaled_profile(profile, ts, bandwidth_scale, compute)
    nodes = nodes_round_robin(emu_profile, args.nodes, args.memory)
    cost = build_cost(nodes, emu_profile, tiny, CostParams(hop_overhead_s=hop))
    stage_sizes = [int(x) for x in args.stage_sizes.split(",")]
    alloc = allocate(cost, stage_sizes, seed=args.seed, budget_s=args.alloc_budget_s)
    stages = alloc.stages
    skippipe, report = schedule_paths_report(stages, cost, args.path_length, args.microbatches, args.memory,
                                             seed=args.seed, budget_s=args.budget_s)
    if alloc.budget_hit or report.budget_hit:
        logger.warning("a scheduler budget cut a search short: the schedules depend on machine speed")
    schedules = {
        "full pipeline": full_pipeline(stages, cost, args.microbatches, args.memory),
        "random skip": random_skip(stages, cost, args.path_length, args.microbatches, args.memory, seed=args.seed),
        "SkipPipe": skippipe,
    }
    busy = link_busy_matrix(nodes, emu_profile, tiny)
    predicted = {k: simulate(s, cost, link_busy_s=busy).iteration_time_s for k, s in schedules.items()}
    unshared = {k: simulate(s, cost).iteration_time_s for k, s in schedules.items()}
    setting = {"emu_profile": emu_profile, "hop_overhead_s": hop, "stage_param_bytes": stage_param_bytes(mcfg)}
    commit = commit_for(stages, [n.location for n in nodes], setting)
    whole = {k: simulate(s, cost, link_busy_s=busy, commit=commit).whole_iteration_s for k, s in schedules.items()}
    return {"predicted_whole": whole, "commit": commit, "stage_param_bytes": setting["stage_param_bytes"],"model": mcfg, "profile": profile, "emu_profile": emu_profile, "locations": [n.location for n in nodes],
            "cost": cost, "stages": [list(s) for s in stages], "schedules": schedules, "predicted": predicted,
            "predicted_unshared": unshared,
            "compute_s_per_sample_per_layer": compute, "latency_scale": ts, "bandwidth_scale": bandwidth_scale,
            "hop_overhead_s": hop, "activation_bytes": activation_bytes(tiny), "shape": tiny,
            "deterministic": not (alloc.budget_hit or report.budget_hit)}


async def run_live(args, setting: dict) -> Dict[str, dict]:
    """One in-process swarm; each schedule for ``warmup + iterations`` iterations, back to back."""
    from node.launch.inproc_swarm import InProcessSwarm
    from node.train.data import DataConfig, load_splits
    from node.dataplane.emulation import Emulation
    from node.train.trainer import TrainerConfig
    from protocol import ScheduleEpoch

    data_cfg = DataConfig(corpus="shakespeare", microbatch_size=args.samples, seq_len=TINY_SEQ_LEN, seed=args.seed)
    splits = load_splits(data_cfg)
    config = TrainerConfig(run_id=RUN_ID, model=setting["model"], data=data_cfg, seed=args.seed,
                           memory_deadlock_grace_s=args.deadlock_grace_s, iteration_timeout_s=args.iteration_timeout_s)
    locs = setting["locations"]

    def emulation_for(i: int, members: Sequence[str]) -> Emulation:
        return Emulation.for_node(profile=setting["emu_profile"], location=locs[i],
                                  peer_locations={members[j]: locs[j] for j in range(len(members))},
                                  compute_s_per_sample_per_layer=setting["compute_s_per_sample_per_layer"],
                                  hop_overhead_s=setting["hop_overhead_s"])

    names = list(setting["schedules"])
    first = setting["schedules"][names[0]].to_json()
    per_run = args.warmup + args.iterations
    results: Dict[str, dict] = {}
    t0 = time.perf_counter()
    async with InProcessSwarm(first, config, splits, emulation_for=emulation_for) as swarm:
        startup_s = time.perf_counter() - t0
        print(f"  in-process swarm of {swarm.n_nodes} nodes ready in {startup_s:.0f} s", flush=True)
        for k, name in enumerate(names):
            if k > 0:
                e = swarm.epoch
                swarm.epoch = ScheduleEpoch(e.run_id, k, e.coordinator, time.time(), e.members,
                                            setting["schedules"][name].to_json(), b"")
            start = swarm.nodes[0].current_iteration
            t_run = time.perf_counter()
            await swarm.train(start + per_run)
            its = range(start + args.warmup, start + per_run)
            mb = [min(h.microbatch_s for n in swarm.nodes for h in n.history if h.iteration == i) for i in its]
            full = [swarm.nodes[0].history[i].seconds for i in its]
            overcommits = sum(n.overcommits for n in swarm.nodes)
            behind = _behind([asdict(h) for n in swarm.nodes for h in n.history], its)
            phases = _commit_phases([asdict(h) for h in swarm.nodes[0].history], its)
            results[name] = {"iterations_s": mb, **behind, **phases, "mean_s": statistics.fmean(mb), "full_iteration_s": full,
                             "predicted_s": setting["predicted"][name],
                             "predicted_whole_s": setting["predicted_whole"][name],
                             "predicted_unshared_links_s": setting["predicted_unshared"][name],
                             "mean_full_iteration_s": statistics.fmean(full), "overcommits": overcommits,
                             "wall_s": time.perf_counter() - t_run}
            print(f"  {name}: iterations {', '.join(f'{x:.2f}' for x in mb)} s (microbatch phase); "
                  f"with averaging + norm exchange {statistics.fmean(full):.2f} s (node 0: averaging "
                  f"{phases['averaging_s_node0']:.2f} s, norm exchange {phases['norm_exchange_s_node0']:.2f} s, "
                  f"step {phases['step_s_node0']:.2f} s); {_behind_text(behind)}", flush=True)
        results["_startup_s"] = {"value": startup_s}
    return results


#: (policy flag, row name), in the order they run.
POLICIES = (("full", "full pipeline"), ("random", "random skip"), ("skippipe", "SkipPipe"))
#: Advert heartbeat of the benchmark's daemons (TTL = 3x). 20 daemons on 2 cores starve their DHT
#: processes: at 2 s and 4 s live peers' adverts expired mid-iteration, so data nodes took them for
#: gone and recomputed (docs/emulation.md); at 8 s every run finished.
DAEMON_HEARTBEAT_S = 8.0
_POLL_S = 2.0


def _commit_phases(history: List[dict], its: Sequence[int]) -> dict:
    """Node 0's mean seconds per measured iteration in each phase after the microbatches: where the
    whole iteration's fixed cost goes."""
    rows = [h for h in history if h.get("iteration") in set(its)]
    return {f"{k}_node0": statistics.fmean(h.get(k, 0.0) for h in rows) if rows else 0.0
            for k in ("averaging_s", "norm_exchange_s", "step_s")}


def _behind(history: List[dict], its: Sequence[int]) -> dict:
    """How far the host fell behind the emulated timeline in the measured iterations, summed over nodes:
    compute steps past their emulated target, and hop frames received after their emulated delivery.
    Both 0 = every real overhead fitted inside the emulated budgets (the run replays the emulated WAN)."""
    measured = set(its)
    rows = [h for h in history if h.get("iteration") in measured]
    n = max(len(its), 1)
    return {"compute_overrun_s_per_iteration": sum(float(h.get("compute_overrun_s", 0.0)) for h in rows) / n,
            "late_frames_s_per_iteration": sum(float(h.get("late_frames_s", 0.0)) for h in rows) / n}


def _behind_text(behind: dict) -> str:
    return (f"behind the emulation per iteration (all nodes): compute {behind['compute_overrun_s_per_iteration']:.2f} s, "
            f"frames {behind['late_frames_s_per_iteration']:.2f} s")


def daemon_locations(setting: dict) -> List[str]:
    """Location of each daemon of :class:`node.launch.process_swarm.ProcessSwarm` (index i holds stage
    ``layout[i]``, replicas of a stage in allocation order): the allocation's node placement."""
    locs = setting["locations"]
    return [locs[v] for stage in setting["stages"] for v in stage]


def _daemon_spec(args, policy: str):
    """The run every daemon of one policy's swarm trains (the tiny model on Shakespeare, all nodes members
    before the start, one torch thread each, no checkpoints), as a :class:`node.spec.TrainSpec`."""
    from node.spec import TrainSpec

    return TrainSpec(train=True, model="tiny", corpus="shakespeare", iterations=args.warmup + args.iterations,
                     min_members=args.nodes, seed=args.seed, microbatch_size=args.samples, seq_len=TINY_SEQ_LEN,
                     microbatches=args.microbatches, memory_slots=args.memory, threads=1, checkpoint_every=0,
                     iteration_timeout=float(args.iteration_timeout_s), agreement_timeout=float(args.start_timeout_s),
                     run_id=f"{RUN_ID}-{policy}", heartbeat=args.heartbeat, path_length=args.path_length)


def _daemon_args(args, setting: dict, policy: str, locations: Sequence[str]):
    """Each daemon's own flags after the run's: its location in the emulated network (the founder's
    schedule policy too)."""
    def node_args(i: int) -> List[str]:
        a = ["--log-level", "WARNING", "--network-profile", str(args.profile), "--location", locations[i],
             "--latency-scale", repr(setting["latency_scale"]), "--bandwidth-scale", repr(setting["bandwidth_scale"]),
             "--hop-overhead-s", repr(setting["hop_overhead_s"]),
             "--compute-s-per-sample-per-layer", repr(setting["compute_s_per_sample_per_layer"])]
        if i == 0:  # run-level: only the founder's values count
            a += ["--schedule-policy", policy, "--schedule-cost", "emulation", "--schedule-budget", str(args.budget_s)]
        return a
    return node_args


def predict_epoch(schedule_json: dict, members: Sequence[str], location_of: Dict[str, str],
                  setting: dict) -> Tuple[float, float, float]:
    """Simulated microbatch phase of an adopted epoch on the emulated cost of its members:
    ``(shared, unshared, whole)``, with transfers on one link queueing for it (as the emulated links
    make them) and without (the reference's model); ``whole`` adds the commit phase to ``shared``."""
    from scheduler.cost import CostParams, NodeSpec, build_cost, link_busy_matrix
    from scheduler.schedule import Schedule
    from scheduler.simulator import simulate

    compute = setting["compute_s_per_sample_per_layer"]
    nodes = [NodeSpec(v, location_of[m], compute, schedule_json.get("memory", 3)) for v, m in enumerate(members)]
    cost = build_cost(nodes, setting["emu_profile"], setting["shape"], CostParams(hop_overhead_s=setting["hop_overhead_s"]))
    busy = link_busy_matrix(nodes, setting["emu_profile"], setting["shape"])
    schedule = Schedule.from_json(schedule_json)
    commit = commit_for(schedule_json["stages"], [location_of[m] for m in members], setting)
    shared = simulate(schedule, cost, link_busy_s=busy, commit=commit)
    return shared.iteration_time_s, simulate(schedule, cost).iteration_time_s, shared.whole_iteration_s


def _route_stages(schedule_json: dict) -> List[List[int]]:
    stage_of = {v: k for k, nodes in enumerate(schedule_json["stages"]) for v in nodes}
    return [[stage_of[v] for v in p["route"]] for p in schedule_json["paths"]]


def run_daemon_policy(args, setting: dict, policy: str, name: str, base: pathlib.Path) -> dict:
    """One fresh swarm of ``args.nodes`` daemons with ``--schedule-policy policy``; train, measure, stop."""
    from node.errors import UserError
    from node.net.rpc import call_http
    from node.launch.process_swarm import ProcessSwarm, training_state

    locations = daemon_locations(setting)
    stage_sizes = [len(s) for s in setting["stages"]]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    swarm = ProcessSwarm(args.nodes, stage_sizes, base_dir=base / policy, spec=_daemon_spec(args, policy),
                         extra_args=_daemon_args(args, setting, policy, locations), env=env)
    total = args.warmup + args.iterations
    t0 = time.perf_counter()
    done: Dict[int, dict] = {}
    leftover: List[int] = []
    try:
        swarm.start(timeout=args.start_timeout_s)
        ready_s = time.perf_counter() - t0
        print(f"  {name}: {args.nodes} daemons ready in {ready_s:.0f} s (logs in {base / policy})", flush=True)
        t_ready = time.monotonic()
        last_report = None
        while len(done) < len(swarm.nodes):
            for node in swarm.nodes:
                if not node.alive:
                    raise UserError(f"daemon {node.index} (stage {node.stage}) exited: {swarm.last_error(node)}")
            for node in swarm.nodes:
                if node.index in done:
                    continue
                st = training_state(node, limit=1000)
                if st is None:  # a busy daemon answers next time
                    continue
                if st.get("state") == "error":
                    raise UserError(f"training failed on daemon {node.index}: {st.get('error')}")
                if st.get("state") == "done":
                    done[node.index] = st
                elif node.index == 0:
                    report = (st.get("state"), st.get("epoch"), st.get("committed_iteration"))
                    if report != last_report:
                        last_report = report
                        print(f"    daemon 0: state {report[0]}, epoch {report[1]}, committed iteration {report[2]} "
                              f"({time.monotonic() - t_ready:.0f} s after ready)", flush=True)
            if time.monotonic() - t_ready > args.run_timeout_s:
                raise UserError(f"{name}: not done {args.run_timeout_s:.0f} s after the daemons were ready "
                                f"({len(done)} of {len(swarm.nodes)} done); logs in {base / policy}")
            if len(done) < len(swarm.nodes):
                time.sleep(_POLL_S)
        sched = call_http(swarm.nodes[0].rpc_url, "schedule", {}, timeout=10.0)
        location_of = {n.peer_id: locations[n.index] for n in swarm.nodes}
    finally:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            swarm.stop()
            leftover = [pid for n in swarm.nodes for pid in n.group_pids()]
        finally:
            signal.signal(signal.SIGINT, previous)
    wall = time.perf_counter() - t0
    epochs = {st.get("epoch") for st in done.values()}
    if epochs != {sched["epoch"]}:
        raise UserError(f"{name}: daemons trained on epochs {sorted(map(str, epochs))}, node 0 reports {sched['epoch']}")
    histories = [st["history"] for st in done.values()]
    start = min(h["iteration"] for hist in histories for h in hist)
    its = list(range(start + args.warmup, start + total))
    mb = [min(h["microbatch_s"] for hist in histories for h in hist if h["iteration"] == i) for i in its]
    behind = _behind([h for hist in histories for h in hist], its)
    lead = done[0]["history"]
    full = [next(h["seconds"] for h in lead if h["iteration"] == i) for i in its]
    predicted, unshared, whole = predict_epoch(sched["schedule"], sched["members"], location_of, setting)
    routes = _route_stages(sched["schedule"])
    print(f"  {name}: epoch {sched['epoch']} ({len(sched['schedule']['paths'])} paths, route lengths "
          f"{sorted({len(r) for r in routes})}); iterations {', '.join(f'{x:.2f}' for x in mb)} s (microbatch phase); "
          f"with averaging + norm exchange {statistics.fmean(full):.2f} s; {len(leftover)} processes left; "
          f"{_behind_text(behind)}", flush=True)
    return {"iterations_s": mb, **behind, **_commit_phases(lead, its), "mean_s": statistics.fmean(mb),
            "full_iteration_s": full, "mean_full_iteration_s": statistics.fmean(full), "predicted_s": predicted,
            "predicted_unshared_links_s": unshared, "predicted_whole_s": whole,
            "overcommits": sum(int(st.get("overcommits") or 0) for st in done.values()),
            "daemons_ready_s": ready_s, "wall_s": wall, "leftover_processes": len(leftover),
            "epoch": sched["epoch"], "epoch_schedule": sched["schedule"], "members": sched["members"],
            "member_locations": [location_of[m] for m in sched["members"]],
            "history_node0": lead}


def run_daemons(args, setting: dict) -> Dict[str, dict]:
    """The three policies on three fresh daemon swarms, one after another."""
    import tempfile

    def on_term(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)  # so the finally blocks stop every daemon
    results: Dict[str, dict] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="wan-daemons-") as tmp:
            base = pathlib.Path(args.workdir) if args.workdir else pathlib.Path(tmp)
            for policy, name in POLICIES:
                results[name] = run_daemon_policy(args, setting, policy, name, base)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return results


def plot(path: pathlib.Path, names: List[str], measured: List[float], predicted: List[float], title: str) -> bool:
    plt = load_pyplot("chart")
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(names))
    width = 0.38
    ax.bar([x - width / 2 for x in xs], measured, width, label="measured (live, emulated WAN)")
    ax.bar([x + width / 2 for x in xs], predicted, width, label="simulator prediction")
    for x, m, p in zip(xs, measured, predicted):
        ax.text(x - width / 2, m, f"{m:.2f}", ha="center", va="bottom", fontsize=8)
        ax.text(x + width / 2, p, f"{p:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(names)
    ax.set_ylabel("iteration time (s)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def add_setting_arguments(p: argparse.ArgumentParser, time_scale: float, time_scale_help: str) -> None:
    """The emulated WAN setting's flags (profile, swarm shape, time scale), shared with bench/time_to_loss.py."""
    p.add_argument("--profile", default=DEFAULT_PROFILE)
    p.add_argument("--nodes", type=int, default=20)
    p.add_argument("--stage-sizes", default="5,3,3,3,3,3")
    p.add_argument("--path-length", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=6, help="per data node per iteration")
    p.add_argument("--samples", type=int, default=8, help="sequences per microbatch")
    p.add_argument("--memory", type=int, default=3)
    p.add_argument("--time-scale", type=float, default=time_scale, help=time_scale_help)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_setting_arguments(p, 0.2, "emulated seconds per paper-setting second (default %(default)s: 5x faster, the "
                          "setting of the README figures; a 0.05 run of 20 daemons on 2 cores once stalled, "
                          "docs/emulation.md)")
    p.add_argument("--warmup", type=int, default=1, help="iterations per schedule not measured")
    p.add_argument("--iterations", type=int, default=2, help="measured iterations per schedule")
    p.add_argument("--seed", type=int, default=0)
    # generous caps: the searches stop at their iteration bounds first, so the schedules are a function of
    # the seed only (docs/scheduler.md, Determinism); a cap that hits is reported
    p.add_argument("--alloc-budget-s", type=float, default=60.0, help="allocation search cap (seconds)")
    p.add_argument("--budget-s", type=float, default=60.0, help="path scheduler cap (seconds)")
    p.add_argument("--deadlock-grace-s", type=float, default=30.0)
    p.add_argument("--iteration-timeout-s", type=float, default=300.0)
    p.add_argument("--in-process", action="store_true",
                   help="one in-process swarm (node.launch.inproc_swarm.InProcessSwarm) instead of 20 daemons per policy")
    p.add_argument("--heartbeat", type=float, default=DAEMON_HEARTBEAT_S,
                   help="daemons: advert heartbeat, s (TTL = 3x). 20 daemons on 2 cores starve heartbeats at 2 s, "
                        "and a live node that looks gone costs recomputations (default %(default)s)")
    p.add_argument("--start-timeout-s", type=float, default=240.0, help="daemons: seconds to come up / agree")
    p.add_argument("--run-timeout-s", type=float, default=900.0, help="daemons: seconds per policy after ready")
    p.add_argument("--workdir", default=None, help="daemons: keep their folders (logs) here instead of a temp dir")
    p.add_argument("--out", default=str(_ROOT / "bench" / "results"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    from node.errors import UserError

    try:
        return _main(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted (every daemon was stopped)", file=sys.stderr)
        return 130


def _main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    setting = build_setting(args)
    names = list(setting["schedules"])
    print(f"wan: {args.nodes} nodes (stage sizes {args.stage_sizes}, path length {args.path_length}) on "
          f"{setting['profile'].name}, locations round-robin; tiny model, {args.microbatches} microbatches x "
          f"{args.samples} x {TINY_SEQ_LEN} tokens per data node; memory {args.memory}")
    print(f"  time scale {args.time_scale:g} (paper setting 4 layers x d 1024 x ctx 1024 replayed "
          f"{1 / args.time_scale:.0f}x faster): compute {setting['compute_s_per_sample_per_layer']:.4f} s/sample/layer, "
          f"latency x{setting['latency_scale']:g}, bandwidth x{setting['bandwidth_scale']:.4f}, "
          f"hop overhead {setting['hop_overhead_s']:.4f} s, activation {setting['activation_bytes']} B")
    print(f"  allocation: {setting['stages']} (deterministic searches: {setting['deterministic']})")
    if args.in_process:
        harness = "in-process InProcessSwarm (real hivemind P2P + DHT per node, one process), epochs switched on one swarm"
        print("  swarm: in-process harness (real hivemind P2P + DHT per node, one Python process)", flush=True)
        live = asyncio.run(run_live(args, setting))
        startup = live.pop("_startup_s")["value"]
    else:
        harness = (f"{args.nodes} skippipe node run --train daemons per policy (node.launch.process_swarm.ProcessSwarm), one fresh "
                   "swarm per --schedule-policy, schedules by the swarm's coordinator (--schedule-cost emulation)")
        print(f"  swarm: {harness}; daemon locations {daemon_locations(setting)}", flush=True)
        live = run_daemons(args, setting)
        startup = statistics.fmean(r["daemons_ready_s"] for r in live.values())
    rows = []
    print(f"{'schedule':<16}{'measured s/it':>14}{'predicted':>11}{'error':>9}{'vs full':>9}{'+avg/norm s/it':>16}"
          f"{'predicted':>11}{'vs full':>9}{'unshared links':>16}{'error':>9}")
    full_m, full_p = live[names[0]]["mean_s"], live[names[0]]["predicted_s"]
    whole_m, whole_p = live[names[0]]["mean_full_iteration_s"], live[names[0]]["predicted_whole_s"]
    for name in names:
        m, p = live[name]["mean_s"], live[name]["predicted_s"]
        err = (m - p) / p * 100
        rows.append({**live[name], "schedule": name, "measured_s": m, "predicted_s": p, "error_pct": err,
                     "measured_vs_full": m / full_m, "predicted_vs_full": p / full_p,
                     "whole_measured_vs_full": live[name]["mean_full_iteration_s"] / whole_m,
                     "whole_predicted_vs_full": live[name]["predicted_whole_s"] / whole_p,
                     "planned_here_predicted_s": setting["predicted"][name]})
        pu = live[name]["predicted_unshared_links_s"]
        wm, wp = live[name]["mean_full_iteration_s"], live[name]["predicted_whole_s"]
        print(f"{name:<16}{m:>14.2f}{p:>11.2f}{err:>+8.1f}%{m / full_m:>9.3f}{wm:>16.2f}{wp:>11.2f}{wm / whole_m:>9.3f}"
              f"{pu:>16.2f}{(m - pu) / pu * 100:>+8.1f}%")
    sk = rows[-1]
    print(f"SkipPipe / full: measured {sk['measured_vs_full']:.3f}, predicted {sk['predicted_vs_full']:.3f} "
          f"(targets: measured <= 0.50, prediction within 15%: {abs(sk['error_pct']):.1f}%); whole iteration: "
          f"measured {sk['whole_measured_vs_full']:.3f}, predicted {sk['whole_predicted_vs_full']:.3f}")
    commit = setting["commit"]
    print(f"  predicted commit phase: averaging {commit.averaging_s:.2f} s (per stage "
          f"{', '.join(f'{s:.2f}' for s in commit.allreduce_s.values())}; parameter bytes "
          f"{setting['stage_param_bytes']}), norm exchange {commit.norm_exchange_s:.2f} s")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "setting": {k: v for k, v in vars(args).items()},
        "harness": harness,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg": os.getloadavg()},
        "compute_s_per_sample_per_layer": setting["compute_s_per_sample_per_layer"],
        "bandwidth_scale": setting["bandwidth_scale"], "latency_scale": setting["latency_scale"],
        "hop_overhead_s": setting["hop_overhead_s"], "activation_bytes": setting["activation_bytes"],
        "locations": setting["locations"], "stages": setting["stages"], "startup_s": startup,
        "daemon_locations": None if args.in_process else daemon_locations(setting),
        "deterministic_schedules": setting["deterministic"],
        "schedules_planned_here": {k: s.to_json() for k, s in setting["schedules"].items()}, "results": rows,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    (out / "wan.json").write_text(json.dumps(result, indent=1, default=str))
    plotted = plot(out / "wan.png", names, [r["measured_s"] for r in rows], [r["predicted_s"] for r in rows],
                   f"{args.nodes} nodes, geo-distributed profile (time x{args.time_scale:g}), "
                   + ("in-process swarm" if args.in_process else "daemons"))
    print(f"wrote {out / 'wan.json'}" + (f" and {out / 'wan.png'}" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
