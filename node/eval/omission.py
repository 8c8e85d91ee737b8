"""Inference with layer omission: validation loss of a trained model with some stages left out.

Why: SkipPipe's claim is that a model trained with partial pipelines tolerates missing stages at
inference (the paper: perplexity +7% with half the model; the blog: robust to 50% node failure).
To check that on our own checkpoints we run stage 0 (embedding, its layers, the LM head; it can
never be left out) and a subset of the other stages in increasing order, as the reference's
``eval.py`` does, and report mean next-token loss and perplexity on the held-out split.

This module only knows about models: reading a checkpoint folder (swarm or single-process, same
layout), choosing kept-stage subsets, and evaluating one subset. Printing is the command's job
(:mod:`node.cli.eval_cmd`).
"""

from __future__ import annotations

import logging
import math
import pathlib
import random
import re
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from node.spec import BRANCH_SCALING_MODES
from node.train.branch_scaling import inference_branch_scale
from node.train.checkpoint import Checkpoint, CheckpointOldFormat, CheckpointStore
from node.train.data import DataConfig
from node.errors import UserError
from node.train.model import ModelConfig, StageModule
from node.train.reference import evaluate_loss

__all__ = [
    "LoadedModel",
    "OmissionResult",
    "find_run_dir",
    "load_checkpoint_dir",
    "load_checkpoint_dirs",
    "parse_stage_list",
    "check_kept_stages",
    "omitted_count",
    "random_kept_subsets",
    "evaluate_kept",
    "data_config_for",
    "perplexity",
]

logger = logging.getLogger(__name__)

_STAGE_DIR = re.compile(r"^stage(\d+)$")
#: Perplexities above this are reported as infinite instead of overflowing ``math.exp``.
MAX_LOG_PERPLEXITY = 700.0


@dataclass
class LoadedModel:
    """A checkpoint folder turned back into stage modules (one replica per stage)."""

    run_dir: pathlib.Path
    iteration: int  # last committed iteration (0-based), the same in every stage
    config: ModelConfig
    modules: List[StageModule]
    meta: Dict[str, Any]
    sources: List[pathlib.Path] = field(default_factory=list)  # the file used for each stage

    @property
    def n_stages(self) -> int:
        return self.config.n_stages

    @property
    def trainer(self) -> str:
        return str(self.meta.get("trainer", "swarm"))

    @property
    def branch_scaling(self) -> str:
        """How its stages' residual branches were scaled in training (``none`` for checkpoints that do not
        say: plain models), which decides how it runs with stages missing."""
        value = self.meta.get("branch_scaling", "none")
        return value if value in BRANCH_SCALING_MODES else "none"


@dataclass(frozen=True)
class OmissionResult:
    kept: Tuple[int, ...]  # stage 0 first, then the other kept stages in increasing order
    loss: float
    perplexity: float

    def omitted(self, n_stages: int) -> int:
        return n_stages - len(self.kept)


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < MAX_LOG_PERPLEXITY else math.inf


def _stage_dirs(path: pathlib.Path) -> Dict[int, pathlib.Path]:
    out = {}
    for child in path.iterdir():
        m = _STAGE_DIR.match(child.name)
        if m and child.is_dir():
            out[int(m.group(1))] = child
    return out


def find_run_dir(path: pathlib.Path) -> pathlib.Path:
    """``path`` itself if it holds ``stage<k>/`` folders, else its single run subfolder.

    Accepts both the run folder (``<root>/<run_id>``) and the checkpoint root above it, because
    ``skippipe up`` and the benchmarks print the root.
    """
    if not path.exists():
        raise UserError(f"checkpoint folder {path} does not exist")
    if not path.is_dir():
        raise UserError(f"checkpoint {path} is not a folder (pass the folder that holds stage0/, stage1/, ...)")
    if _stage_dirs(path):
        return path
    runs = sorted(c for c in path.iterdir() if c.is_dir() and _stage_dirs(c))
    if len(runs) == 1:
        return runs[0]
    if not runs:
        raise UserError(f"{path} holds no checkpoint (expected stage<k>/*.pt or <run>/stage<k>/*.pt)")
    raise UserError(f"{path} holds several runs ({', '.join(r.name for r in runs)}); pass one of them")


def _read(file: pathlib.Path, stage: int) -> Checkpoint:
    run_dir = file.parent.parent
    store = CheckpointStore(run_dir.parent, run_dir.name, stage, file.stem)
    try:
        ckpt = store.load()
    except CheckpointOldFormat:
        raise  # its one line names the converter
    except Exception as e:  # noqa: BLE001 - one line for whatever a torn or foreign file raises
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"corrupt or unreadable checkpoint {file}: {reason[:200]}") from None
    if ckpt is None or not isinstance(ckpt.state, dict) or "model" not in ckpt.state:
        raise UserError(f"corrupt checkpoint {file}: no model weights in it")
    return ckpt


