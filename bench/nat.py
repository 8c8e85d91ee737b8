"""NAT benchmark: what two volunteers behind home routers cost a training swarm, side by side with an
all-public one.

Why: most donated GPUs sit behind a home router that accepts no inbound connection. The swarm handles
them by learning that nobody can dial them and never planning a hop between two of them
(``scheduler.reachability``); this measures what that costs in throughput and in start-up time, on real
daemons in network namespaces, against the same swarm with every node public.

Setup: the swarm of the NAT tests (:mod:`node.testing.nat_swarm`: 6 ``skippipe node run --train``
daemons, 2 data nodes, stages 1-3 with 1, 2, 1 replicas, paths of 3 of 4 stages, every host's uplink
capped by ``tbf`` at ``--rate-mbit``) in a :class:`node.testing.nat.NatLab`. Two fresh swarms, one after
the other, the same shaping and the same run:

1. ``public``: all six hosts on the public segment;
2. ``natted``: node 4 (a replica of stage 2) behind a port-preserving router, node 5 (stage 3) behind a
   strict one (a new public port per destination), no port forward; they join with the founder's join
   command unchanged.

Reported per configuration over the measured iterations (after ``--warmup``): tokens per second (the
tokens data node 0's ``IterationStats.tokens`` counts for both data nodes, over the sum of its
``seconds``), mean and median seconds per iteration (and where they go: microbatches, averaging, norm
exchange, step), microbatches per iteration through each node in the last schedule, and start-to-ONLINE
per node: seconds from the daemon's spawn (all five joiners spawned together once the founder is up) until
the founder's view shows it ONLINE (the view learns several joiners at once, so this is coarse), until
its advert says how it is reachable (``reachability`` not ``unknown``), and until it wrote its ready file
(the daemon is up and has learned its own reachability by dial-back).
Relayed bytes: what the members' application-level relays forwarded (their status RPC; docs/operations.md,
"Relay"): the schedule relays a hop between the two NATed nodes only where that beats the public replica.
``relayed_addresses_seen`` checks that no advert carries a p2pd circuit-relay address.

``nat_vs_public_tokens_ratio`` = tokens/s of ``natted`` / ``public`` (target: at least 0.8);
``nat_vs_public_online_ratio`` = the slower NATed node's start-to-ONLINE / the mean of the public joiners'
(nodes 1-3) in the same run (target: at most 2).

All daemons share this machine's cores: an idle box gives the figures, a loaded one only says it works
(the results record the load average). Needs root, iproute2 and iptables (one ``error:`` line otherwise).

Run: ``sudo .venv/bin/python bench/nat.py`` (2 + 60 iterations per configuration; about 3 minutes on 2
idle cores); ``--quick`` for a smoke run (1 + 3 iterations). Writes ``bench/results/nat.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

_ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

try:
    from node.ops.bench_cli import (BenchError, add_swarm_run_arguments, bench_workdir, resolve_run_length, run_bench,
                                    run_record)
except ImportError as _e:  # not the project's venv: one line, not a traceback
    print(f"error: cannot import the node package ({_e}); run with the project's venv: "
          ".venv/bin/python bench/nat.py (bash scripts/setup.sh creates it)", file=sys.stderr)
    sys.exit(2)

RESULTS_DIR = _ROOT / "bench" / "results"

__all__ = ["main", "parse_args", "summarize", "online_summary", "build_result", "CONFIGS"]

#: The two configurations, in the order they run: (name, two nodes behind NAT, lab name, first subnet).
#: Each has a lab of its own (names and subnets distinct from each other and from the tests' labs): the
#: kernel removes a deleted namespace's interfaces in the background, so a second lab of the same name made
#: right after the first can find them still there; and a bench run and a test run on one box must not
#: remove each other's namespaces.
CONFIGS: Tuple[Tuple[str, bool, str, int], ...] = (("public", False, "spnbp", 70), ("natted", True, "spnbn", 74))
#: Targets of the NAT work: NATed throughput at least this share of the all-public swarm's ...
TARGET_TOKENS_RATIO = 0.8
#: ... and a NATed node ONLINE in at most this many times a public node's start-up.
TARGET_ONLINE_RATIO = 2.0
#: Microbatches per data node per iteration and their size: 2 x 8 sequences, the daemon tests' run doubled,
#: so an iteration moves enough activations for the uplink cap to matter and still takes seconds.
MICROBATCHES = 2
MICROBATCH_SIZE = 8
#: Seconds an iteration may take before a daemon stops as stalled (a loaded box can take a minute).
ITERATION_TIMEOUT_S = 240.0
#: Seconds between polls of the founder's view and the data node's training state.
POLL_S = 0.5
#: Nodes 1-3: public joiners spawned with the NATed ones (node 0 founds the swarm before any joiner starts).
PUBLIC_JOINERS = (1, 2, 3)


# ---------------------------------------------------------------------------------------------- pure parts
def summarize(history: Sequence[dict], first: int, count: int) -> dict:
    """Throughput and iteration times of iterations ``first .. first + count - 1`` of data node 0's history."""
    rows = sorted((h for h in history if first <= int(h["iteration"]) < first + count), key=lambda h: h["iteration"])
    if not rows:
        raise ValueError(f"no iterations {first}..{first + count - 1} in the history")
    secs = [float(h["seconds"]) for h in rows]
    tokens = sum(int(h.get("tokens") or 0) for h in rows)
    return {
        "iterations": [rows[0]["iteration"], rows[-1]["iteration"]], "n": len(rows),
        "tokens": tokens, "tokens_per_s": tokens / sum(secs) if sum(secs) > 0 else 0.0,
        "mean_s": statistics.fmean(secs), "median_s": statistics.median(secs), "max_s": max(secs),
        "dropped": sum(int(h.get("dropped") or 0) for h in rows),
        # where an iteration's time goes: microbatches (activations and gradients on the wire), averaging,
        # the norm exchange and the optimizer step
        **{f"mean_{k}": statistics.fmean(float(h.get(k) or 0.0) for h in rows)
           for k in ("microbatch_s", "averaging_s", "norm_exchange_s", "step_s")},
        "mean_loss": statistics.fmean(float(h["loss"]) for h in rows),
        "seconds": [round(s, 3) for s in secs],
    }


