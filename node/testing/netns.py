"""Hosts of their own on one machine: Linux network namespaces on a bridge, with capped links.

Why: on 127.0.0.1 every daemon shares one address, so code that mixes up addresses (advertising a
loopback address, dialling the wrong interface, assuming a peer's RPC is on our host) still works.
Here each daemon runs in its own network namespace with its own address on a veth pair plugged into a
bridge, and its uplink is capped with ``tbf`` (the kernel has ``tbf``/``htb`` but no ``netem``), so
traffic really crosses an interface other than loopback and queues behind a bandwidth limit.

Needs root (or CAP_NET_ADMIN) and iproute2; :func:`netns_unavailable` says why not, for a skip.

Layout of a :class:`NetnsLab` named ``p`` with ``n`` hosts::

    root namespace: bridge ``p-br`` with ``10.X.0.1/24``
    namespace ``p-i`` (i = 0..n-1): ``eth0`` = ``10.X.0.(10+i)/24``, egress capped by tbf, ``lo`` up
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence, TypeVar

from node.launch.process_swarm import ProcessNode, ProcessSwarm

__all__ = ["NetnsLab", "NamespaceSwarm", "netns_unavailable", "run_in_netns"]

T = TypeVar("T")

_CLONE_NEWNET = 0x40000000
#: tbf bucket: large enough for one full-size TCP segment burst at these rates, small enough to shape
_TBF_BURST = "32kbit"
#: tbf queue: packets waiting longer than this are dropped (the link is congested, as a real uplink)
_TBF_LATENCY = "400ms"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def _in(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run a command inside namespace ``ns``."""
    return subprocess.run(["ip", "netns", "exec", ns, *args], check=check, capture_output=True, text=True)


def _shape(ns: str, dev: str, rate_mbit: float) -> None:
    """Cap ``dev``'s egress in ``ns`` at ``rate_mbit`` (tbf: the kernel here has no netem)."""
    _in(ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit", "burst", _TBF_BURST,
        "latency", _TBF_LATENCY)


class _BridgeLab:
    """What every lab shares: one bridge ``<name>-br`` at ``10.<subnet>.0.1``, hosts named ``<name>-<i>``,
    each joined to the bridge by a veth pair and shaped; ``with lab:`` makes it and removes it.
    Subclasses set ``name``, ``subnet``, ``rate_mbit`` and ``namespaces`` and define ``up``/``down``."""

    name: str
    subnet: int
    rate_mbit: float
    namespaces: list

    @property
    def bridge(self) -> str:
        return f"{self.name}-br"

    @property
    def gateway(self) -> str:
        return f"10.{self.subnet}.0.1"

    def namespace(self, index: int) -> str:
        return f"{self.name}-{index}"

    def _make_bridge(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def _add_on_bridge(self, ns: str, outer: str, address: str) -> None:
        """Namespace ``ns`` with ``eth0`` at ``address`` on the bridge (outer end ``outer``), egress shaped."""
        _ip("netns", "add", ns)
        self.namespaces.append(ns)
        _ip("link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", outer, "master", self.bridge)
        _ip("link", "set", outer, "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _shape(ns, "eth0", self.rate_mbit)

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()


def netns_unavailable() -> str | None:
    """Why namespaces cannot be made here (None when they can)."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"spprobe{os.getpid() % 100000}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()[:200]}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class NetnsLab(_BridgeLab):
    """``hosts`` namespaces on one bridge; each host's egress capped at ``rate_mbit``.

    Names are short (interface names have at most 15 characters), so ``name`` is at most 6.
    """

    name: str
    hosts: int
    subnet: int = 77  # 10.<subnet>.0.0/24
    rate_mbit: float = 100.0
    namespaces: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not (1 <= len(self.name) <= 6 and self.name.isalnum()):
            raise ValueError("lab name: 1-6 letters or digits")
        if not 1 <= self.hosts <= 200:
            raise ValueError("hosts must be 1..200")

    def address(self, index: int) -> str:
        return f"10.{self.subnet}.0.{10 + index}"

    def up(self) -> "NetnsLab":
        """Create the bridge and every host; on any failure, remove what was made and raise."""
        try:
            self.down()  # leftovers of a run that was killed before it could clean up
            self._make_bridge()
            for i in range(self.hosts):
                self._add_on_bridge(self.namespace(i), f"{self.name}v{i}", self.address(i))
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Remove every namespace (their veth ends go with them) and the bridge; never raises. The outer
        veth ends are removed by name too: a namespace whose name is gone lives on while a process of a killed
        run is still in it, and keeps its pair's outer end, which the next ``up`` could not create again."""
        for i in range(self.hosts):
            _ip("netns", "del", self.namespace(i), check=False)
            _ip("link", "del", f"{self.name}v{i}", check=False)
        _ip("link", "del", self.bridge, check=False)
        self.namespaces.clear()


def run_in_netns(namespace: str, fn: Callable[..., T], *args, **kwargs) -> T:
    """Call ``fn`` on a thread that has entered ``namespace``.

    A network namespace belongs to a thread, and sockets keep the namespace they were made in, so this
    reaches e.g. a daemon's HTTP endpoint on the 127.0.0.1 of its own namespace without a process.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    result: dict = {}

    def target() -> None:
        try:
            fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
            try:
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {namespace} failed")
            finally:
                os.close(fd)
            result["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            result["error"] = e

    thread = threading.Thread(target=target, name=f"netns-{namespace}", daemon=True)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


class NamespaceSwarm(ProcessSwarm):
    """A :class:`ProcessSwarm` whose node ``i`` runs in the lab's namespace ``i``, on the lab's address ``i``.

    Nodes added later (:meth:`ProcessSwarm.add_node`) take the next namespaces, so make the lab with
    room for them.
    """

    def __init__(self, lab: NetnsLab, n_nodes: int, stage_sizes: Sequence[int] | None = None, **kwargs):
        super().__init__(n_nodes, stage_sizes, **kwargs)
        self.lab = lab

    def command(self, node: ProcessNode, initial_peers: Sequence[str] = ()) -> list[str]:
        if node.index >= self.lab.hosts:
            raise ValueError(f"node {node.index} has no namespace: the lab has {self.lab.hosts} hosts")
        args = super().command(node, initial_peers)
        at = args.index("--host-maddrs")
        args[at + 1] = f"/ip4/{self.lab.address(node.index)}/tcp/0"
        return ["ip", "netns", "exec", self.lab.namespace(node.index), *args]

    def namespace_of(self, node: ProcessNode) -> str:
        return self.lab.namespace(node.index)


def lab_leftovers(name: str) -> list[str]:
    """Namespaces of a lab called ``name`` that still exist (for a test's clean-up check)."""
    try:
        entries = sorted(Path("/var/run/netns").iterdir())
    except OSError:
        return []
    return [p.name for p in entries if p.name.startswith(f"{name}-")]