def _pick_replica(stage: int, files: Sequence[pathlib.Path]) -> Tuple[pathlib.Path, Checkpoint]:
    """The replica with the latest iteration (ties: first file). Replicas of one stage hold the same
    weights after every averaged step, so any one of them is the stage."""
    if not files:
        raise UserError(f"no checkpoint file for stage {stage}")
    read = [(f, _read(f, stage)) for f in files]
    latest = max(c.iteration for _, c in read)
    best = next(fc for fc in read if fc[1].iteration == latest)
    same_step = {c.meta.get("checksum") for _, c in read if c.iteration == best[1].iteration}
    if len(same_step - {None}) > 1:
        logger.warning("replicas of stage %d differ at iteration %d; using %s", stage, best[1].iteration, best[0])
    return best


def load_checkpoint_dir(path: "str | pathlib.Path") -> LoadedModel:
    """Rebuild every stage module from a checkpoint folder; raises UserError on anything that
    does not add up (missing stage, mixed iterations, weights that do not fit the config)."""
    return load_checkpoint_dirs([path])


def load_checkpoint_dirs(paths: Sequence["str | pathlib.Path"]) -> LoadedModel:
    """Gather the stages of one model from several checkpoint folders (each node checkpoints only its
    own stage: pass every node's ``--checkpoint-dir``, or one folder holding all ``stage<k>/``)."""
    if not paths:
        raise UserError("no checkpoint folder given")
    run_dirs = []
    for p in paths:
        d = find_run_dir(pathlib.Path(p))
        if d not in run_dirs:
            run_dirs.append(d)
    files: Dict[int, List[pathlib.Path]] = {}
    folders: Dict[int, List[pathlib.Path]] = {}
    for d in run_dirs:
        for s, folder in sorted(_stage_dirs(d).items()):
            files.setdefault(s, []).extend(sorted(f for f in folder.glob("*.pt") if f.is_file()))
            folders.setdefault(s, []).append(folder)
    empty = [s for s, fs in files.items() if not fs]
    if empty:
        raise UserError(f"no checkpoint file in {', '.join(map(str, folders[empty[0]]))}")
    run_dir = run_dirs[0]
    label = run_dir if len(run_dirs) == 1 else f"{len(run_dirs)} folders ({', '.join(map(str, run_dirs))})"
    picked = {s: _pick_replica(s, fs) for s, fs in sorted(files.items()) if fs}
    if not picked:
        raise UserError(f"no checkpoint file in {label}")
    meta = picked[min(picked)][1].meta
    if not isinstance(meta, Mapping) or not isinstance(meta.get("model"), Mapping):
        raise UserError(f"checkpoint {label} does not record its model configuration (meta['model'])")
    run_ids = {str(c.meta.get("run_id")) for _, c in picked.values() if isinstance(c.meta, Mapping) and c.meta.get("run_id")}
    if len(run_ids) > 1:
        raise UserError(f"the checkpoints in {label} belong to different runs: {', '.join(sorted(run_ids))}")
    try:
        cfg = ModelConfig.from_dict(dict(meta["model"]))
    except (TypeError, ValueError) as e:
        raise UserError(f"checkpoint {label} has an invalid model configuration: {e}") from None
    missing = [s for s in range(cfg.n_stages) if s not in picked]
    extra = [s for s in picked if s >= cfg.n_stages]
    if missing or extra:
        raise UserError(f"checkpoint {label} is incomplete for a {cfg.n_stages}-stage model: "
                        f"missing stages {missing}" + (f", unexpected stages {extra}" if extra else "")
                        + ("" if not missing else "; pass every node's checkpoint folder"))
    iterations = {s: c.iteration for s, (_, c) in picked.items()}
    if len(set(iterations.values())) != 1:
        raise UserError(f"stage checkpoints in {label} are from different iterations: "
                        + ", ".join(f"stage {s} at {i}" for s, i in sorted(iterations.items())))
    modules = []
    for s in range(cfg.n_stages):
        file, ckpt = picked[s]
        module = StageModule(cfg, s)
        try:
            module.load_state_dict(ckpt.state["model"])
        except (RuntimeError, TypeError, KeyError) as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UserError(f"checkpoint {file} does not fit the recorded model configuration: {first[:200]}") from None
        module.eval()
        modules.append(module)
    return LoadedModel(run_dir, next(iter(iterations.values())), cfg, modules, dict(meta),
                       [picked[s][0] for s in range(cfg.n_stages)])


