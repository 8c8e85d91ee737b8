"""Per-replica checkpoints: weights + optimizer state + the last committed iteration.

A checkpoint is written atomically (temp file in the same folder, fsync, ``os.replace``, fsync of
the folder), so a crash leaves either the old or the new file, never a torn one; a node saves every
K iterations and on clean shutdown, so a clean restart never loses a committed step.
Layout: ``<root>/<run_id>/stage<k>/<node_name>.pt``.
"""

from __future__ import annotations

import logging
import os
import pathlib
import tempfile
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

__all__ = ["Checkpoint", "CheckpointStore", "atomic_torch_save"]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1


@dataclass
class Checkpoint:
    iteration: int  # last committed (stepped) iteration
    stage: int
    state: Dict[str, Any]  # StageRuntime.state_dict()
    meta: Dict[str, Any]


def atomic_torch_save(obj: Any, path: pathlib.Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class CheckpointStore:
    """Where one replica keeps its latest checkpoint."""

    def __init__(self, root: os.PathLike, run_id: str, stage: int, node_name: str):
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in node_name)
        self.path = pathlib.Path(root) / run_id / f"stage{stage}" / f"{safe}.pt"
        self.stage = stage

    def save(self, iteration: int, state: Dict[str, Any], meta: Optional[Dict[str, Any]] = None) -> pathlib.Path:
        payload = {"format": FORMAT_VERSION, "iteration": iteration, "stage": self.stage, "state": state,
                   "meta": dict(meta or {})}
        atomic_torch_save(payload, self.path)
        logger.debug("checkpoint of stage %d at iteration %d -> %s", self.stage, iteration, self.path)
        return self.path

    def load(self) -> Optional[Checkpoint]:
        if not self.path.exists():
            return None
        payload = torch.load(self.path, map_location="cpu", weights_only=False)
        if payload.get("format") != FORMAT_VERSION or payload.get("stage") != self.stage:
            raise ValueError(f"{self.path}: not a stage-{self.stage} checkpoint of format {FORMAT_VERSION}")
        return Checkpoint(int(payload["iteration"]), int(payload["stage"]), payload["state"], payload["meta"])
