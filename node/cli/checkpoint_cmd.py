"""``skippipe checkpoint convert PATH...``: rewrite checkpoints of the old pickle formats in format 3.

Checkpoints written by earlier versions (formats 1 and 2) are pickles; this version refuses to load
them, because unpickling runs whatever code a file names. The converter reads them with torch's
restricted loader (``weights_only=True``: tensors and plain containers, nothing executable) and
rewrites each file in place as format 3 (safetensors + a JSON manifest, with its content hash). A
folder is searched for ``*.pt`` files. Convert only files you trust to hold a checkpoint of yours:
the restricted loader runs no code, but the weights are whatever the file holds.
"""

from __future__ import annotations

import argparse
import pathlib
from typing import List

__all__ = ["register"]


def _files(paths: List[str]) -> List[pathlib.Path]:
    from node.errors import UserError

    out: List[pathlib.Path] = []
    for raw in paths:
        path = pathlib.Path(raw).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*.pt") if p.is_file())
            if not found:
                raise UserError(f"{path} holds no *.pt checkpoint file")
            out.extend(found)
        elif path.is_file():
            out.append(path)
        else:
            raise UserError(f"checkpoint {path} does not exist")
    return out


def _convert(args: argparse.Namespace) -> int:
    from node.train.checkpoint import convert_checkpoint

    for path in _files(args.paths):
        # CheckpointCorrupt: one line naming the file
        print(f"converted {path}" if convert_checkpoint(path) else f"already in the current format: {path}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("checkpoint", help="maintain checkpoint files (convert old formats)")
    sub = p.add_subparsers(dest="checkpoint_command", metavar="ACTION")
    convert = sub.add_parser(
        "convert", help="rewrite old pickle checkpoints (formats 1 and 2) in the current format, in place",
        description="Read checkpoints of the old pickle formats with torch's restricted loader (no code runs) and "
                    "rewrite them as format 3 (safetensors + manifest + content hash). Files already in format 3 "
                    "are checked and left alone.")
    convert.add_argument("paths", nargs="+", metavar="PATH", help="checkpoint files, or folders searched for *.pt")
    convert.set_defaults(func=_convert)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
