"""``skippipe up`` end to end on a few iterations: outputs, resume, and clear errors."""

import json

import pytest

from node.cli import main
from dataclasses import replace

from node.cli.up_runners import UP_SPEC, UpOptions, run_up

pytestmark = pytest.mark.timeout(400)


async def test_up_writes_curve_summary_and_resumes(tmp_path):
    opts = UpOptions(replace(UP_SPEC, iterations=3, checkpoint_every=2), out=str(tmp_path), quiet=True, in_process=True)
    summary = await run_up(opts)
    assert summary["iterations"] == 3 and summary["nodes"] == 9
    assert (tmp_path / "loss.png").stat().st_size > 0
    assert json.loads((tmp_path / "summary.json").read_text())["final_loss"] == summary["final_loss"]
    assert summary["final_loss"] < summary["first_loss"]
    again = await run_up(UpOptions(replace(UP_SPEC, iterations=4, resume=True), out=str(tmp_path), quiet=True,
                                   in_process=True))
    assert again["resumed_from"] == 3
    history = json.loads((tmp_path / "history.json").read_text())
    assert [h["iteration"] for h in history] == [0, 1, 2, 3]


@pytest.mark.parametrize("argv, message", [
    (["up", "--replicas", "1,2"], "--replicas needs 5"),
    (["up", "--iterations", "0"], "--iterations must be at least 1"),
    (["up", "--model", "tiny", "--path-length", "9"], "path length must be in 1..6"),
    (["up", "--scheduler", "builtin"], "--scheduler builtin needs --in-process"),
    (["up", "--in-process", "--iterations", "0"], "--iterations must be at least 1"),
])
def test_up_rejects_bad_flags_with_one_line(argv, message, capsys, tmp_path):
    assert main(argv + ["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--iterations", "0"], "--iterations must be at least 1"),
    (["--min-members", "0"], "--min-members must be at least 1"),
])
def test_node_run_train_rejects_bad_flags_with_one_line(argv, message, capsys, tmp_path):
    base = ["node", "run", "--train", "--identity", str(tmp_path / "id.key"), "--rpc-port", "-1"]
    assert main(base + argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_fresh_up_run_measures_its_start_from_the_initial_weights_not_an_earlier_runs_checkpoints(tmp_path):
    """A second ``skippipe up`` into the same --out without --resume trains from scratch, so its
    "validation loss before" must be that of the initial weights, not of the checkpoints the first
    run left there (found by running the README command twice: 2.5515 -> 2.5574 was printed)."""
    import torch

    from node.train.checkpoint import CheckpointStore
    from node.cli.up_runners import RUN_ID, _stage_modules_from_checkpoints
    from node.train.model import build_stage, model_config
    from node.train.runtime import OptimConfig, StageRuntime

    mcfg = model_config("tiny")
    names = {k: f"node{k}" for k in range(mcfg.n_stages)}
    for k in range(mcfg.n_stages):
        trained = StageRuntime(build_stage(mcfg, k, 0), OptimConfig())
        with torch.no_grad():
            for p in trained.module.parameters():
                p.add_(1.0)
        CheckpointStore(tmp_path, RUN_ID, k, names[k]).save(39, trained.state_dict())
    fresh, fresh_iters = _stage_modules_from_checkpoints(None, mcfg, 0, names)
    resumed, resumed_iters = _stage_modules_from_checkpoints(tmp_path, mcfg, 0, names)
    assert fresh_iters == [-1] * mcfg.n_stages and resumed_iters == [39] * mcfg.n_stages
    for k in range(mcfg.n_stages):
        initial = build_stage(mcfg, k, 0)
        for p, q, r in zip(fresh[k].parameters(), initial.parameters(), resumed[k].parameters()):
            assert torch.equal(p, q)
            assert torch.allclose(r, q + 1.0)