def online_summary(online_s: Dict[int, Optional[float]], natted: Sequence[int]) -> dict:
    """Start-to-ONLINE of the NATed nodes against the public joiners of the same run."""
    public = [online_s[i] for i in PUBLIC_JOINERS if online_s.get(i) is not None]
    nat = [online_s[i] for i in natted if online_s.get(i) is not None]
    public_mean = statistics.fmean(public) if public else None
    slowest_nat = max(nat) if nat and len(nat) == len(natted) else None
    ratio = slowest_nat / public_mean if slowest_nat is not None and public_mean else None
    return {"public_joiners_mean_s": public_mean, "natted_max_s": slowest_nat, "natted_vs_public": ratio}


def microbatch_visits(schedule: dict, by_index: Dict[int, str]) -> Dict[int, int]:
    """Microbatches per iteration that visit each node (data nodes included) in the swarm's last schedule:
    where the load went, e.g. onto the public replica of a stage when the NATed one cannot be used."""
    members = schedule.get("members") or []
    index_of = {pid: i for i, pid in by_index.items()}
    visits = {i: 0 for i in by_index}
    for p in (schedule.get("schedule") or {}).get("paths", []):
        for m in set(p.get("route", [])):
            if 0 <= m < len(members) and members[m] in index_of:
                visits[index_of[members[m]]] += int(p.get("microbatches") or 0)
    return visits


