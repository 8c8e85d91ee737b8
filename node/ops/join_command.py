"""The command a founding node prints for others to join its run (pure functions, no I/O).

A joiner must pass what every member of the run compares before training (docs/training.md, epoch
agreement): model, corpus, tokenizer, sequence length, microbatch size, learning rate, seed and
iterations, plus ``--train`` itself, the swarm key of a private swarm and a stage choice. The run's
``--num-stages``, ``--path-length`` and ``--microbatches`` come from the founder in the hello
handshake, so they are not repeated.

:meth:`node.spec.TrainSpec.join_argv` gives those flags (the CLI stores them on the trainer service as
``join_flags``); :func:`join_command_lines` builds the lines to print; :func:`join_lines_for_daemon` is the
one call the daemon's banner makes.

It lives in ``node.ops`` (imports nothing of node) rather than ``node.cli`` so that ``node.swarm.daemon``
may call it without breaking the one-way layering (tests/test_layering.py).
"""

from __future__ import annotations

import shlex
from typing import Iterable, List, Optional, Protocol, Sequence, runtime_checkable

__all__ = ["join_command_lines", "join_lines_for_daemon"]


def join_command_lines(run_id: str, maddrs: Sequence[str], training_flags: Sequence[str] = (),
                       swarm_key: Optional[str] = None, allow_peers: Optional[str] = None,
                       tokenizer_hash: Optional[str] = None) -> List[str]:
    """One ``skippipe node run ...`` line per reachable address, then hints (indented with ``#``).

    The stage choice is ``--auto`` (the bottleneck stage, and movable later); a joiner may replace it with
    ``--stages K``."""
    lines: List[str] = []
    for maddr in maddrs:
        parts = ["skippipe", "node", "run", "--run-id", run_id, "--initial-peers", maddr, "--auto"]
        if swarm_key:
            parts += ["--swarm-key", swarm_key]
        parts += list(training_flags)
        lines.append("  " + " ".join(shlex.quote(p) for p in parts))
    if not maddrs:
        lines.append("  (no reachable address yet: pass --announce-maddrs /ip4/<public ip>/tcp/<port>)")
    if swarm_key:
        lines.append(f"  # private swarm: copy {swarm_key} to the joining machine (same path, or change --swarm-key)")
    if allow_peers:
        lines.append(f"  # allowlist: add the joiner's peer id to {allow_peers} here first")
    if training_flags:
        lines.append("  # --auto takes the bottleneck stage (and may be moved later); --stages K pins one")
        if tokenizer_hash:
            lines.append(f"  # every member must use the tokenizer with hash {tokenizer_hash}")
    return lines


@runtime_checkable
class JoinAdvertiser(Protocol):
    """A daemon service whose run a joiner can join: the trainer service (its flags, and its config for the
    tokenizer hash every member must share)."""

    join_flags: Optional[List[str]]
    config: object  # node.train.common.TrainerConfig


def join_lines_for_daemon(config, services: Iterable[object], maddrs: Sequence[str]) -> List[str]:
    """:func:`join_command_lines` from a daemon's ``DaemonConfig`` and its services."""
    svc = next((s for s in services if isinstance(s, JoinAdvertiser) and s.join_flags is not None), None)
    flags = list(svc.join_flags) if svc is not None else []
    tok_hash = svc.config.data.tokenizer_hash if flags else None
    key, allow = config.swarm_key_path, config.allow_peers_path
    return join_command_lines(str(config.run_id), list(maddrs), flags,
                              swarm_key=str(key) if key else None, allow_peers=str(allow) if allow else None,
                              tokenizer_hash=tok_hash or None)