def parse_stage_list(text: str) -> Tuple[int, ...]:
    """``"0,2,4"`` -> ``(0, 2, 4)``; anything else is a UserError."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise UserError("--keep-stages needs a comma-separated list of stage indices, e.g. 0,2,4")
    try:
        return tuple(int(p) for p in parts)
    except ValueError:
        raise UserError(f"--keep-stages must be integers separated by commas, got {text!r}") from None


def check_kept_stages(stages: Sequence[int], n_stages: int) -> Tuple[int, ...]:
    """Validated kept stages in the order they run: stage 0, then the rest sorted."""
    bad = sorted({s for s in stages if not 0 <= s < n_stages})
    if bad:
        raise UserError(f"stage indices {bad} out of range: the model has stages 0..{n_stages - 1}")
    if len(set(stages)) != len(stages):
        raise UserError(f"stage listed twice in {list(stages)}")
    if 0 not in stages:
        raise UserError("stage 0 (embedding, LM head and loss) cannot be omitted; list it in --keep-stages")
    return (0,) + tuple(sorted(s for s in stages if s != 0))


def omitted_count(fraction: float, n_stages: int) -> int:
    """Stages to leave out for a fraction of the *whole* model (the paper's convention: with 6
    stages, 33% omits 2 and 50% omits 3), rounded half up, never stage 0."""
    if not (0.0 <= fraction < 1.0) or math.isnan(fraction):
        raise UserError(f"--omit-fraction must be in [0, 1), got {fraction}")
    return min(int(math.floor(fraction * n_stages + 0.5)), n_stages - 1)


def random_kept_subsets(n_stages: int, fraction: float, trials: int, seed: int) -> List[Tuple[int, ...]]:
    """``trials`` distinct random kept-stage sets (stage 0 always kept), deterministic in ``seed``.

    When fewer distinct subsets exist than ``trials``, all of them are returned once each.
    """
    if trials < 1:
        raise UserError(f"--trials must be at least 1, got {trials}")
    n_keep = n_stages - 1 - omitted_count(fraction, n_stages)  # among stages 1..S-1
    others = list(range(1, n_stages))
    total = math.comb(len(others), n_keep)
    if trials >= total:
        return [(0,) + c for c in combinations(others, n_keep)]
    rng = random.Random(seed)
    seen: List[Tuple[int, ...]] = []
    while len(seen) < trials:
        pick = (0,) + tuple(sorted(rng.sample(others, n_keep)))
        if pick not in seen:
            seen.append(pick)
    return seen


def evaluate_kept(modules: Sequence[StageModule], batches: Sequence[Tuple[torch.Tensor, torch.Tensor]],
                  kept: Sequence[int], branch_scaling: str = "none") -> OmissionResult:
    """Mean validation loss running stage 0, the kept stages in order, then stage 0's head; the kept stages
    scaled as a model trained under ``branch_scaling`` runs with stages missing (``LoadedModel.branch_scaling``)."""
    kept_t = check_kept_stages(kept, len(modules))
    scale = inference_branch_scale(branch_scaling, len(modules), len(kept_t))
    loss = evaluate_loss(modules, batches, order=kept_t[1:], branch_scale=scale)
    return OmissionResult(kept_t, loss, perplexity(loss))


def data_config_for(meta: Mapping[str, Any], model: ModelConfig, corpus: Optional[str] = None,
                    seq_len: Optional[int] = None, microbatch_size: Optional[int] = None,
                    tokenizer: Optional[str] = None) -> DataConfig:
    """The validation data a checkpoint was trained against, from its meta when recorded
    (single-process runs record it), else ``skippipe up``'s defaults; flags override both."""
    recorded = dict(meta.get("data")) if isinstance(meta.get("data"), Mapping) else {}
    defaults = DataConfig()
    if tokenizer is not None:  # the recorded hash stays: a different tokenizer is an error, not a surprise
        from node.train.tokenizer import parse_tokenizer_spec

        spec = parse_tokenizer_spec(tokenizer)
        recorded["tokenizer"] = spec.config_name
        if spec.kind == "bpe":
            recorded["bpe_vocab_size"] = spec.vocab_size
    cfg = DataConfig(
        corpus=corpus or str(recorded.get("corpus", defaults.corpus)),
        tokenizer=str(recorded.get("tokenizer", defaults.tokenizer)),
        bpe_vocab_size=int(recorded.get("bpe_vocab_size", defaults.bpe_vocab_size)),
        seq_len=int(seq_len or recorded.get("seq_len", model.context)),
        microbatch_size=int(microbatch_size or recorded.get("microbatch_size", defaults.microbatch_size)),
        val_fraction=float(recorded.get("val_fraction", defaults.val_fraction)),
        seed=int(recorded.get("seed", defaults.seed)),
        text_field=str(recorded.get("text_field", defaults.text_field)),
        tokenizer_hash=str(recorded.get("tokenizer_hash", "")),
    )
    if not 1 <= cfg.seq_len <= model.context:
        raise UserError(f"--seq-len must be in 1..{model.context} (the model's context), got {cfg.seq_len}")
    if cfg.microbatch_size < 1:
        raise UserError(f"--microbatch-size must be at least 1, got {cfg.microbatch_size}")
    return cfg