def build_result(results: Dict[str, dict], meta: dict) -> dict:
    """The JSON written to ``nat.json``: the configurations and the two ratios at the top level."""
    pub, nat = results.get("public"), results.get("natted")
    tokens_ratio = (nat["tokens_per_s"] / pub["tokens_per_s"]
                    if pub and nat and pub["tokens_per_s"] > 0 else None)
    online_ratio = (nat or {}).get("online", {}).get("natted_vs_public")
    return {
        **meta,
        "nat_vs_public_tokens_ratio": tokens_ratio, "target_tokens_ratio": TARGET_TOKENS_RATIO,
        "nat_vs_public_online_ratio": online_ratio, "target_online_ratio": TARGET_ONLINE_RATIO,
        "bytes_relayed": sum(int(r.get("bytes_relayed") or 0) for r in results.values()),
        "relay": "public members relay data-plane frames between NATed members (--relay auto, node.dataplane.relay)",
        "configs": results,
    }


# ---------------------------------------------------------------------------------------------- one swarm
def _spec_argv(args) -> List[str]:
    from node.spec import TrainSpec

    run = TrainSpec(train=True, threads=1, microbatches=MICROBATCHES, microbatch_size=MICROBATCH_SIZE,
                    checkpoint_every=0, iterations=args.warmup + args.iterations, min_members=6,
                    iteration_timeout=ITERATION_TIMEOUT_S, agreement_timeout=float(args.start_timeout))
    return run.to_argv()


def _start(swarm, args, view_of, t_spawn: Dict[int, float], t_wall: Dict[int, float], online: Dict[str, float],
           known: Dict[str, float], reach: Dict[str, str], relayed: set) -> None:
    """Node 0 first, then the five others together; note when the founder sees each ONLINE."""
    t_spawn[0], t_wall[0] = time.monotonic(), time.time()
    swarm.spawn(swarm.nodes[0])
    swarm.wait_ready([swarm.nodes[0]], args.start_timeout)
    for node in swarm.nodes[1:]:
        t_spawn[node.index], t_wall[node.index] = time.monotonic(), time.time()
        swarm.spawn(node)
    deadline = time.monotonic() + args.start_timeout
    while True:
        _note_view(view_of(swarm.nodes[0]), online, known, reach, relayed)
        if len(online) >= len(swarm.nodes) - 1:  # the founder's own entry is not in its peers
            break
        for node in swarm.nodes[1:]:
            if not node.alive:
                raise BenchError(f"node {node.index} exited during start-up: {swarm.last_error(node)}")
        if time.monotonic() > deadline:
            raise BenchError(f"only {len(online)} of {len(swarm.nodes) - 1} joiners ONLINE after "
                             f"{args.start_timeout:.0f} s")
        time.sleep(POLL_S)
    swarm.wait_ready(swarm.nodes[1:], args.start_timeout)


def _note_view(view: Optional[dict], online: Dict[str, float], known: Dict[str, float], reach: Dict[str, str],
               relayed: set) -> None:
    now = time.monotonic()
    for p in (view or {}).get("peers", []):
        pid = p.get("peer_id")
        if p.get("state") == "ONLINE":
            online.setdefault(pid, now)
        r = p.get("reachability") or "unknown"
        reach[pid] = r
        if r != "unknown":
            known.setdefault(pid, now)
        relayed.update(m for m in p.get("maddrs", []) if "/p2p-circuit" in m)


