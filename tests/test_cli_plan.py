"""``skippipe plan`` / ``skippipe simulate`` end to end through the CLI dispatcher."""

import json
import os

import pytest

from node.cli import main

PROFILE = "/work/shared/profiles/geo-distributed-12.json"
if not os.path.exists(PROFILE):
    PROFILE = os.path.join(os.path.dirname(__file__), "scheduler", "data", "geo-distributed-12.json")

PLAN = ["plan", "--profile", PROFILE, "--nodes", "20", "--stage-sizes", "5,3,3,3,3,3", "--path-length", "4",
        "--microbatches", "6", "--samples", "8", "--layers-per-stage", "4", "--seed", "0"]


def _plan_json(capsys, *extra) -> dict:
    assert main(PLAN + list(extra) + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_table_and_json_then_simulate(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(PLAN + ["--json", str(out)]) == 0
    text = capsys.readouterr().out
    for label in ("full pipeline (DT-FM)", "random skip", "SkipPipe without TC2", "SkipPipe / full =",
                  "lower bound on any skipping schedule:", "work: allocation 120/120 generations, path search 1500/1500"):
        assert label in text
    assert "warning" not in text
    doc = json.loads(out.read_text())
    assert doc["path_length"] == 4 and len(doc["stages"]) == 6
    sp = doc["results"]["variants"]["skippipe"]["iteration_time_s"]
    assert sp <= doc["results"]["variants"]["full_pipeline"]["iteration_time_s"]
    assert main(["simulate", str(out), "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)
    assert sim["iteration_time_s"] == pytest.approx(sp)


def test_plan_json_to_stdout_with_bound_and_gap(capsys):
    doc = _plan_json(capsys)
    res = doc["results"]
    assert set(res["variants"]) == {"full_pipeline", "random_skip", "skippipe_no_tc2", "skippipe"}
    bound = res["lower_bound"]["value_s"]
    assert bound > 0 and res["lower_bound"]["argument"] in ("round-trips", "data-node-work", "stage-work")
    for name in ("random_skip", "skippipe_no_tc2", "skippipe"):
        t = res["variants"][name]["iteration_time_s"]
        assert bound <= t and res["variants"][name]["gap_to_bound"] == pytest.approx(t / bound - 1)
    assert res["gap_to_bound"] == res["variants"]["skippipe"]["gap_to_bound"]
    spread = res["predicted_spread"]  # the plan judged under perturbed costs and shared links
    assert spread["scenarios"] >= 2 and spread["p10_s"] <= spread["p90_s"]
    assert spread["nominal_s"] == pytest.approx(res["variants"]["skippipe"]["iteration_time_s"])
    assert res["wall_cap"] == {"cap_s": 300.0, "hit": False, "hit_in": []}
    assert res["work"]["path_iterations"] == res["work"]["path_iteration_budget"] == 1500


def test_plan_is_deterministic_whatever_the_cap(tmp_path, capsys):
    # the searches are bounded by work: the same inputs and seed give byte-identical JSON, and a
    # far larger cap changes nothing but the cap it records
    files = [tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"]
    assert main(PLAN + ["--json", str(files[0])]) == 0
    assert main(PLAN + ["--json", str(files[1])]) == 0
    assert main(PLAN + ["--json", str(files[2]), "--budget-s", "100000"]) == 0
    assert "scheduler wall time:" in capsys.readouterr().out  # wall times are printed, not in the JSON
    assert files[0].read_bytes() == files[1].read_bytes()
    generous = files[2].read_text().replace('"cap_s": 100000.0', '"cap_s": 300.0')
    assert generous == files[0].read_text()
    assert _plan_json(capsys, "--seed", "1")["paths"] != json.loads(files[0].read_text())["paths"]  # the seed matters


def test_plan_json_to_stdout_keeps_the_wall_time_on_stderr(capsys):
    assert main(PLAN + ["--json"]) == 0
    out, err = capsys.readouterr()
    json.loads(out)
    assert err.startswith("scheduler wall time:")


def test_plan_reports_a_wall_cap_that_was_hit(capsys):
    assert main(PLAN + ["--budget-s", "1e-9"]) == 0
    text = capsys.readouterr().out
    assert "warning: the wall-clock cap of 1e-09 s stopped the allocation and the path search" in text
    assert "depends on machine speed" in text
    res = _plan_json(capsys, "--budget-s", "1e-9")["results"]
    assert res["wall_cap"] == {"cap_s": 1e-9, "hit": True, "hit_in": ["allocation", "path search"]}
    assert res["work"]["allocation_generations"] < res["work"]["allocation_generation_budget"]
    assert res["work"]["path_iterations"] < res["work"]["path_iteration_budget"]


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
