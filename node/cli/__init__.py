"""The ``skippipe`` command line.

Each subcommand lives in its own module under :mod:`node.cli` and exposes
``register(subparsers)``; the handler it sets with ``set_defaults(func=...)`` takes the parsed
arguments and returns an exit code. A :class:`node.errors.UserError` raised anywhere becomes one
``error:`` line and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import re
import importlib
import sys
from typing import Sequence

from node import __version__
from node.errors import UserError
from node.ops.memory import tune_malloc

__all__ = ["main", "build_parser"]

#: Modules that contribute subcommands, in the order they appear in ``--help``.
COMMAND_MODULES = (
    "node.cli.up",
    "node.cli.node_cmd",
    "node.cli.swarm_cmd",
    "node.cli.plan",
    "node.cli.eval_cmd",
    "node.cli.generate_cmd",
    "node.cli.export_cmd",
    "node.cli.checkpoint_cmd",
)

DESCRIPTION = """\
SkipPipe Swarm: pool donated GPUs (or CPUs) into a peer-to-peer swarm that trains a language
model with skip-aware pipeline parallelism. Stage 0 (embedding, LM head, loss, data) runs on data
nodes; every other stage on several replicas; each microbatch takes its own path through a
subset of the stages, chosen by a collision-aware scheduler.

quick start:
  skippipe up                                   train a tiny model on a local swarm
  skippipe node run --new-swarm --stages 0      start a swarm of your own
  skippipe node run --initial-peers MADDR --auto   join a swarm
  skippipe swarm status --rpc http://127.0.0.1:PORT
  skippipe plan --profile geo-distributed-12 --nodes 20 --stage-sizes 5,3,3,3,3,3 --path-length 4
  skippipe export --from CKPT_DIR... --out hf-model   Hugging Face transformers Llama checkpoint
  skippipe generate --checkpoint CKPT_DIR... --prompt "To be"
"""


class _Parser(argparse.ArgumentParser):
    """argparse with one ``error: ...`` line (and exit 2) for a bad flag, like every other user error."""

    def error(self, message: str):  # noqa: D102
        # "argument --x: must be at least 1, got '0'" reads better as "--x must be at least 1, got '0'"
        message = re.sub(r"^argument (-[-\w]+)(?:/-[-\w]+)*: must ", r"\1 must ", " ".join(str(message).split()))
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="skippipe", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"skippipe-swarm {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # command not built yet
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, or a bad flag (one error: line already printed)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    tune_malloc()  # every command that moves activation frames benefits; see node.ops.memory
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 0 if args.command is None else 2
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
