"""``skippipe swarm status`` (inspect a running swarm) and ``skippipe swarm local`` (start one)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import threading
from pathlib import Path

from node.cli.run_args import add_run_arguments
from node.cli.validate import MAX_STAGES, float_range, int_range
from node.errors import UserError
from node.launch.process_swarm import LOCAL_SPEC
from node.spec import TrainSpec

__all__ = ["register", "fetch_status", "format_status"]

#: Characters of a peer id shown in tables (the tail is what differs between Qm... ids).
SHORT_ID_CHARS = 10


def _short(peer_id: str | None) -> str:
    if not peer_id:
        return "-"
    return "…" + peer_id[-SHORT_ID_CHARS:]


def fetch_status(rpc: str | None, peer: str | None, timeout: float, swarm_key: bytes | None = None) -> dict:
    """``{"status", "swarm", "schedule"}`` of one node, over local HTTP or libp2p."""
    methods = ("status", "swarm", "schedule")
    if rpc:
        from node.net.rpc import RpcCallError, call_http

        try:
            data = {m: call_http(rpc, m, timeout=timeout) for m in methods}
        except RpcCallError as e:
            raise UserError(str(e)) from None
        try:  # only daemons running --train have it
            data["training"] = call_http(rpc, "training", {"limit": 1}, timeout=timeout)
        except Exception:  # noqa: BLE001
            data["training"] = None
        return data
    return _fetch_over_p2p(peer, methods, timeout, swarm_key)


def _fetch_over_p2p(maddr: str, methods, timeout: float, swarm_key: bytes | None = None) -> dict:
    import asyncio

    import node.compat  # noqa: F401
    from hivemind.p2p import P2P, PeerID
    from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
    from multiaddr import Multiaddr

    from node.net.access import HELLO_PROOF_PARAM, SwarmAccess
    from node.net.rpc import RpcCallError, call_p2p

    try:
        peer_id = PeerID.from_base58(Multiaddr(maddr).value_for_protocol("p2p"))
    except Exception:  # noqa: BLE001
        raise UserError(f"--peer {maddr!r} must be a multiaddr ending with /p2p/<peer id>") from None

    async def main() -> dict:
        try:
            p2p = await P2P.create(initial_peers=[maddr], host_maddrs=["/ip4/127.0.0.1/tcp/0"], dht_mode="client")
        except P2PDaemonError:
            raise UserError(f"cannot reach {maddr}") from None
        # a private swarm answers members only: prove the swarm key for this client's peer id
        proof = {} if swarm_key is None else {
            HELLO_PROOF_PARAM: SwarmAccess(swarm_key).hello_proof(p2p.peer_id.to_base58())}
        try:
            data = {m: await call_p2p(p2p, peer_id, m, dict(proof), timeout=timeout) for m in methods}
            try:  # only daemons running --train have it
                data["training"] = await call_p2p(p2p, peer_id, "training", dict(proof, limit=1), timeout=timeout)
            except Exception:  # noqa: BLE001
                data["training"] = None
            return data
        except RpcCallError as e:
            raise UserError(str(e)) from None
        finally:
            await p2p.shutdown()

    return asyncio.run(main())


def format_status(data: dict) -> str:
    """Human-readable tables of one node's view."""
    st, sw, sc = data["status"], data["swarm"], data["schedule"]
    lines = [
        f"node {st['peer_id']} ({st['state']}, stages {st['stages']}) in run {st['run_id']!r}",
        f"  run: {st.get('run')}  heartbeat {st.get('heartbeat_s')} s  uptime {st.get('uptime_s')} s",
        f"  schedule: epoch {sc.get('epoch')} ({sc.get('status')})"
        + (f" by {_short(sc.get('coordinator'))}" if sc.get("epoch") is not None else ""),
    ]
    reach = st.get("reachability") or {}
    if reach:
        lines.append(f"  reachability: {reach.get('reachability')}"
                     + (f", seen from {reach['observed_ip']}" if reach.get("observed_ip") else "")
                     + (f", via {', '.join(reach['relays'])}" if reach.get("relays") else ""))
    relay = st.get("relay") or {}
    if relay.get("serving") or relay.get("relayed_bytes"):
        lines.append(f"  relay: {'serving' if relay.get('serving') else 'stopped'}, {relay.get('circuits', 0)} "
                     f"circuits open, {relay.get('relayed_bytes', 0) / 1e6:.1f} MB relayed")
    if st.get("missing_stages"):
        lines.append(f"  MISSING STAGES: {st['missing_stages']} have no live replica: training pauses until a node "
                     "holding them (or its checkpoint) returns")
    tr = data.get("training")
    if tr:
        last = (tr.get("history") or [None])[-1]
        lines.append(
            f"  training: {tr.get('state')} on epoch {tr.get('epoch')}, stage {tr.get('stage')}, "
            f"iteration {(tr.get('committed_iteration') if tr.get('committed_iteration') is not None else -1) + 1}"
            f"/{tr.get('iterations')}"
            + (f", loss {last['loss']:.4f}, {last['seconds']:.2f} s/it, {last['active_nodes']} nodes" if last else "")
            + (f" — error: {tr['error']}" if tr.get("error") else ""))
        if tr.get("paused"):
            lines.append(f"  paused: {tr['paused']}")
        if tr.get("draining"):
            lines.append("  draining: training on until a schedule epoch without this node starts")
        rec = tr.get("recovery") or {}
        if any(rec.values()):
            lines.append("  recovery: " + ", ".join(f"{k} {v}" for k, v in rec.items()))
    lines.append("")
    me = st["peer_id"]
    links = {(l["src"], l["dst"]): l for l in sw.get("links", [])}
    header = f"{'PEER':<13} {'STAGES':<8} {'STATE':<9} {'AGE_S':>6} {'S/SAMPLE/LAYER':>15} {'RTT_MS':>8} {'BW_MB/S':>8} {'REACH':<13}"
    lines.append(header)
    for p in sw.get("peers", []):
        link = links.get((me, p["peer_id"])) or links.get((p["peer_id"], me))
        rtt = f"{link['rtt_ms']:.2f}" if link else "-"
        bw = f"{link['bandwidth_Bps'] / 1e6:.1f}" if link and link.get("bandwidth_Bps") else "-"
        mark = "*" if p["peer_id"] == me else " "
        stages = ",".join(str(s) for s in p["stages"])
        lines.append(
            f"{_short(p['peer_id']) + mark:<13} {stages:<8} {p['state']:<9} {p['age_s']:>6.1f} "
            f"{p['compute_s_per_sample_per_layer']:>15.4f} {rtt:>8} {bw:>8} "
            f"{p.get('reachability', 'unknown') + ('+relay' if p.get('relay') else ''):<13}"
        )
    if sc.get("epoch") is not None:
        lines += ["", f"paths of epoch {sc['epoch']} (node index -> peer; ~> through a relay):"]
        lines += [f"  x{path['microbatches']}: {route}" for path, route in _routes(sc, sw.get("peers", []))]
    return "\n".join(lines)


