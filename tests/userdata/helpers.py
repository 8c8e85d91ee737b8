"""Helpers of the user-data tests: a tiny checkpoint saved the way swarm nodes save theirs."""

from __future__ import annotations

import pathlib
from dataclasses import asdict
from typing import List, Optional

import torch

from node.train.checkpoint import CheckpointStore
from node.train.data import DataConfig
from node.train.model import ModelConfig, build_stage, model_config


def save_node_checkpoints(root: pathlib.Path, cfg: Optional[ModelConfig] = None, data: Optional[DataConfig] = None,
                          iteration: int = 4, run_id: str = "run1", seed: int = 3,
                          one_root: bool = False) -> List[pathlib.Path]:
    """One ``--checkpoint-dir`` per stage (as if each stage ran on its own node), or every stage under
    ``root`` when ``one_root`` (as ``skippipe up`` leaves them); the norms are randomised so that an
    export which drops or misplaces them cannot pass."""
    cfg = cfg or model_config("tiny")
    data = data or DataConfig()
    g = torch.Generator().manual_seed(seed)
    dirs = []
    for s in range(cfg.n_stages):
        module = build_stage(cfg, s, seed)
        with torch.no_grad():
            for name, p in module.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
        node_dir = root if one_root else root / f"node{s}"
        CheckpointStore(node_dir, run_id, s, f"peer{s}").save(
            iteration, {"model": module.state_dict()},
            {"run_id": run_id, "model": cfg.to_dict(), "data": asdict(data), "checksum": f"c{s}"})
        if node_dir not in dirs:
            dirs.append(node_dir)
    return dirs
