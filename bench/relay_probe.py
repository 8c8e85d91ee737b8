"""Relay probe: can a public node's p2pd carry hivemind streams between two nodes behind NAT, and when?

Why: the NAT work had to decide whether volunteers behind home routers reach each other through a relay
that public nodes provide, or only over connections they dial (docs/operations.md, "Behind NAT"). This
checks what hivemind's bundled p2pd actually does, on real NAT (:class:`node.testing.nat.NatLab`: one
public host, two homes behind source-NAT routers, one of them strict), so the finding can be re-run when
hivemind or its p2pd changes.

Roles, each a hivemind ``P2P`` (its own p2pd) in its own namespace:

* ``relay`` (public host 0): ``force_reachability="public"``, so its circuit-relay v2 service starts (AutoNAT
  never finds private addresses public);
* ``target`` (behind the plain router): ``use_auto_relay=True``, ``trusted_relays=[relay]``,
  ``force_reachability="private"``; it serves one stream handler (an echo);
* ``dialer`` (behind the strict router): connects to the target at ``<relay>/p2p-circuit/p2p/<target>``
  every :data:`RETRY_S` seconds until it gets through, then opens the handler's stream and checks the echo.

Prints and writes (``bench/results/relay_probe.json``) the seconds from the target's start until the first
relayed connection, and whether a stream worked over it. Needs root, iproute2 and iptables (one ``error:``
line otherwise). Run: ``sudo .venv/bin/python bench/relay_probe.py`` (about 4 minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

_ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

#: Lab name and subnet, distinct from the tests' and bench/nat.py's labs.
LAB = "spnr"
SUBNET = 100
#: Seconds between the dialler's attempts to reach the target through the relay.
RETRY_S = 5.0
#: Give up after this long: go-libp2p's autorelay waits 3 minutes before it reserves with few candidates.
GIVE_UP_S = 300.0
#: The stream protocol the target serves and the bytes the dialler sends (echoed back with a prefix).
PROTOCOL = "relay-probe/1"
PING = b"hello"


def _wait_json(path: pathlib.Path, timeout: float) -> dict:
    end = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > end:
            raise SystemExit(f"error: {path.name} did not appear in {timeout:.0f} s")
        time.sleep(0.2)
    time.sleep(0.2)
    return json.loads(path.read_text())


async def _role(role: str, ip: str, d: pathlib.Path) -> None:
    from hivemind.p2p import P2P, PeerID
    from multiaddr import Multiaddr

    host = [f"/ip4/{ip}/tcp/0"]
    if role == "relay":
        p2p = await P2P.create(host_maddrs=host, force_reachability="public")
        (d / "relay.json").write_text(json.dumps({"maddrs": [str(m) for m in await p2p.get_visible_maddrs()]}))
        await asyncio.sleep(GIVE_UP_S + 60)
    elif role == "target":
        relay = _wait_json(d / "relay.json", 60)["maddrs"]
        p2p = await P2P.create(host_maddrs=host, initial_peers=relay, trusted_relays=relay, use_auto_relay=True,
                               force_reachability="private")

        async def echo(_info, reader, writer):
            data = await reader.readexactly(len(PING))
            writer.write(b"pong:" + data)
            await writer.drain()
            writer.close()

        await p2p.add_binary_stream_handler(PROTOCOL, echo)
        (d / "target.json").write_text(json.dumps({"peer_id": str(p2p.peer_id), "started": time.time(),
                                                   "visible": [str(m) for m in await p2p.get_visible_maddrs()]}))
        await asyncio.sleep(GIVE_UP_S + 30)
    else:
        relay = _wait_json(d / "relay.json", 60)["maddrs"]
        target = _wait_json(d / "target.json", 60)
        p2p = await P2P.create(host_maddrs=host, initial_peers=relay)
        peer = PeerID.from_base58(target["peer_id"])
        circuit = [Multiaddr(f"{m}/p2p-circuit") for m in relay]
        result = {"connected_after_s": None, "stream_echo": None, "attempts": 0}
        while time.time() - target["started"] < GIVE_UP_S:
            result["attempts"] += 1
            try:
                await asyncio.wait_for(p2p._client.connect(peer, circuit), 30)
                result["connected_after_s"] = round(time.time() - target["started"], 1)
                break
            except Exception as e:  # noqa: BLE001 - NO_RESERVATION until the target reserves
                result["last_error"] = str(e).splitlines()[-1].strip()[:200]
                await asyncio.sleep(RETRY_S)
        if result["connected_after_s"] is not None:
            _, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(peer, PROTOCOL), 30)
            writer.write(PING)
            await writer.drain()
            result["stream_echo"] = (await asyncio.wait_for(reader.read(64), 30)).decode(errors="replace")
        result["target_visible_maddrs"] = target["visible"]
        (d / "dialer.json").write_text(json.dumps(result))
    await p2p.shutdown()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python bench/relay_probe.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=["relay", "target", "dialer"], help=argparse.SUPPRESS)
    p.add_argument("--ip", help=argparse.SUPPRESS)
    p.add_argument("--dir", type=pathlib.Path, help=argparse.SUPPRESS)
    p.add_argument("--out", type=pathlib.Path, default=_ROOT / "bench" / "results", help="results folder")
    args = p.parse_args(argv)
    if args.role:
        asyncio.run(_role(args.role, args.ip, args.dir))
        return 0
    from node.testing.nat import Home, NatKind, NatLab, nat_unavailable

    why = nat_unavailable()
    if why is not None:
        print(f"error: cannot create the NAT lab: {why}", file=sys.stderr)
        return 2
    d = pathlib.Path(tempfile.mkdtemp(prefix="skippipe-relay-probe-"))
    lab = NatLab(LAB, public=1, homes=(Home(1, NatKind.PLAIN), Home(1, NatKind.STRICT)), subnet=SUBNET)
    procs = []
    with lab:
        try:
            for role, host in (("relay", 0), ("target", 1), ("dialer", 2)):
                log = open(d / f"{role}.log", "w")
                procs.append(subprocess.Popen(
                    ["ip", "netns", "exec", lab.namespace(host), sys.executable, __file__, "--role", role, "--ip",
                     lab.address(host), "--dir", str(d)], stdout=log, stderr=subprocess.STDOUT,
                    env={**os.environ, "PYTHONPATH": str(_ROOT)}))
            procs[2].wait(timeout=GIVE_UP_S + 120)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
    if not (d / "dialer.json").exists():
        print(f"error: the dialler wrote no result (logs in {d})", file=sys.stderr)
        return 1
    result = json.loads((d / "dialer.json").read_text())
    result["date"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    result["load_avg_end"] = os.getloadavg()
    result["note"] = ("connected_after_s is dominated by go-libp2p autorelay's 3-minute boot delay; the box's load "
                      "moves it by seconds")
    shutil.rmtree(d, ignore_errors=True)
    print(json.dumps(result, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "relay_probe.json").write_text(json.dumps(result, indent=1))
    return 0 if result.get("stream_echo") == "pong:" + PING.decode() else 1


if __name__ == "__main__":
    sys.exit(main())
