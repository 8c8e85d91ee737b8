"""``skippipe plan`` / ``skippipe simulate`` end to end through the CLI dispatcher."""

import json
import os

import pytest

from node.cli import main

PROFILE = "/work/shared/profiles/geo-distributed-12.json"
if not os.path.exists(PROFILE):
    PROFILE = os.path.join(os.path.dirname(__file__), "scheduler", "data", "geo-distributed-12.json")

PLAN = ["plan", "--profile", PROFILE, "--nodes", "20", "--stage-sizes", "5,3,3,3,3,3", "--path-length", "4",
        "--microbatches", "6", "--samples", "8", "--layers-per-stage", "4", "--seed", "0", "--budget-s", "2"]


def test_plan_table_and_json_then_simulate(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(PLAN + ["--json", str(out)]) == 0
    text = capsys.readouterr().out
    for label in ("full pipeline (DT-FM)", "random skip", "SkipPipe without TC2", "SkipPipe / full ="):
        assert label in text
    doc = json.loads(out.read_text())
    assert doc["path_length"] == 4 and len(doc["stages"]) == 6
    sp = doc["results"]["variants"]["skippipe"]["iteration_time_s"]
    assert sp <= doc["results"]["variants"]["full_pipeline"]["iteration_time_s"]
    assert main(["simulate", str(out), "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)
    assert sim["iteration_time_s"] == pytest.approx(sp)


def test_plan_json_to_stdout(capsys):
    assert main(PLAN + ["--budget-s", "0.5", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["results"]["variants"]) == {"full_pipeline", "random_skip", "skippipe_no_tc2", "skippipe"}


def test_simulate_hand_written_and_invalid(tmp_path, capsys):
    good = {"stages": [[0], [1], [2]], "path_length": 2, "memory": 1,
            "paths": [{"data_node": 0, "route": [0, 1], "microbatches": 1}, {"data_node": 0, "route": [0, 2], "microbatches": 1}],
            "cost": {"compute_s": [1, 1, 1], "link_s": [[0, 2, 0], [3, 0, 0], [0, 0, 0]]}}
    f = tmp_path / "s.json"
    f.write_text(json.dumps(good))
    assert main(["simulate", str(f)]) == 0
    # [0,1]: 15.25 s (see the simulator tests); then [0,2] with free links: 1+1+.25+1.5+1.5
    assert "simulated iteration time: 20.50 s" in capsys.readouterr().out
    bad = dict(good, paths=[{"data_node": 0, "route": [0, 1], "microbatches": 3}, {"data_node": 0, "route": [0, 2], "microbatches": 1}])
    f.write_text(json.dumps(bad))
    assert main(["simulate", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: invalid schedule") and "stage-balance" in err and "Traceback" not in err


def test_user_errors_are_one_line(tmp_path, capsys):
    assert main(["plan", "--profile", str(tmp_path / "nope.json"), "--nodes", "4", "--stage-sizes", "2,2", "--path-length", "2"]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert main(PLAN[:3] + ["--nodes", "10"] + PLAN[5:]) == 2
    err = capsys.readouterr().err
    assert "need 20 nodes but there are only 10" in err and err.count("\n") == 1
    assert main(["simulate", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
