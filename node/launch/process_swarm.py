"""Start and stop N ``skippipe node run`` daemons on 127.0.0.1 (development, tests, benchmarks).

Each daemon runs in its **own process group** (``start_new_session=True``). A daemon has
children of its own (p2pd, the forked DHT process) that die with it only on a clean shutdown, so
stopping is SIGTERM to the daemon (a clean leave: it drains, then stops its children; a SIGTERM to
the group would kill p2pd under the draining daemon), then SIGKILL to whatever is left of the group. That is what keeps p2pd processes from being orphaned, also
when a test SIGKILLs a node on purpose.

Readiness is reported by each daemon through a JSON ``--ready-file`` (status incl. peer id,
multiaddrs and RPC port), which avoids parsing human-oriented stdout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, List, Sequence

from node.errors import UserError
from node.net.rpc import call_http
from node.launch.procs import process_group_members
from node.net.lifetime import PARENT_PID_ENV
from node.spec import TrainSpec

__all__ = ["ProcessNode", "ProcessSwarm", "LOCAL_SPEC", "stage_layout", "process_group_members", "training_state"]

#: Seconds a node gets to come up (p2pd + DHT + gossip on a loaded 2-core box).
DEFAULT_START_TIMEOUT_S = 90.0
#: Seconds between SIGTERM and SIGKILL of a node's process group.
DEFAULT_STOP_GRACE_S = 15.0
_POLL_S = 0.1
#: Run id of a local swarm started without a spec or a run id.
LOCAL_RUN_ID = "local"
#: Heartbeat of a local swarm started without a spec or a heartbeat: on loopback a second is plenty and
#: deaths are noticed within a few seconds.
LOCAL_HEARTBEAT_S = 1.0
#: The run of a local swarm started without a spec (``skippipe swarm local``'s defaults).
LOCAL_SPEC = TrainSpec(run_id=LOCAL_RUN_ID, heartbeat=LOCAL_HEARTBEAT_S)


def stage_layout(stage_sizes: Sequence[int]) -> list[int]:
    """Stage of each node index: ``[2, 1, 1] -> [0, 0, 1, 2]``."""
    out = []
    for stage, size in enumerate(stage_sizes):
        if size < 1:
            raise UserError(f"--stage-sizes entries must be >= 1, got {list(stage_sizes)}")
        out.extend([stage] * size)
    return out


def training_state(node: "ProcessNode", limit: int | None = None, *, since: int | None = None,
                   timeout: float = 10.0) -> dict | None:
    """The node's ``training`` RPC (its last ``limit`` iterations, or those after ``since``), or None
    if it does not answer right now: dead, still starting, or too busy."""
    if not node.alive or not node.info:
        return None
    params = {}
    if limit is not None:
        params["limit"] = limit
    if since is not None:
        params["since"] = since
    try:
        return call_http(node.rpc_url, "training", params, timeout=timeout)
    except Exception:  # noqa: BLE001 - a busy daemon answers next time
        return None


@dataclass
class ProcessNode:
    """One daemon process of a local swarm."""

    index: int
    stage: int
    workdir: Path
    args: list[str]
    proc: subprocess.Popen | None = None
    info: dict = field(default_factory=dict)
    #: joins with ``--auto`` (the daemon picks the neediest stage) instead of ``--stages stage``
    auto: bool = False

    @property
    def identity_path(self) -> Path:
        return self.workdir / "identity.key"

    @property
    def ready_file(self) -> Path:
        return self.workdir / "ready.json"

    @property
    def log_path(self) -> Path:
        return self.workdir / "node.log"

    @property
    def peer_id(self) -> str:
        return self.info.get("peer_id", "")

    @property
    def rpc_url(self) -> str:
        return f"http://127.0.0.1:{self.info['rpc_port']}"

    @property
    def maddr(self) -> str:
        return self.info["maddrs"][0]

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def group_pids(self) -> list[int]:
        return process_group_members(self.proc.pid) if self.proc is not None else []


class ProcessSwarm:
    """N daemons on loopback; node 0 founds the swarm, the rest join through it.

    Every daemon runs with the run's flags (``spec.to_argv()``, the stage count from ``stage_sizes``) after
    its own (stage, addresses, identity, ports, ready file, peers); without a ``spec`` the run is
    ``run_id``, ``heartbeat_s`` and ``path_length``. ``extra_args`` is appended to every ``skippipe node
    run`` (a list, or a function of the node index), e.g. a node's name.
    """

    def __init__(
        self,
        n_nodes: int,
        stage_sizes: Sequence[int] | None = None,
        *,
        base_dir: Path,
        run_id: str | None = None,
        heartbeat_s: float | None = None,
        path_length: int | None = None,
        spec: TrainSpec | None = None,
        extra_args: Sequence[str] | Callable[[int], Sequence[str]] = (),
        python: str = sys.executable,
        env: dict | None = None,
    ):
        if n_nodes < 1:
            raise UserError("--nodes must be at least 1")
        # Default: two stages, data nodes (stage 0) getting the larger half.
        sizes = list(stage_sizes) if stage_sizes else ([n_nodes - n_nodes // 2, n_nodes // 2] if n_nodes > 1 else [1])
        layout = stage_layout(sizes)
        if len(layout) != n_nodes:
            raise UserError(f"--stage-sizes {sizes} add up to {len(layout)} nodes, not --nodes {n_nodes}")
        self.stage_sizes = sizes
        self.base_dir = Path(base_dir)
        if spec is not None and (run_id, heartbeat_s, path_length) != (None, None, None):
            raise ValueError("give the run's id, heartbeat and path length in spec or as keywords, not both")
        run = spec if spec is not None else replace(
            LOCAL_SPEC, path_length=path_length, **({} if run_id is None else {"run_id": run_id}),
            **({} if heartbeat_s is None else {"heartbeat": float(heartbeat_s)}))
        self.spec = replace(run, num_stages=len(sizes))
        self.python = python
        self.env = dict(os.environ if env is None else env)
        self._extra = extra_args
        self.nodes = [
            ProcessNode(index=i, stage=layout[i], workdir=self.base_dir / f"node{i}", args=[]) for i in range(n_nodes)
        ]

    # ------------------------------------------------------------------ commands
    def command(self, node: ProcessNode, initial_peers: Sequence[str] = ()) -> list[str]:
        args = [
            self.python, "-m", "node", "node", "run",
            *(["--auto"] if node.auto else ["--stages", str(node.stage)]),
            "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
            "--identity", str(node.identity_path),
            "--rpc-port", "0",
            "--ready-file", str(node.ready_file),
            *self.spec.to_argv(),
        ]  # fmt: skip
        if initial_peers:
            args += ["--initial-peers", *initial_peers]
        extra = self._extra(node.index) if callable(self._extra) else self._extra
        return args + list(extra)

    @property
    def run_id(self) -> str:
        return self.spec.run_id

    @property
    def heartbeat_s(self) -> float:
        return self.spec.heartbeat

    @property
    def path_length(self) -> int | None:
        return self.spec.path_length

    @property
    def bootstrap_maddr(self) -> str:
        return self.nodes[0].maddr

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = DEFAULT_START_TIMEOUT_S) -> None:
        """Start node 0, wait for it, then start the rest in parallel and wait for all."""
        try:
            self.spawn(self.nodes[0])
            self.wait_ready([self.nodes[0]], timeout)
            for node in self.nodes[1:]:
                self.spawn(node)
            self.wait_ready(self.nodes[1:], timeout)
        except BaseException:
            self.stop()
            raise

    def spawn(self, node: ProcessNode, initial_peers: Sequence[str] | None = None) -> None:
        node.workdir.mkdir(parents=True, exist_ok=True)
        node.ready_file.unlink(missing_ok=True)
        node.info = {}
        if initial_peers is None:
            initial_peers = [] if node.index == 0 and not self.nodes[0].info else [self._any_live_maddr(node)]
        node.args = self.command(node, initial_peers)
        log = open(node.log_path, "ab")
        try:
            node.proc = subprocess.Popen(
                node.args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**self.env, PARENT_PID_ENV: str(os.getpid())},  # the daemon exits when this process dies
            )
        finally:
            log.close()

    def add_node(self, stage: int | None = None, timeout: float = DEFAULT_START_TIMEOUT_S, wait: bool = True) -> ProcessNode:
        """Start one more daemon that joins the running swarm (mid-training joins, chaos tests).

        ``stage=None`` joins with ``--auto``; its stage is then read from its ready file."""
        index = len(self.nodes)
        node = ProcessNode(index=index, stage=-1 if stage is None else stage, workdir=self.base_dir / f"node{index}",
                         args=[], auto=stage is None)
        self.nodes.append(node)
        self.spawn(node, [self._any_live_maddr(node)])
        if wait:
            self.wait_ready([node], timeout)
        return node

    def _any_live_maddr(self, joining: ProcessNode) -> str:
        for node in self.nodes:
            if node is not joining and node.alive and node.info:
                return node.maddr
        raise UserError("no live node to join through")

    def wait_ready(self, nodes: Sequence[ProcessNode], timeout: float = DEFAULT_START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        pending = list(nodes)
        while pending:
            for node in list(pending):
                if node.ready_file.exists():
                    try:
                        node.info = json.loads(node.ready_file.read_text())
                        if node.auto and node.info.get("stages"):
                            node.stage = int(node.info["stages"][0])
                        pending.remove(node)
                        continue
                    except (OSError, ValueError):
                        pass
                if not node.alive:
                    raise UserError(f"node {node.index} exited during start-up: {self.last_error(node)}")
            if pending and time.monotonic() > deadline:
                raise UserError(f"nodes {[n.index for n in pending]} not ready after {timeout:.0f} s")
            time.sleep(_POLL_S)

    def last_error(self, node: ProcessNode) -> str:
        try:
            lines = node.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "no log"
        errors = [line for line in lines if line.startswith("error:")]
        return (errors or lines or ["no output"])[-1]

    def kill(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Signal node ``index``: SIGKILL goes to its whole process group (a crash: daemon, p2pd and
        DHT child die at once); any other signal (SIGTERM: a graceful leave) to the daemon process
        only, because the daemon still needs its p2pd and DHT child to drain and say goodbye."""
        node = self.nodes[index]
        if node.proc is None:
            return
        try:
            if sig == signal.SIGKILL:
                os.killpg(node.proc.pid, sig)
            else:
                os.kill(node.proc.pid, sig)
        except ProcessLookupError:
            pass
        if sig == signal.SIGKILL:
            node.proc.wait()
            self._reap_group(node, 5.0)

    def restart(self, index: int, timeout: float = DEFAULT_START_TIMEOUT_S) -> None:
        """Start node ``index`` again with the same identity (it must have stopped)."""
        node = self.nodes[index]
        if node.alive:
            raise UserError(f"node {index} is still running")
        self.spawn(node, [self._any_live_maddr(node)])
        self.wait_ready([node], timeout)

    def stop_node(self, index: int, grace: float = DEFAULT_STOP_GRACE_S) -> None:
        node = self.nodes[index]
        if node.proc is None:
            return
        if node.alive:
            try:
                os.kill(node.proc.pid, signal.SIGTERM)  # the daemon drains, then stops its children
            except ProcessLookupError:
                pass
        try:
            node.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        self._reap_group(node, 0.0)

    def stop_shielded(self) -> List[int]:
        """:meth:`stop` with SIGINT ignored meanwhile (a second Ctrl+C must not abort the clean stop of a
        command's swarm); returns the pids still left in the daemons' process groups (none expected)."""
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            self.stop()
            return [p for n in self.nodes for p in n.group_pids()]
        finally:
            signal.signal(signal.SIGINT, previous)

    def stop(self, grace: float = DEFAULT_STOP_GRACE_S) -> None:
        """SIGTERM every daemon, wait up to ``grace``, then SIGKILL what is left of each group."""
        for node in self.nodes:
            if node.alive:
                try:
                    os.kill(node.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        for node in self.nodes:
            if node.proc is None:
                continue
            try:
                node.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for node in self.nodes:
            if node.proc is not None:
                self._reap_group(node, 2.0)

    def _reap_group(self, node: ProcessNode, wait_s: float) -> None:
        """Give the group's remaining members ``wait_s`` to exit, then SIGKILL the group."""
        deadline = time.monotonic() + wait_s
        while node.group_pids() and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        if node.group_pids():
            try:
                os.killpg(node.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if node.proc.poll() is None:
            node.proc.kill()
            node.proc.wait()

    def __enter__(self) -> "ProcessSwarm":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
