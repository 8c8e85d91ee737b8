"""Stage omission: loading checkpoint folders, kept-stage subsets, evaluation."""

import pytest
import torch

from node.train.checkpoint import CheckpointStore
from node.train.data import validation_batches
from node.errors import UserError
from node.eval.omission import (check_kept_stages, evaluate_kept, load_checkpoint_dir, omitted_count,
                           random_kept_subsets)
from node.train.reference import evaluate_loss
from node.train.runtime import OptimConfig, StageRuntime


@pytest.fixture(scope="module")
def val(splits, data_cfg):
    return validation_batches(splits, data_cfg, 8)


def test_all_stages_kept_equals_full_model(trained, val):
    trainer, run_dir = trained
    loaded = load_checkpoint_dir(run_dir)
    assert loaded.iteration == trainer.iteration - 1 and loaded.trainer == "path-training"
    full = evaluate_kept(loaded.modules, val, range(6))
    assert full.kept == (0, 1, 2, 3, 4, 5)
    assert full.loss == evaluate_loss(trainer.modules(), val)  # same weights, same arithmetic


def test_checkpoint_root_with_one_run_is_accepted(trained):
    _, run_dir = trained
    assert load_checkpoint_dir(run_dir.parent).run_dir == run_dir


def test_omitting_stages_changes_the_loss(trained, val):
    loaded = load_checkpoint_dir(trained[1])
    full = evaluate_kept(loaded.modules, val, range(6))
    half = evaluate_kept(loaded.modules, val, [0, 2, 4])
    assert half.kept == (0, 2, 4)
    assert abs(half.loss - full.loss) > 1e-4


def test_kept_stages_run_sorted_with_stage_zero_first():
    assert check_kept_stages([4, 0, 2], 6) == (0, 2, 4)
    for bad in ([1, 2], [0, 6], [0, -1], [0, 2, 2]):
        with pytest.raises(UserError):
            check_kept_stages(bad, 6)


def test_omitted_count_follows_the_paper():
    assert omitted_count(0.0, 6) == 0
    assert omitted_count(0.33, 6) == 2 and omitted_count(0.5, 6) == 3  # 6 stages: 33% and 50%
    assert omitted_count(0.25, 4) == 1 and omitted_count(0.5, 4) == 2  # 4 stages: 25% and 50%
    assert omitted_count(0.99, 6) == 5  # never stage 0
    for bad in (-0.1, 1.0, float("nan")):
        with pytest.raises(UserError):
            omitted_count(bad, 6)


def test_random_subsets_are_seeded_distinct_and_valid():
    a = random_kept_subsets(6, 0.5, trials=4, seed=3)
    assert a == random_kept_subsets(6, 0.5, trials=4, seed=3)
    assert len(set(a)) == 4
    assert all(s[0] == 0 and len(s) == 3 and list(s[1:]) == sorted(s[1:]) for s in a)
    assert len(random_kept_subsets(6, 0.5, trials=100, seed=0)) == 10  # C(5, 2): all of them, once


def _write_swarm_checkpoint(root, trainer, iteration_of=lambda s: 7, replicas=2, **extra_meta):
    """What TrainerNode.save_checkpoint writes: StageRuntime state + trainer meta (no data config)."""
    for s, module in enumerate(trainer.modules()):
        runtime = StageRuntime(module, OptimConfig())
        meta = {"run_id": "swarm", "epoch": 0, "model": trainer.model_cfg.to_dict(), "peer_id": f"peer{s}",
                "checksum": runtime.checksum(), **extra_meta}
        for r in range(replicas if s else 1):
            CheckpointStore(root, "swarm", s, f"node{s}-{r}").save(iteration_of(s), runtime.state_dict(), meta)
    return root / "swarm"


def test_reads_swarm_checkpoints_with_replicas(tmp_path, trained, val):
    trainer, _ = trained
    run_dir = _write_swarm_checkpoint(tmp_path, trainer)
    loaded = load_checkpoint_dir(run_dir)
    assert loaded.iteration == 7 and loaded.trainer == "swarm"
    assert evaluate_kept(loaded.modules, val, range(6)).loss == evaluate_loss(trainer.modules(), val)


def test_an_inverse_trained_model_runs_its_kept_stages_at_the_missing_ones_share(tmp_path, trained, val):
    trainer, _ = trained
    loaded = load_checkpoint_dir(_write_swarm_checkpoint(tmp_path / "inv", trainer, branch_scaling="inverse"))
    plain = load_checkpoint_dir(_write_swarm_checkpoint(tmp_path / "plain", trainer))
    assert (loaded.branch_scaling, plain.branch_scaling) == ("inverse", "none")  # no key: a plain model
    # full depth: the plain model either way; 3 of 6 kept: stages 2 and 4 scaled by (6 - 1) / (3 - 1)
    assert evaluate_kept(loaded.modules, val, range(6), "inverse").loss == evaluate_kept(plain.modules, val, range(6)).loss
    half = evaluate_kept(loaded.modules, val, [0, 2, 4], loaded.branch_scaling).loss
    assert half == evaluate_loss(trainer.modules(), val, order=[2, 4], branch_scale=2.5)
    assert abs(half - evaluate_kept(plain.modules, val, [0, 2, 4]).loss) > 1e-4
    assert {m.branch_scale for m in loaded.modules} == {1.0}  # evaluation leaves the modules plain


def test_broken_checkpoint_folders_are_user_errors(tmp_path, trained):
    trainer, _ = trained
    with pytest.raises(UserError, match="does not exist"):
        load_checkpoint_dir(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no checkpoint"):
        load_checkpoint_dir(tmp_path / "empty")
    mixed = _write_swarm_checkpoint(tmp_path / "mixed", trainer, iteration_of=lambda s: 7 + (s == 3), replicas=1)
    with pytest.raises(UserError, match="different iterations"):
        load_checkpoint_dir(mixed)
    gap = _write_swarm_checkpoint(tmp_path / "gap", trainer, replicas=1)
    for f in (gap / "stage4").iterdir():
        f.unlink()
    with pytest.raises(UserError, match="no checkpoint file"):
        load_checkpoint_dir(gap)
    (gap / "stage4").rmdir()
    with pytest.raises(UserError, match="missing stages \\[4\\]"):
        load_checkpoint_dir(gap)
    torn = _write_swarm_checkpoint(tmp_path / "torn", trainer, replicas=1)
    path = next((torn / "stage2").iterdir())
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(UserError, match="corrupt"):
        load_checkpoint_dir(torn)


def test_omission_bench_compares_any_named_checkpoints(tmp_path, trained):
    """bench/omission.py --models: the table for the named folders (here one model under two names, so the
    two columns must agree to the last digit), and a bad pair is one error line."""
    import json

    from tests.eval.benches import load_bench

    bench = load_bench("omission")
    run_dir = trained[1]
    assert bench.main(["--models", f"a={run_dir},b={run_dir}", "--batches", "2", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "omission.json").read_text())["rows"]
    assert [r["kept"] for r in rows] == [6, 5, 4, 3]
    for r in rows:
        assert set(r["models"]) == {"a", "b"} and r["models"]["a"] == r["models"]["b"]
    assert rows[-1]["models"]["a"]["mean_change_pct"] != 0.0
    with pytest.raises(SystemExit, match="^error: --models"):
        bench.main(["--models", f"a={tmp_path / 'nothing'}", "--out", str(tmp_path)])