def run_config(args, name: str, natted: bool, lab_name: str, subnet: int, base: pathlib.Path) -> dict:
    """One fresh lab and swarm; train ``warmup + iterations``; measure; stop every daemon; remove the lab."""
    from node.errors import UserError
    from node.testing.nat_swarm import NATTED, nat_swarm, nat_swarm_lab, rpc_in_namespace
    from node.testing.netns import lab_leftovers

    spec_argv = _spec_argv(args)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    lab = nat_swarm_lab(lab_name, subnet, natted=natted, rate_mbit=args.rate_mbit)
    t_spawn: Dict[int, float] = {}
    t_wall: Dict[int, float] = {}
    online: Dict[str, float] = {}
    known: Dict[str, float] = {}
    reach: Dict[str, str] = {}
    relayed: set = set()
    t0 = time.perf_counter()
    try:
        lab.up()
    except Exception as e:  # noqa: BLE001 - ip/iptables refused: say what it said
        raise BenchError(f"cannot create the lab's namespaces: {getattr(e, 'stderr', '') or e}".strip()) from None
    try:
        swarm = nat_swarm(lab, base / name, f"nat-{name}",
                          extra_args=lambda i: [*spec_argv, "--node-name", f"node{i}", "--log-level", "INFO"], env=env)
        view_of, training_of = rpc_in_namespace(swarm, "swarm"), rpc_in_namespace(swarm, "training", {"limit": 1000})
        try:
            _start(swarm, args, view_of, t_spawn, t_wall, online, known, reach, relayed)
            t_ready = {n.index: n.ready_file.stat().st_mtime for n in swarm.nodes}
            ready_s = time.perf_counter() - t0
            print(f"  {name}: 6 daemons ONLINE in {ready_s:.0f} s (logs in {base / name})", flush=True)
            state = _train(swarm, args, name, view_of, training_of, online, known, reach, relayed)
            schedule = rpc_in_namespace(swarm, "schedule")(swarm.nodes[0]) or {}
            status_of = rpc_in_namespace(swarm, "status")
            bytes_relayed = sum(int(((status_of(n) or {}).get("relay") or {}).get("relayed_bytes") or 0)
                                for n in swarm.nodes)  # what the public members' relays forwarded
        except UserError as e:
            raise BenchError(f"{name}: {e}") from None
        finally:
            swarm.stop()
            leftover = [p for n in swarm.nodes for p in n.group_pids()]
    finally:
        lab.down()
    stats = summarize(state["history"], args.warmup, args.iterations)
    by_index = {n.index: n.peer_id for n in swarm.nodes}
    online_s = {i: (online[pid] - t_spawn[i] if pid in online else None) for i, pid in by_index.items() if i}
    known_s = {i: (known[pid] - t_spawn[i] if pid in known else None) for i, pid in by_index.items() if i}
    ready_s = {i: t_ready[i] - t_wall[i] for i in t_ready if i}
    natted_nodes = list(NATTED) if natted else []
    return {**stats, "natted_nodes": natted_nodes,
            "reachability": {i: reach.get(pid, "unknown") for i, pid in by_index.items() if i},
            "online_s": online_s, "reachability_known_s": known_s, "ready_file_s": ready_s,
            "microbatch_visits": microbatch_visits(schedule, by_index),
            "online": online_summary(online_s, natted_nodes or list(NATTED)),
            "relayed_addresses_seen": sorted(relayed), "bytes_relayed": bytes_relayed,
            "wall_s": time.perf_counter() - t0, "leftover_processes": len(leftover),
            "leftover_namespaces": lab_leftovers(lab_name)}


def _train(swarm, args, name, view_of, training_of, online, known, reach, relayed) -> dict:
    """Poll until data node 0 is done (or stalls); keep noting the founder's view; return its final state."""
    last, last_change, shown = None, time.monotonic(), -1
    while True:
        _note_view(view_of(swarm.nodes[0]), online, known, reach, relayed)
        state = training_of(swarm.nodes[0])
        for node in swarm.nodes:
            if not node.alive:
                raise BenchError(f"{name}: node {node.index} exited: {swarm.last_error(node)}")
        if state is not None:
            if state.get("state") == "error":
                raise BenchError(f"{name}: data node 0 failed: {state.get('error')}")
            for h in state.get("history", []):
                if h["iteration"] > shown:
                    shown = h["iteration"]
                    print(f"    {name}: iteration {h['iteration']}  {h['seconds']:.2f} s  loss {h['loss']:.3f}  "
                          f"tokens {h.get('tokens')}", flush=True)
            if state.get("state") == "done":
                return state
            if state.get("committed_iteration") != last:
                last, last_change = state.get("committed_iteration"), time.monotonic()
        limit = args.start_timeout if last is None else args.stall_timeout
        if time.monotonic() - last_change > limit:
            raise BenchError(f"{name}: no iteration committed for {limit:.0f} s (last {last})")
        time.sleep(POLL_S)


