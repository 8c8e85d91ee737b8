"""Membership benchmark of the node daemon on loopback.

For each swarm size N (default 5 and 20) it measures, with real ``skippipe node run`` processes:

* join: seconds from spawning a daemon until it is ready (DHT joined, advert stored, gossip up),
  and until it reports itself ONLINE;
* appear: seconds from spawning one extra node until every other node's view lists it ONLINE;
* detect dead: seconds from SIGKILL of one node until every surviving view has dropped it
  (bounded below by the advert TTL = 3 heartbeats);
* memory: RSS per node, summed over its process group (daemon + p2pd + forked DHT process).

All nodes share this machine's cores, so numbers measure the implementation under contention,
not a real network. Usage: ``python bench/membership.py [--sizes 5 20] [--heartbeat 1]``.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil


from node.launch.process_swarm import ProcessSwarm
from node.spec import TrainSpec
from node.net.rpc import RpcCallError, call_http

#: Seconds between RPC polls of every view.
POLL_S = 0.2
#: Give up on a measurement after this long.
DEADLINE_S = 180.0


def online_ids(url: str) -> set[str]:
    try:
        return {p["peer_id"] for p in call_http(url, "swarm", timeout=5)["peers"] if p["state"] == "ONLINE"}
    except RpcCallError:
        return set()


def wait_until(check, what: str) -> float | None:
    """Seconds until ``check()`` holds, or None (reported as "not reached") after DEADLINE_S."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < DEADLINE_S:
        if check():
            return time.monotonic() - t0
        time.sleep(POLL_S)
    print(f"  ! {what}: not reached within {DEADLINE_S:.0f} s", flush=True)
    return None


def group_memory_mb(pids: list[int]) -> tuple[float, float]:
    """(RSS, PSS) summed over a process group, in MiB.

    RSS double-counts pages the forked DHT process shares copy-on-write with the daemon (torch,
    hivemind); PSS splits shared pages between their users, so it sums to real usage.
    """
    rss = pss = 0
    for pid in pids:
        try:
            info = psutil.Process(pid).memory_full_info()
            rss += info.rss
            pss += getattr(info, "pss", info.rss)
        except psutil.Error:
            pass
    return rss / 2**20, pss / 2**20


