"""bench/tune.py: the same grid for both variants, the mapping of a setting to the convergence bench's
treatments, and the ranking that picks each variant's best setting over every seed."""

import pytest

from tests.eval.benches import load_bench


@pytest.fixture(scope="module")
def tune():
    return load_bench("tune")


def _row(tune, variant, lr, warmup, branch, seed, last5, final):
    s = tune.Setting(variant, lr, warmup, branch, seed)
    return {"setting": s.__dict__, "key": s.key(), "last5": last5, "final": final}


def test_both_variants_get_the_same_number_of_settings_at_every_seed(tune):
    settings = tune.grid([1e-3, 3e-3], [0, 20], [0, 1])
    for seed in (0, 1):
        full = [s for s in settings if s.variant == "full" and s.seed == seed]
        skip = [s for s in settings if s.variant == "skip" and s.seed == seed]
        assert len(full) == len(skip) == 2 * 2 * 2
    assert len({s.key() for s in settings}) == len(settings)


def test_best_setting_is_the_lowest_mean_over_all_seeds_and_incomplete_ones_are_left_out(tune):
    rows = [
        _row(tune, "full", 3e-3, 0, "1", 0, 1.50, 1.45), _row(tune, "full", 3e-3, 0, "1", 1, 1.70, 1.65),   # mean 1.60
        _row(tune, "full", 6e-3, 0, "1", 0, 1.58, 1.50), _row(tune, "full", 6e-3, 0, "1", 1, 1.58, 1.55),   # mean 1.58
        _row(tune, "full", 1e-3, 0, "1", 0, 1.00, 1.00),  # best at seed 0, but never run at seed 1
        _row(tune, "skip", 3e-3, 0, "inverse", 0, 1.58 * 1.05, 1.5), _row(tune, "skip", 3e-3, 0, "inverse", 1, 1.58 * 1.03, 1.6),
    ]
    summary = tune.summarise(rows, [0, 1])
    assert [g["setting"] for g in summary["full"]] == ["lr=0.006 warmup=0 branch=1", "lr=0.003 warmup=0 branch=1"]
    best = summary["best"]
    assert best["full"] == "lr=0.006 warmup=0 branch=1" and best["skip"] == "lr=0.003 warmup=0 branch=inverse"
    assert best["gap_pct_last5"][0] == pytest.approx(5.0) and best["gap_pct_last5"][1] == pytest.approx(3.0)
    assert best["mean_gap_pct_last5"] == pytest.approx(4.0) and best["spread_pct_last5"] == pytest.approx(2.0)


def test_a_setting_maps_onto_the_convergence_bench_treatments(tune, monkeypatch):
    import bench.convergence as cv  # the module tune's worker imports

    seen = []

    def fake_train_run(name, schedule, cfg, data, splits, checkpoints, log=print, full_schedule=None):
        seen.append((name, cfg, schedule))
        out = cv.RunResult(name)
        out.iterations, out.val_loss = [0, 1, 2, 3, 4, 5], [5.0, 4.0, 3.0, 2.0, 1.0, 0.5]
        return out

    monkeypatch.setattr(cv, "train_run", fake_train_run)
    monkeypatch.setattr(cv, "skip_schedule", lambda n, seed: {"paths": "skip"})
    monkeypatch.setattr("node.eval.path_training.stage_routes", lambda schedule: {0: [(1, 2, 3), (4, 5, 1)]})
    monkeypatch.setattr("node.train.data.load_splits", lambda data: None)
    r = tune._run(tune.Setting("skip", 3e-3, 20, "inverse+stage-lr", 1), 5, 1, "/tmp/unused")
    name, cfg, schedule = seen[-1]
    assert (name, cfg.lr, cfg.warmup_iterations, cfg.seed) == ("skip", 3e-3, 20, 1)
    assert (cfg.train_branch_scale, cfg.stage_lr, cfg.full_branch_scale) == ("inverse", "inverse-visit", 1.0)
    assert schedule == {"paths": "skip"}
    assert r["final"] == 0.5 and r["last5"] == pytest.approx((4.0 + 3.0 + 2.0 + 1.0 + 0.5) / 5)
    tune._run(tune.Setting("full", 3e-3, 0, "inverse-control", 0), 5, 1, "/tmp/unused")
    name, cfg, schedule = seen[-1]
    # the control scales the full pipeline's branches by 1/p, p the skip routes' smallest visit share of a
    # stage after 0: two routes, stages 2-5 on one each, so p = 0.5 and the scale 2.0
    assert name == "full" and cfg.train_branch_scale == "none" and cfg.full_branch_scale == pytest.approx(2.0)
    assert len(schedule["paths"]) == cv.DATA_NODES


def test_unknown_treatments_are_one_error_line(tune):
    with pytest.raises(SystemExit, match="unknown branch treatment"):
        tune.main(["--skip-branches", "inverse+lr-warmup", "--summary-only"])