# ---------------------------------------------------------------------------------------------- report
def format_table(results: Dict[str, dict]) -> str:
    from node.ops.tables import text_table

    rows = [["configuration", "iterations", "tokens/s", "mean s/it", "median", "max", "dropped",
             "ONLINE s (nodes 1-5)", "bytes relayed"]]
    for name, r in results.items():
        online = " ".join("-" if r["online_s"][i] is None else f"{r['online_s'][i]:.0f}" for i in sorted(r["online_s"]))
        rows.append([name, str(r["n"]), f"{r['tokens_per_s']:.0f}", f"{r['mean_s']:.2f}", f"{r['median_s']:.2f}",
                     f"{r['max_s']:.2f}", str(r["dropped"]), online, str(r["bytes_relayed"])])
    return text_table(rows)


# ---------------------------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python bench/nat.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=None,
                   help="measured iterations per configuration (default 60: over 20, one slow iteration "
                   "moves the mean by a tenth; 3 with --quick)")
    p.add_argument("--warmup", type=int, default=None, help="iterations before the measured ones (default 2; 1 "
                   "with --quick): the first iteration opens every stream")
    p.add_argument("--quick", action="store_true", help="a smoke run: 1 warm-up and 3 measured iterations each")
    p.add_argument("--rate-mbit", type=float, default=None,
                   help="every host's uplink cap in Mbit/s (default: the NAT tests' rate)")
    add_swarm_run_arguments(p, RESULTS_DIR)
    args = p.parse_args(argv)
    resolve_run_length(p, args, iterations=60, warmup=2)
    if args.rate_mbit is not None and not args.rate_mbit > 0:
        p.error("--rate-mbit must be > 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_bench(lambda: _main(args), "every daemon was stopped, the lab removed")


def write_result(result: dict, out: pathlib.Path) -> pathlib.Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "nat.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    return path


def _main(args) -> int:
    try:
        import node.compat  # noqa: F401  the daemons' own imports (torch, hivemind)
        from node.testing.nat import nat_unavailable
        from node.testing.nat_swarm import RATE_MBIT
    except ImportError as e:
        raise BenchError(f"cannot import the node package ({e}); run with the project's venv: "
                         ".venv/bin/python bench/nat.py (bash scripts/setup.sh creates it)") from None
    why = nat_unavailable()
    if why is not None:
        raise BenchError(f"cannot create the NAT lab: {why}")
    if args.rate_mbit is None:
        args.rate_mbit = RATE_MBIT
    started, load_start = time.strftime("%Y-%m-%d %H:%M:%S %Z"), os.getloadavg()
    print(f"nat: 6 daemons in network namespaces, uplinks capped at {args.rate_mbit:g} Mbit/s; {args.warmup} + "
          f"{args.iterations} iterations per configuration; {os.cpu_count()} CPUs, load {load_start[0]:.1f}",
          flush=True)

    results: Dict[str, dict] = {}
    with bench_workdir(args.workdir, "skippipe-nat-") as base:
        for name, natted, lab_name, subnet in CONFIGS:
            results[name] = run_config(args, name, natted, lab_name, subnet, base)
    meta = {
        **run_record(args, started, load_start, "all daemons on these cores, each in its own network namespace"),
        "tokens_per_s": "data node 0's IterationStats.tokens (both data nodes) over the sum of its seconds",
        "online_s": "seconds from a joiner's spawn until the founder's view shows it ONLINE",
    }
    result = build_result(results, meta)
    print()
    print(format_table(results))
    tr, orr = result["nat_vs_public_tokens_ratio"], result["nat_vs_public_online_ratio"]
    print(f"\nnat_vs_public_tokens_ratio: {tr:.2f} (target >= {TARGET_TOKENS_RATIO}: "
          f"{'met' if tr >= TARGET_TOKENS_RATIO else 'NOT met'}); NATed start-to-ONLINE / public: "
          + ("n/a" if orr is None else f"{orr:.2f} (target <= {TARGET_ONLINE_RATIO}: "
             f"{'met' if orr <= TARGET_ONLINE_RATIO else 'NOT met'})") + f"; bytes relayed: {result['bytes_relayed']}")
    path = write_result(result, args.out)
    print(f"wrote {path}")
    bad = any(r["leftover_processes"] or r["leftover_namespaces"] for r in results.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