def _routes(sc: dict, peers: list) -> list:
    """(path, its route as text) for each path of the schedule, a relayed hop drawn ``~>``."""
    from scheduler.reachability import LinkKind, link_kind

    reach = {p["peer_id"]: p.get("reachability", "unknown") for p in peers}
    relay = any(p.get("relay") and p.get("reachability") in ("direct", "unknown") for p in peers)
    members, out = sc["members"], []
    for path in sc["schedule"].get("paths", []):
        route = path["route"]
        text = _short(members[route[0]])
        for u, v in zip(route, route[1:]):
            kind = link_kind(reach.get(members[u], "unknown"), reach.get(members[v], "unknown"), relay)
            text += (" ~> " if kind is LinkKind.RELAYED else " -> ") + _short(members[v])
        out.append((path, text))
    return out


def _http_url(text: str) -> str:
    """``--rpc``: an http(s) URL with a host (anything else would reach urllib as garbage)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a URL: {text!r} ({e})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or len(text) > 2048:
        raise argparse.ArgumentTypeError(f"expected http://HOST:PORT, got {text[:100]!r}")
    return text


def _status(args: argparse.Namespace) -> int:
    if not args.peer and not args.rpc:
        raise UserError("pass --rpc http://127.0.0.1:PORT or --peer MADDR")
    key = None
    if args.swarm_key:
        from pathlib import Path

        from node.net.access import load_swarm_key

        key = load_swarm_key(Path(args.swarm_key))
    data = fetch_status(args.rpc, args.peer, args.timeout, key)
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        print(format_status(data))
    return 0


def _local(args: argparse.Namespace) -> int:
    from node.launch.watch import DeathWatch
    from node.launch.process_swarm import ProcessSwarm

    sizes = None
    if args.stage_sizes:
        try:
            sizes = [int(x) for x in args.stage_sizes.split(",")]
        except ValueError:
            raise UserError(f"--stage-sizes wants comma-separated integers, got {args.stage_sizes!r}") from None
        if len(sizes) > MAX_STAGES:
            raise UserError(f"--stage-sizes: at most {MAX_STAGES} stages")
    base = Path(args.base_dir) if args.base_dir else Path(tempfile.mkdtemp(prefix="skippipe-local-"))
    # the run's flags (run id, heartbeat, path length) as one spec; the words after -- go to every node as given
    swarm = ProcessSwarm(args.nodes, sizes, base_dir=base, spec=TrainSpec.from_args(args, base=LOCAL_SPEC),
                         extra_args=[a for a in args.node_args or () if a != "--"])
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"starting {args.nodes} nodes (stage sizes {swarm.stage_sizes}) under {base} ...", flush=True)
    try:
        swarm.start(timeout=args.start_timeout)
        print(f"bootstrap: {swarm.bootstrap_maddr}", flush=True)
        for node in swarm.nodes:
            print(f"  node {node.index}: stage {node.stage}  {node.peer_id}  rpc {node.rpc_url}  log {node.log_path}",
                  flush=True)
        print("swarm is up; Ctrl+C stops every node", flush=True)
        # a dead node is reported, not fatal: the swarm goes on without it (a stage left without a
        # live replica pauses training until one comes back); only when every node is gone we stop
        deaths = DeathWatch(swarm, stream=sys.stderr)
        said: set = set()
        while not stop.wait(0.5):
            for k in deaths.check():
                if k not in said:
                    said.add(k)
                    print(f"stage {k} has no live replica: training pauses until a node holds it again",
                          file=sys.stderr, flush=True)
            if not deaths.alive():
                print("every node exited", file=sys.stderr, flush=True)
                return 1
        return 0
    finally:
        print("stopping all nodes ...", flush=True)
        swarm.stop()
        print("stopped", flush=True)


def register(subparsers) -> None:
    swarm = subparsers.add_parser("swarm", help="inspect a swarm, or start a local one")
    sub = swarm.add_subparsers(dest="swarm_command", metavar="ACTION")

    status = sub.add_parser("status", help="peers, stages, states, links and schedule as one node sees them")
    where = status.add_mutually_exclusive_group()
    where.add_argument("--rpc", metavar="URL", type=_http_url, help="a local daemon's HTTP RPC, e.g. http://127.0.0.1:PORT")
    where.add_argument("--peer", metavar="MADDR", help="any node's multiaddr (ending in /p2p/<id>), over libp2p")
    status.add_argument("--swarm-key", metavar="FILE",
                        help="the private swarm's key: with --peer, a private swarm answers key holders only")
    status.add_argument("--json", action="store_true", help="print JSON instead of tables")
    status.add_argument("--timeout", type=float_range(0, 3600.0, lo_open=True), default=10.0, help="seconds to wait for the node")
    status.set_defaults(func=_status)

    local = sub.add_parser("local", help="start N daemons on 127.0.0.1 until Ctrl+C")
    local.add_argument("--nodes", type=int_range(1, 256), required=True)
    local.add_argument("--stage-sizes", help="nodes per stage, e.g. 2,1,1 (default: two stages)")
    add_run_arguments(local, ("path_length", "run_id", "heartbeat"), LOCAL_SPEC)  # as node run's, local defaults
    local.add_argument("--base-dir", help="where identities and logs go (default: a new temp dir)")
    local.add_argument("--start-timeout", type=float_range(0, 24 * 3600.0, lo_open=True), default=120.0)
    local.add_argument("node_args", nargs=argparse.REMAINDER,
                       help="after --, extra arguments for every `skippipe node run`")
    local.set_defaults(func=_local)
