"""Fault benchmark: what losing nodes, and gaining one, costs a training swarm.

Why: the README's failure rule ("When nodes fail, join or leave") promises that training goes on
when volunteers crash or arrive. This measures how much it costs, on real daemons: one swarm of
``skippipe node run --train`` processes (:class:`node.launch.process_swarm.ProcessSwarm`, one process group
each) trains a tiny model on 127.0.0.1 while this script kills and adds nodes.

Phases, one after another on the same swarm (defaults in brackets):

a. **All nodes.** 2 data nodes + stages 1-4 with 3 replicas each [--stage-sizes 2,3,3,3,3: 14
   daemons, 12 non-data], paths of 4 of the 5 stages [--path-length 4]. After --warmup iterations
   [3], the mean iteration time over --measure iterations [6].
b. **Lose 25% of the non-data nodes** [3 of 12]: they are SIGKILLed at once (whole process group,
   like a machine losing power), --kill-at [0.5] of a steady iteration after a commit, so
   microbatches are in flight. Measured: seconds from the kill to the data node's next committed
   step; seconds until the data node trains on an epoch whose members are exactly the survivors
   ("settled"); then the mean iteration time over --measure iterations of that epoch, after
   --settle-skip [1] iterations.
c. **Lose 50%** in all [3 more]: the same. Victims are picked so that a stage never loses its
   last replica (the stage with the most live replicas first), never a data node.
d. **One node joins** (``--auto``: it takes the stage with the fewest replicas, waits for the epoch
   that includes it, downloads the stage's weights and optimizer state from a live replica, then
   trains). Measured: spawn -> ready (process up, DHT joined, advert stored); ready -> its first
   committed iteration (``committed_iteration >= start_iteration`` in its ``training`` RPC); ready
   -> its first committed iteration *in the swarm's epoch* (the data node ran the same epoch for
   that iteration; a joiner dropped from the next epoch before it got going commits one stale
   iteration and joins again); join-to-first-microbatch = spawn -> the latter. Then the mean
   iteration time with it.

Iteration time = the data node 0's ``IterationStats.seconds`` (its wall time per iteration, step
included; ``microbatch_s`` = first forward to the last backward is reported too). Moments are
taken by polling the data node's ``training`` RPC every --poll [0.1] s, so they are accurate to
about one poll plus one RPC round trip.

Omission table (not retrained): perplexity of the skip-trained and the full-trained model with
6/6, 5/6, 4/6 and 3/6 stages kept, read from ``bench/results/omission.json`` (made by
``bench/omission.py``; docs/evaluation.md). 75% of 6 stages is not a whole number of stages, so
the rows are labelled with their exact fractions; ``--omission-rerun`` recomputes the file first.

All daemons share this machine's cores: the numbers measure the implementation under
contention on loopback, not a real network. No daemon, p2pd or DHT process survives the run (the
count left is printed and stored).

Run: ``python bench/faults.py`` (about 15-25 minutes on 2 busy cores; writes
``bench/results/faults.json``). Quick try: ``python bench/faults.py --stage-sizes 1,2,2
--path-length 3 --measure 3 --warmup 2 --out /tmp/faults``. Only the omission table:
``python bench/faults.py --no-swarm``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import signal
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence

try:
    from node.ops.bench_cli import BenchError, run_bench, run_record, bench_workdir
except ImportError as _e:  # not the project's venv: one line, not a traceback
    print(f"error: cannot import the node package ({_e}); run with the project's venv: "
          ".venv/bin/python bench/faults.py (bash scripts/setup.sh creates it)", file=sys.stderr)
    sys.exit(2)

from node.ops.tables import text_table
from node.launch.process_swarm import training_state
from node.launch.procs import ancestors, processes_mentioning

_HERE = pathlib.Path(__file__).resolve().parent
_ROOT = _HERE.parent

__all__ = ["main", "kill_plan", "omission_rows"]

RESULTS_DIR = _ROOT / "bench" / "results"
OMISSION_FILE = RESULTS_DIR / "omission.json"
RUN_ID = "faults"
#: Seconds an iteration may take before a daemon stops as stalled (14 daemons on 2 cores, a kill in between).
ITERATION_TIMEOUT_S = 240.0
#: Seconds a daemon waits for every member of the pinned epoch to confirm it (they start in batches).
AGREEMENT_TIMEOUT_S = 300.0
#: Seconds a stopping daemon keeps training for its epoch (the bench stops all at once at the end).
DRAIN_TIMEOUT_S = 5.0


# ---------------------------------------------------------------------------------------------- plan
def kill_plan(stage_sizes: Sequence[int], fractions: Sequence[float]) -> List[List[int]]:
    """Node indices to SIGKILL at each step: ``round(f * non-data nodes)`` lost in total after step f.

    Each victim is the highest-index live node of the stage with the most live replicas (ties: the
    lowest stage), so no stage ever loses its last replica and data nodes (stage 0) are never hit.
    """
    live: Dict[int, List[int]] = {}
    index = 0
    for stage, size in enumerate(stage_sizes):
        if stage > 0:
            live[stage] = list(range(index, index + size))
        index += size
    non_data = sum(len(v) for v in live.values())
    if non_data == 0:
        raise BenchError("--stage-sizes has no non-data nodes to kill")
    steps, killed = [], 0
    for f in fractions:
        if not 0 < f < 1:
            raise BenchError(f"--lose fractions must be in (0, 1), got {f}")
        target = int(round(f * non_data))
        if target <= killed:
            raise BenchError(f"--lose {list(fractions)}: {f:.0%} of {non_data} non-data nodes kills no one new "
                             "(fractions must grow by at least one node each)")
        victims = []
        while killed < target:
            stage = max(live, key=lambda s: (len(live[s]), -s))
            if len(live[stage]) < 2:
                raise BenchError(f"losing {f:.0%} of the non-data nodes of --stage-sizes {list(stage_sizes)} would "
                                 "remove the last replica of a stage; give the stages more replicas")
            victims.append(live[stage].pop())
            killed += 1
        steps.append(victims)
    return steps


# ---------------------------------------------------------------------------------------------- polling
def _committed(state: Optional[dict]) -> int:
    c = state.get("committed_iteration") if state else None
    return -1 if c is None else int(c)


class Harness:
    """The swarm plus polling of its data node 0 (never killed)."""

    def __init__(self, swarm, args):
        self.swarm, self.args = swarm, args
        self.lead = swarm.nodes[0]
        self.events: List[dict] = []  # (time, committed, epoch, members) changes seen on the data node
        self._last_seen = None
        self.t0 = time.monotonic()

    def alive_count(self) -> int:
        return sum(1 for n in self.swarm.nodes if n.alive)

    def poll(self, limit: int = 1) -> dict:
        """One answer of the data node (retried until the phase timeout); checks it is healthy."""
        deadline = time.monotonic() + self.args.phase_timeout
        while True:
            if not self.lead.alive:
                raise BenchError(f"data node 0 exited: {self.swarm.last_error(self.lead)}")
            st = training_state(self.lead, limit=limit)
            if st is not None:
                if st.get("state") == "error":
                    raise BenchError(f"data node 0 stopped training: {st.get('error')}")
                seen = (st.get("state"), _committed(st), st.get("epoch"), st.get("members"))
                if seen != self._last_seen:
                    self._last_seen = seen
                    self.events.append({"t": round(time.monotonic() - self.t0, 2), "state": seen[0],
                                        "committed": seen[1], "epoch": seen[2], "members": seen[3]})
                return st
            if time.monotonic() > deadline:
                raise BenchError(f"data node 0 did not answer its training RPC for {self.args.phase_timeout:.0f} s")
            time.sleep(self.args.poll)

    def wait(self, predicate, what: str, limit: int = 1) -> dict:
        """Poll the data node until ``predicate(state)``; BenchError after --phase-timeout."""
        deadline = time.monotonic() + self.args.phase_timeout
        while True:
            st = self.poll(limit)
            if predicate(st):
                return st
            if time.monotonic() > deadline:
                raise BenchError(f"timed out after {self.args.phase_timeout:.0f} s waiting for {what}; data node 0: "
                                 f"state {st.get('state')}, committed {st.get('committed_iteration')}, epoch "
                                 f"{st.get('epoch')} with {st.get('members')} members")
            time.sleep(self.args.poll)

    def history(self) -> List[dict]:
        return self.poll(limit=100000).get("history") or []

    def window(self, first: int, n: int) -> dict:
        """Stats of the data node's iterations ``first .. first + n - 1`` (waits until committed)."""
        self.wait(lambda s: _committed(s) >= first + n - 1, f"iteration {first + n - 1} to commit")
        hist = {h["iteration"]: h for h in self.history()}
        rows = [hist[i] for i in range(first, first + n) if i in hist]
        return window_stats(rows)