def bench(n: int, heartbeat: float, base: Path) -> dict:
    sizes = [n - 2 * (n // 3), n // 3, n // 3] if n >= 3 else [n]
    # One extra node (the "newcomer") is started after the swarm of n-1 is up.
    swarm = ProcessSwarm(n, sizes, base_dir=base / f"n{n}", spec=TrainSpec(run_id=f"bench{n}", heartbeat=heartbeat))
    first, newcomer = swarm.nodes[:-1], swarm.nodes[-1]
    join_ready, join_online = [], []
    try:
        t_start = time.monotonic()
        spawn_at = {}
        swarm.spawn(first[0])
        spawn_at[0] = time.monotonic()
        swarm.wait_ready([first[0]])
        for node in first[1:]:
            swarm.spawn(node)
            spawn_at[node.index] = time.monotonic()
        pending = set(range(len(first)))
        ready_at, online_at = {}, {}
        while pending and time.monotonic() - t_start < DEADLINE_S:
            for i in list(pending):
                node = swarm.nodes[i]
                if i not in ready_at and node.ready_file.exists():
                    swarm.wait_ready([node])
                    ready_at[i] = time.monotonic()
                if i in ready_at:
                    try:
                        if call_http(node.rpc_url, "status", timeout=5)["state"] == "ONLINE":
                            online_at[i] = time.monotonic()
                            pending.discard(i)
                    except RpcCallError:
                        pass
                elif not node.alive:
                    raise RuntimeError(f"node {i} died: {swarm.last_error(node)}")
            time.sleep(POLL_S)
        if pending:
            raise RuntimeError(f"nodes {sorted(pending)} did not come up")
        join_ready = [ready_at[i] - spawn_at[i] for i in range(len(first))]
        join_online = [online_at[i] - spawn_at[i] for i in range(len(first))]
        everyone = {nd.peer_id for nd in first}
        t_converge = wait_until(lambda: all(online_ids(nd.rpc_url) >= everyone for nd in first), "all views complete")
        t_all_up = time.monotonic() - t_start if t_converge is not None else None

        # newcomer: spawn -> visible ONLINE in every other view
        t0 = time.monotonic()
        swarm.spawn(newcomer)
        swarm.wait_ready([newcomer])
        ok = wait_until(lambda: all(newcomer.peer_id in online_ids(nd.rpc_url) for nd in first), "newcomer visible")
        appear_total = time.monotonic() - t0 if ok is not None else None

        memory = [group_memory_mb(nd.group_pids()) for nd in swarm.nodes]
        rss, pss = [m[0] for m in memory], [m[1] for m in memory]
        procs = [len(nd.group_pids()) for nd in swarm.nodes]

        # dead node: SIGKILL a non-coordinator replica, wait until all survivors drop it
        victim = swarm.nodes[-2]
        survivors = [nd for nd in swarm.nodes if nd is not victim]
        t0 = time.monotonic()
        swarm.kill(victim.index, signal.SIGKILL)
        ok = wait_until(lambda: all(victim.peer_id not in online_ids(nd.rpc_url) for nd in survivors), "dead dropped")
        detect_total = time.monotonic() - t0 if ok is not None else None
        lag = [call_http(nd.rpc_url, "status", timeout=10) for nd in survivors]
    finally:
        swarm.stop()
    return {
        "nodes": n,
        "stage_sizes": sizes,
        "heartbeat_s": heartbeat,
        "advert_ttl_s": 3 * heartbeat,
        "join_ready_s": _stats(join_ready),
        "join_online_s": _stats(join_online),
        "all_views_complete_s": _round(t_all_up),
        "views_converged_after_online_s": _round(t_converge),
        "newcomer_in_all_views_s": _round(appear_total),
        "dead_node_dropped_from_all_views_s": _round(detect_total),
        "advert_store_s": _stats([x["last_announce_s"] for x in lag]),
        "view_refresh_s": _stats([x["last_refresh_s"] for x in lag]),
        "rss_per_node_mb": _stats(rss),
        "pss_per_node_mb": _stats(pss),
        "processes_per_node": max(procs),
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def _stats(xs: list[float]) -> dict:
    if not xs:
        return {}
    xs = sorted(xs)
    return {
        "median": round(statistics.median(xs), 2),
        "p90": round(xs[min(len(xs) - 1, int(0.9 * len(xs)))], 2),
        "max": round(xs[-1], 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[5, 20])
    parser.add_argument("--heartbeat", type=float, default=1.0)
    parser.add_argument("--json", action="store_true", help="print one JSON object per size only")
    args = parser.parse_args()
    print(f"cpus: {psutil.cpu_count()}  python: {sys.version.split()[0]}", flush=True)
    with tempfile.TemporaryDirectory(prefix="skippipe-bench-") as tmp:
        for n in args.sizes:
            result = bench(n, args.heartbeat, Path(tmp))
            if args.json:
                print(json.dumps(result), flush=True)
                continue
            print(f"\n== {n} nodes (stage sizes {result['stage_sizes']}, heartbeat {args.heartbeat} s, "
                  f"advert TTL {result['advert_ttl_s']} s) ==")
            for key in ("join_ready_s", "join_online_s", "rss_per_node_mb", "pss_per_node_mb", "advert_store_s",
                        "view_refresh_s"):
                print(f"  {key:<36} {result[key]}")
            for key in ("all_views_complete_s", "newcomer_in_all_views_s", "dead_node_dropped_from_all_views_s",
                        "processes_per_node"):
                print(f"  {key:<36} {result[key]}")
            print("  json: " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
