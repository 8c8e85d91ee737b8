"""The command a founding node prints for others to join its run (pure functions, no I/O).

A joiner must pass what every member of the run compares before training (docs/training.md, epoch
agreement): model, corpus, tokenizer, sequence length, microbatch size, learning rate, seed and
iterations, plus ``--train`` itself, the swarm key of a private swarm and a stage choice. The run's
``--num-stages``, ``--path-length`` and ``--microbatches`` come from the founder in the hello
handshake, so they are not repeated.

:func:`training_join_flags` turns the founder's parsed ``node run`` arguments into those flags (the
CLI stores them on the trainer service as ``join_flags``); :func:`join_command_lines` builds the lines
to print; :func:`join_lines_for_daemon` is the one call the daemon's banner makes.

It lives in ``node.ops`` (imports nothing of node) rather than ``node.cli`` so that ``node.swarm.daemon``
may call it without breaking the one-way layering (tests/test_layering.py).
"""

from __future__ import annotations

import argparse
import shlex
from typing import Iterable, List, Optional, Sequence

__all__ = ["training_join_flags", "join_command_lines", "join_lines_for_daemon"]

def _fmt(value: float) -> str:
    return repr(float(value)) if not float(value).is_integer() else str(float(value))


def training_join_flags(args: argparse.Namespace) -> List[str]:
    """The ``--train ...`` flags a joiner needs to train in the founder's run (empty without --train)."""
    if not getattr(args, "train", False):
        return []
    flags = ["--train"]
    if getattr(args, "model_config", None) is not None:
        flags += ["--model-config", str(args.model_config)]
    else:
        flags += ["--model", str(getattr(args, "model", "tiny"))]
    flags += ["--corpus", str(getattr(args, "corpus", "shakespeare"))]
    if getattr(args, "text_field", "text") != "text":
        flags += ["--text-field", str(args.text_field)]
    if getattr(args, "tokenizer", None):
        flags += ["--tokenizer", str(args.tokenizer)]
    flags += ["--iterations", str(getattr(args, "iterations", 100))]
    if getattr(args, "lr", None) is not None:
        flags += ["--lr", _fmt(args.lr)]
    flags += ["--seed", str(getattr(args, "seed", 0)), "--microbatch-size", str(getattr(args, "microbatch_size", 8))]
    if getattr(args, "seq_len", None) is not None:
        flags += ["--seq-len", str(args.seq_len)]
    # precision and wire format are part of the run configuration every member checks; a joiner's GPU may
    # differ, so the founder's resolved precision is passed, not "auto"
    precision = getattr(args, "precision", "auto")
    if precision not in (None, "auto"):
        flags += ["--precision", str(precision)]
    if getattr(args, "wire", "fp32") != "fp32":
        flags += ["--wire", str(args.wire)]
    if getattr(args, "min_members", 1) != 1:
        flags += ["--min-members", str(args.min_members)]
    if getattr(args, "checkpoint_dir", None) is not None:
        flags += ["--checkpoint-dir", str(args.checkpoint_dir), "--checkpoint-every", str(getattr(args, "checkpoint_every", 10))]
    return flags


def join_command_lines(run_id: str, maddrs: Sequence[str], training_flags: Sequence[str] = (),
                       swarm_key: Optional[str] = None, allow_peers: Optional[str] = None,
                       tokenizer_hash: Optional[str] = None) -> List[str]:
    """One ``skippipe node run ...`` line per reachable address, then hints (indented with ``#``).

    The stage choice is ``--auto`` (the stage with the fewest replicas); a joiner may replace it with
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
        lines.append("  # --auto takes the stage with the fewest replicas; --stages K picks one")
        if tokenizer_hash:
            lines.append(f"  # every member must use the tokenizer with hash {tokenizer_hash}")
    return lines


def _training_service(services: Iterable[object]):
    for svc in services:
        if getattr(svc, "join_flags", None) is not None:
            return svc
    return None


def join_lines_for_daemon(config, services: Iterable[object], maddrs: Sequence[str]) -> List[str]:
    """:func:`join_command_lines` from a daemon's ``DaemonConfig`` and its services (duck-typed)."""
    svc = _training_service(services)
    flags = list(getattr(svc, "join_flags", None) or [])
    data = getattr(getattr(svc, "config", None), "data", None)
    tok_hash = getattr(data, "tokenizer_hash", None) if flags else None
    key = getattr(config, "swarm_key_path", None)
    allow = getattr(config, "allow_peers_path", None)
    return join_command_lines(str(getattr(config, "run_id")), list(maddrs), flags,
                              swarm_key=str(key) if key else None, allow_peers=str(allow) if allow else None,
                              tokenizer_hash=tok_hash or None)