def window_stats(rows: List[dict]) -> dict:
    if not rows:
        return {"iterations": [], "n": 0}
    secs = [float(r["seconds"]) for r in rows]
    return {
        "iterations": [rows[0]["iteration"], rows[-1]["iteration"]], "n": len(rows),
        "mean_s": statistics.fmean(secs), "median_s": statistics.median(secs), "min_s": min(secs), "max_s": max(secs),
        "mean_microbatch_s": statistics.fmean(float(r.get("microbatch_s") or 0.0) for r in rows),
        "mean_loss": statistics.fmean(float(r["loss"]) for r in rows),
        "dropped": sum(int(r.get("dropped") or 0) for r in rows),
        "retried": sum(int(r.get("retried") or 0) for r in rows),
        "epochs": sorted({r.get("epoch") for r in rows}, key=str),
        "seconds": [round(s, 3) for s in secs],
    }


# ---------------------------------------------------------------------------------------------- phases
def phase_steady(h: Harness) -> dict:
    a = h.args
    st = h.wait(lambda s: s.get("state") == "training" and _committed(s) >= 0, "training to start")
    first = int(st.get("start_iteration") or 0) + a.warmup
    stats = h.window(first, a.measure)
    stats.update(members=h.alive_count(), epoch=st.get("epoch"))
    return stats


def phase_kill(h: Harness, victims: List[int], steady_s: float) -> dict:
    a, swarm = h.args, h.swarm
    before = h.poll()
    c0 = _committed(before)
    st = h.wait(lambda s: _committed(s) > c0, "a commit before the kill")
    time.sleep(max(0.0, a.kill_at * steady_s))
    st = h.poll()
    c_kill, epoch_before = _committed(st), st.get("epoch")
    for v in victims:  # all at once: the whole process group of each
        try:
            os.killpg(swarm.nodes[v].proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    t_kill = time.monotonic()
    for v in victims:
        swarm.kill(v, signal.SIGKILL)  # reaps the (already dead) group
    survivors = h.alive_count()
    st = h.wait(lambda s: _committed(s) > c_kill, "the next committed step after the kill")
    t_next = time.monotonic()
    c_next = _committed(st)
    st = h.wait(lambda s: s.get("members") == survivors and s.get("epoch") != epoch_before,
                f"an epoch of the {survivors} survivors")
    t_settled = time.monotonic()
    settled_epoch = st.get("epoch")
    c_settle = _committed(st)
    st = h.wait(lambda s: _committed(s) > c_settle, "the first commit in the survivors' epoch")
    t_settled_commit = time.monotonic()
    hist = {x["iteration"]: x for x in h.history()}
    first_new = min(i for i, x in hist.items() if x.get("epoch") == settled_epoch)
    disturbed = window_stats([hist[i] for i in range(c_kill + 1, first_new) if i in hist])
    stats = h.window(first_new + a.settle_skip, a.measure)
    hit = hist.get(c_kill + 1, {})
    return {
        "victims": victims, "victim_stages": [swarm.nodes[v].stage for v in victims], "members": survivors,
        "killed_after_iteration": c_kill, "epoch_before": epoch_before, "settled_epoch": settled_epoch,
        "kill_to_next_commit_s": t_next - t_kill, "next_commit_iteration": c_next,
        "hit_iteration": {"iteration": c_kill + 1, "seconds": hit.get("seconds"), "dropped": hit.get("dropped"),
                          "retried": hit.get("retried"), "epoch": hit.get("epoch")},
        "kill_to_settled_epoch_s": t_settled - t_kill, "kill_to_first_settled_commit_s": t_settled_commit - t_kill,
        "first_settled_iteration": first_new, "disturbed_iterations": disturbed,
        "epochs_seen": sorted({(e["epoch"], e["members"]) for e in h.events if e["t"] >= t_kill - h.t0 - 0.01},
                              key=lambda x: (x[0] is None, x[0] or 0)),
        "after": stats,
    }


def phase_join(h: Harness) -> dict:
    """Spawn one ``--auto`` node; time its readiness, its state download and its first commits.

    Two "first commit" moments are taken, because a joiner can commit an iteration in an epoch
    the swarm has already left (it is dropped from the next epoch and joins again later):
    ``first_commit`` is the brief's ``committed_iteration >= start_iteration``; ``in_swarm`` is the
    first committed iteration whose epoch equals the data node's epoch for that iteration, i.e. the
    first step it really trained with the swarm (the headline join-to-first-microbatch)."""
    a, swarm = h.args, h.swarm
    c_spawn = _committed(h.poll())
    t_spawn = time.monotonic()
    node = swarm.add_node(stage=None, timeout=a.start_timeout)
    t_ready = time.monotonic()
    print(f"  joiner node {node.index} ready after {t_ready - t_spawn:.1f} s, stage {node.stage} (--auto)", flush=True)
    t_training = t_first = t_swarm = t_visit = None
    first_start = swarm_it = visit_it = None
    lead_epoch: Dict[int, object] = {}  # iteration -> the data node's epoch
    starts, last = [], None
    deadline = time.monotonic() + a.phase_timeout
    while t_swarm is None:
        if not node.alive:
            raise JoinFailed(f"the joiner exited: {swarm.last_error(node)}", _log_problems(node))
        st = training_state(node, limit=1000)
        if st is not None:
            last = st
            if st.get("state") == "error":
                raise JoinFailed(f"the joiner stopped training: {st.get('error')}", _log_problems(node))
            now = time.monotonic()
            if t_training is None and st.get("state") in ("training", "done"):
                t_training = now
            start = st.get("start_iteration")
            if start is not None and start not in starts:
                starts.append(start)
            if t_first is None and start is not None and _committed(st) >= int(start):
                t_first, first_start = now, int(start)
            for x in st.get("history") or []:
                if t_visit is None and int(x.get("local_visits") or 0) > 0:
                    t_visit, visit_it = now, x["iteration"]
                if lead_epoch.get(x["iteration"]) == x.get("epoch") and t_swarm is None:
                    t_swarm, swarm_it = now, x["iteration"]
        for x in h.poll(limit=20).get("history") or []:  # also fails fast if the data node died
            lead_epoch[x["iteration"]] = x.get("epoch")
        if time.monotonic() > deadline:
            raise JoinFailed(f"the joiner trained no iteration with the swarm within {a.phase_timeout:.0f} s "
                             f"(last state {(last or {}).get('state')}, start iterations {starts})",
                             _log_problems(node))
        time.sleep(max(a.poll, 0.2))
    members = h.alive_count()
    epoch = lead_epoch[swarm_it]
    st = h.wait(lambda s: _committed(s) >= swarm_it, "the joiner's first iteration at the data node")
    stats = h.window(swarm_it + a.settle_skip, a.measure)
    return {
        "node": node.index, "stage": node.stage, "members": members, "data_node_committed_at_spawn": c_spawn,
        "start_iterations": starts, "first_swarm_iteration": swarm_it, "epoch": epoch,
        "first_visit_iteration": visit_it,
        "spawn_to_ready_s": t_ready - t_spawn,
        "ready_to_training_s": None if t_training is None else t_training - t_ready,
        "ready_to_first_commit_s": None if t_first is None else t_first - t_ready,
        "first_commit_iteration": first_start,
        "ready_to_first_swarm_commit_s": t_swarm - t_ready,
        "ready_to_first_visit_commit_s": None if t_visit is None else t_visit - t_ready,
        "join_to_first_microbatch_s": t_swarm - t_spawn,
        "rejoined": len(starts) > 1,
        "log": _log_lines(node, ("joined stage", "leaves training", "joining the run", "waiting for a schedule")),
        "after": stats,
    }


def _log_lines(node, needles: Sequence[str], keep: int = 12) -> List[str]:
    try:
        lines = node.log_path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [ln for ln in lines if any(k in ln for k in needles)][-keep:]


class JoinFailed(BenchError):
    def __init__(self, message: str, log_lines: List[str]):
        super().__init__(message)
        self.log_lines = log_lines


def _log_problems(node, keep: int = 12) -> List[str]:
    try:
        lines = node.log_path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    bad = [ln for ln in lines if any(k in ln for k in ("ERROR", "error", "Traceback", "Error", "failed"))]
    return bad[-keep:]


# ---------------------------------------------------------------------------------------------- swarm
def daemon_spec(args):
    """The run every daemon trains (a :class:`node.spec.TrainSpec`; :class:`ProcessSwarm` writes it as each
    daemon's ``node run`` flags): training starts once every daemon is a member, one torch thread per daemon
    (they share this machine's cores), no checkpoints, and waits long enough for a loaded 2-core box."""
    from node.spec import TrainSpec

    return TrainSpec(train=True, iterations=args.iterations, min_members=sum(args.sizes), threads=1,
                     microbatches=args.microbatches, microbatch_size=args.microbatch_size, checkpoint_every=0,
                     iteration_timeout=ITERATION_TIMEOUT_S, agreement_timeout=AGREEMENT_TIMEOUT_S, run_id=RUN_ID,
                     heartbeat=args.heartbeat, path_length=args.path_length)


#: Each daemon's own flags (not the run's): a killed node's peers must not wait for its drain.
DAEMON_FLAGS = ("--drain-timeout", str(DRAIN_TIMEOUT_S), "--log-level", "INFO")


def start_swarm(swarm, args, UserError) -> None:
    """Node 0, then the rest in batches of --start-batch; a daemon that exits while starting (on a
    loaded machine the DHT bootstrap ping can time out) is started again, up to --start-retries
    times. ProcessSwarm.start would start all at once and give up on the first failure."""
    retries: Dict[int, int] = {}

    def bring_up(nodes) -> None:
        pending = list(nodes)
        while pending:
            for node in pending:
                swarm.spawn(node)
            try:
                swarm.wait_ready(pending, args.start_timeout)
                return
            except UserError as e:
                failed = [n for n in pending if not n.alive and not n.info]
                if not failed or any(retries.get(n.index, 0) >= args.start_retries for n in failed):
                    raise BenchError(f"the daemons could not start: {e}") from None
                print(f"  {e}; starting node(s) {[n.index for n in failed]} again", flush=True)
                for n in failed:
                    retries[n.index] = retries.get(n.index, 0) + 1
                    swarm.kill(n.index, signal.SIGKILL)  # reap what is left of its group
                others = [n for n in pending if n not in failed]
                if others:  # the rest of the batch is still coming up
                    try:
                        swarm.wait_ready(others, args.start_timeout)
                    except UserError as e2:
                        raise BenchError(f"the daemons could not start: {e2}") from None
                pending = failed

    bring_up(swarm.nodes[:1])
    rest = swarm.nodes[1:]
    for k in range(0, len(rest), args.start_batch):
        bring_up(rest[k:k + args.start_batch])


def run_swarm(args, base: pathlib.Path) -> dict:
    from node.errors import UserError
    from node.launch.process_swarm import ProcessSwarm

    plan = kill_plan(args.sizes, args.lose)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    swarm = ProcessSwarm(sum(args.sizes), args.sizes, base_dir=base, spec=daemon_spec(args), extra_args=DAEMON_FLAGS,
                         env=env)
    out: dict = {"kill_plan": plan}
    t0 = time.monotonic()
    try:
        start_swarm(swarm, args, UserError)
        out["daemons_ready_s"] = time.monotonic() - t0
        print(f"  {len(swarm.nodes)} daemons ready in {out['daemons_ready_s']:.0f} s (logs in {base})", flush=True)
        h = Harness(swarm, args)
        h.t0 = t0
        st = h.wait(lambda s: s.get("state") == "training", "training to start")
        out["training_started_s"] = time.monotonic() - t0
        print(f"  training started {out['training_started_s']:.0f} s after launch (epoch {st.get('epoch')}, "
              f"{st.get('members')} members)", flush=True)
        steady = phase_steady(h)
        out["steady"] = steady
        print(f"  a. all {steady['members']} nodes: {steady['mean_s']:.2f} s/it over iterations "
              f"{steady['iterations'][0]}-{steady['iterations'][1]}", flush=True)
        out["kills"] = []
        non_data = sum(args.sizes[1:])
        lost = 0
        for frac, victims in zip(args.lose, plan):
            lost += len(victims)
            r = phase_kill(h, victims, steady["mean_s"])
            r.update(fraction=frac, lost_total=lost, of=non_data)
            out["kills"].append(r)
            print(f"  {_letter(len(out['kills']))}. lost {lost}/{non_data} ({frac:.0%}; nodes {victims}): "
                  f"next commit {r['kill_to_next_commit_s']:.2f} s after the kill, survivors' epoch "
                  f"{r['settled_epoch']} after {r['kill_to_settled_epoch_s']:.1f} s, then {r['after']['mean_s']:.2f} s/it",
                  flush=True)
        if args.join:
            try:
                out["join"] = phase_join(h)
                j = out["join"]
                print(f"  {_letter(len(plan) + 1)}. join: spawn -> ready {j['spawn_to_ready_s']:.1f} s, ready -> first "
                      f"iteration with the swarm {j['ready_to_first_swarm_commit_s']:.1f} s (iteration "
                      f"{j['first_swarm_iteration']}), then {j['after']['mean_s']:.2f} s/it", flush=True)
            except JoinFailed as e:
                out["join"] = {"error": str(e), "log": e.log_lines}
                print(f"  {_letter(len(plan) + 1)}. join FAILED: {e}", flush=True)
                for line in e.log_lines:
                    print(f"     | {line}", flush=True)
        out["data_node_timeline"] = h.events
        out["history_node0"] = h.history()
        out["unexpected_exits"] = [
            {"node": n.index, "stage": n.stage, "last": swarm.last_error(n)}
            for n in swarm.nodes if not n.alive and n.index not in {v for step in plan for v in step}]
    finally:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            swarm.stop()
            left = {pid for n in swarm.nodes for pid in n.group_pids()}
            left |= set(processes_mentioning(str(base), exclude=ancestors()))
            out["leftover_processes"] = len(left)
            print(f"  swarm stopped; {len(left)} processes left", flush=True)
        finally:
            signal.signal(signal.SIGINT, previous)
    out["wall_s"] = time.monotonic() - t0
    return out


# ---------------------------------------------------------------------------------------------- omission
def omission_rows(path: pathlib.Path) -> Optional[dict]:
    """The rows of bench/omission.py's JSON, or None if there is none."""
    try:
        data = json.loads(path.read_text())
        rows = data["rows"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BenchError(f"cannot read {path}: {e}") from None
    return data | {"rows": rows}


def format_omission(data: dict) -> str:
    names = [n for n in ("skip", "full") if all(n in r["models"] for r in data["rows"])]
    label = {"skip": "skip-trained", "full": "full-trained"}
    header = ["kept stages", "subsets"] + [f"{label[n]} ppl mean (min..max)  vs full" for n in names]
    table = [header]
    for r in data["rows"]:
        cells = [f"{r['kept']}/{r['of']} ({100 * r['kept'] / r['of']:.4g}%)", str(r["subsets"])]
        for n in names:
            m = r["models"][n]
            cells.append(f"{m['mean_ppl']:.3f} ({m['min_ppl']:.3f}..{m['max_ppl']:.3f})  {m['mean_change_pct']:+.1f}%")
        table.append(cells)
    return text_table(table)


def rerun_omission(out_dir: pathlib.Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_omission", _HERE / "omission.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rc = module.main(["--out", str(out_dir)])
    if rc:
        raise BenchError(f"bench/omission.py exited with {rc}")


# ---------------------------------------------------------------------------------------------- report
def _letter(i: int) -> str:
    """Phase letter: 0 -> a (all nodes), 1.. -> b, c, ... (kills, then the join)."""
    return chr(ord("a") + i)


def _f(x: Optional[float], fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def format_report(res: dict) -> str:
    lines = ["phase                         nodes  iterations  mean s/it  median  (min..max)     microbatch s  "
             "dropped  retried  loss"]
    lines.append("-" * len(lines[0]))

    def row(name, members, s):
        if not s or not s.get("n"):
            return f"{name:<30}{members:>5}  (no iterations)"
        it = f"{s['iterations'][0]}-{s['iterations'][1]}"
        return (f"{name:<30}{members:>5}  {it:>10}  {s['mean_s']:>9.2f}  {s['median_s']:>6.2f}  "
                f"({s['min_s']:.2f}..{s['max_s']:.2f}){'':<2}{s['mean_microbatch_s']:>12.2f}  {s['dropped']:>7}  "
                f"{s['retried']:>7}  {s['mean_loss']:.3f}")

    st = res["steady"]
    lines.append(row("a. all nodes", st["members"], st))
    for i, k in enumerate(res.get("kills", [])):
        lines.append(row(f"{_letter(i + 1)}. after losing {k['lost_total']}/{k['of']} ({k['fraction']:.0%})",
                         k["members"], k["after"]))
    j = res.get("join")
    if j and "after" in j:
        lines.append(row(f"{_letter(len(res.get('kills', [])) + 1)}. after 1 node joined", j["members"], j["after"]))
    lines.append("")
    for k in res.get("kills", []):
        hit = k["hit_iteration"]
        dist = k["disturbed_iterations"]
        lines.append(f"SIGKILL of nodes {k['victims']} (stages {k['victim_stages']}; {k['lost_total']}/{k['of']} "
                     f"non-data nodes lost in all) after iteration {k['killed_after_iteration']}:")
        lines.append(f"  kill -> next committed step        {k['kill_to_next_commit_s']:.2f} s "
                     f"(iteration {hit['iteration']}: {_f(hit['seconds'])} s, {hit['dropped']} dropped, "
                     f"{hit['retried']} retried)")
        lines.append(f"  kill -> survivors' epoch {k['settled_epoch']!s:<9} {k['kill_to_settled_epoch_s']:.2f} s "
                     f"(first commit in it {k['kill_to_first_settled_commit_s']:.2f} s; iteration "
                     f"{k['first_settled_iteration']}); in between {dist.get('n', 0)} iterations at "
                     f"{_f(dist.get('mean_s'))} s/it, {dist.get('dropped', 0)} dropped, {dist.get('retried', 0)} retried")
    if j:
        if "error" in j:
            lines.append(f"join: FAILED: {j['error']}")
        else:
            lines.append(f"join (node {j['node']}, --auto took stage {j['stage']}; data node at iteration "
                         f"{j['data_node_committed_at_spawn']} at spawn; start iterations {j['start_iterations']}"
                         f"{', dropped from an epoch and rejoined' if j['rejoined'] else ''}):")
            lines.append(f"  spawn -> ready (process, DHT, advert)      {j['spawn_to_ready_s']:.2f} s")
            lines.append(f"  ready -> training (epoch + state download) {_f(j['ready_to_training_s'])} s")
            lines.append(f"  ready -> committed_iteration >= start      {_f(j['ready_to_first_commit_s'])} s "
                         f"(iteration {j['first_commit_iteration']})")
            lines.append(f"  ready -> first iteration with the swarm    {j['ready_to_first_swarm_commit_s']:.2f} s "
                         f"(iteration {j['first_swarm_iteration']}, epoch {j['epoch']})")
            lines.append(f"  join-to-first-microbatch (spawn -> that)   {j['join_to_first_microbatch_s']:.2f} s")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python bench/faults.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("swarm")
    g.add_argument("--stage-sizes", default="2,3,3,3,3",
                   help="nodes per stage, stage 0 = data nodes (default %(default)s: 14 daemons, 12 non-data)")
    g.add_argument("--path-length", type=int, default=None,
                   help="stages per path, stage 0 included (default: one stage skipped, 4 of the default 5)")
    g.add_argument("--heartbeat", type=float, default=2.0, help="daemon heartbeat, s (advert TTL = 3x; default %(default)s)")
    g.add_argument("--microbatches", type=int, default=2, help="per data node per iteration (default %(default)s)")
    g.add_argument("--microbatch-size", type=int, default=4, help="sequences per microbatch (default %(default)s)")
    g.add_argument("--iterations", type=int, default=400,
                   help="the daemons' --iterations; only a cap, the swarm is stopped after the phases (default %(default)s)")
    g = p.add_argument_group("phases")
    g.add_argument("--lose", type=float, nargs="+", default=[0.25, 0.5], metavar="F",
                   help="cumulative fractions of the non-data nodes killed, one kill step each (default 0.25 0.5)")
    g.add_argument("--warmup", type=int, default=3, help="iterations before the all-nodes window (default %(default)s)")
    g.add_argument("--measure", type=int, default=6, help="iterations per measured window (default %(default)s)")
    g.add_argument("--settle-skip", type=int, default=1,
                   help="iterations skipped after an epoch change before measuring (default %(default)s)")
    g.add_argument("--kill-at", type=float, default=0.5,
                   help="kill this fraction of a steady iteration after a commit (default %(default)s)")
    g.add_argument("--no-join", dest="join", action="store_false", help="skip phase d (a node joins)")
    g.add_argument("--poll", type=float, default=0.1, help="seconds between RPC polls (default %(default)s)")
    g.add_argument("--start-timeout", type=float, default=300.0, help="seconds for the daemons to come up (default %(default)s)")
    g.add_argument("--start-batch", type=int, default=5, help="daemons started together (default %(default)s)")
    g.add_argument("--start-retries", type=int, default=2,
                   help="restarts of a daemon that exits while starting (default %(default)s)")
    g.add_argument("--phase-timeout", type=float, default=600.0, help="seconds any one wait may take (default %(default)s)")
    g.add_argument("--workdir", type=pathlib.Path, default=None,
                   help="keep the daemons' folders (logs) here; default a temporary folder, kept only on failure")
    g = p.add_argument_group("omission table and output")
    g.add_argument("--no-swarm", dest="swarm", action="store_false", help="only print the omission table")
    g.add_argument("--omission-file", type=pathlib.Path, default=OMISSION_FILE, help="default bench/results/omission.json")
    g.add_argument("--omission-rerun", action="store_true",
                   help="recompute the omission file with bench/omission.py first (minutes; trains the two "
                        "convergence models if runs/convergence is missing)")
    g.add_argument("--out", type=pathlib.Path, default=RESULTS_DIR, help="results folder (default bench/results)")
    args = p.parse_args(argv)
    try:
        args.sizes = [int(x) for x in args.stage_sizes.split(",")]
    except ValueError:
        p.error(f"--stage-sizes must be comma-separated integers, got {args.stage_sizes!r}")
    if len(args.sizes) < 2 or min(args.sizes) < 1:
        p.error("--stage-sizes needs stage 0 and at least one more stage, each with >= 1 node")
    if args.path_length is None:
        args.path_length = max(2, len(args.sizes) - 1)
    if not 2 <= args.path_length <= len(args.sizes):
        p.error(f"--path-length must be in 2..{len(args.sizes)} (the number of stages)")
    if args.warmup < 0 or args.measure < 1 or args.settle_skip < 0 or args.poll <= 0 or not 0 <= args.kill_at < 5:
        p.error("--warmup/--settle-skip >= 0, --measure >= 1, --poll > 0, --kill-at in [0, 5)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_bench(lambda: _main(args), "every daemon was stopped")


def _main(args) -> int:
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    load_start = os.getloadavg()
    if args.swarm:
        try:
            import node.compat  # noqa: F401  the daemons' own imports (torch, hivemind)
            import torch  # noqa: F401
            from node.launch.process_swarm import ProcessSwarm  # noqa: F401
        except ImportError as e:
            raise BenchError(f"cannot import the node package ({e}); run with the project's venv: "
                             ".venv/bin/python bench/faults.py (bash scripts/setup.sh creates it)") from None
        plan = kill_plan(args.sizes, args.lose)  # validate before starting anything
        print(f"faults: {sum(args.sizes)} daemons, stage sizes {args.sizes} (stage 0 = data nodes), path length "
              f"{args.path_length}/{len(args.sizes)}, tiny model, {args.microbatches} x {args.microbatch_size} sequences "
              f"per data node, heartbeat {args.heartbeat:g} s; {os.cpu_count()} CPUs, load {load_start[0]:.1f}",
              flush=True)
    swarm_res = None
    if args.swarm:
        print(f"  kill plan (non-data nodes, cumulative {', '.join(f'{f:.0%}' for f in args.lose)}): {plan}", flush=True)

        with bench_workdir(args.workdir, "skippipe-faults-") as base:
            swarm_res = run_swarm(args, base)
        print()
        print(format_report(swarm_res))
    if args.omission_rerun:
        rerun_omission(args.omission_file.parent)
    omission = omission_rows(args.omission_file)
    print()
    if omission is None:
        print(f"omission table: no {args.omission_file}; run python bench/omission.py or pass --omission-rerun")
    else:
        print(f"omission table (from {args.omission_file}, not retrained; iteration {omission.get('iteration')}, "
              f"{omission.get('validation', {}).get('tokens')} validation tokens; 75% of 6 stages lies between "
              "5/6 and 4/6):")
        print(format_omission(omission))
    if not args.swarm:
        return 0
    result = {
        **run_record(args, started, load_start, "shared with other users' tests; all daemons on these cores, loopback"),
        "iteration_time": "data node 0's IterationStats.seconds (wall time per iteration, step included)",
        **swarm_res,
        "omission": None if omission is None else {
            "source": str(args.omission_file),
            "rows": [{"kept": r["kept"], "of": r["of"], "fraction": r["kept"] / r["of"], "subsets": r["subsets"],
                      **{n: {k: v for k, v in m.items() if k != "per_subset"} for n, m in r["models"].items()}}
                     for r in omission["rows"]]},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "faults.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {path}")
    join_failed = isinstance(swarm_res.get("join"), dict) and "error" in swarm_res["join"]
    return 1 if join_failed or swarm_res.get("leftover_processes") else 0


if __name__ == "__main__":
    sys.exit(main())
