"""``skippipe eval`` end to end through node.cli.main: JSON, table, --compare, error lines."""

import json

import pytest

from node.cli import main


def _run(capsys, *argv):
    rc = main(["eval", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_report_parses_and_full_row_comes_first(capsys, trained):
    _, run_dir = trained
    rc, out, err = _run(capsys, "--checkpoint", str(run_dir), "--keep-stages", "0,2,4", "--batches", "4", "--json")
    assert rc == 0, err
    report = json.loads(out)
    full, variant = report["rows"]
    assert full["kept"] == [0, 1, 2, 3, 4, 5] and full["kind"] == "full"
    assert variant["kept"] == [0, 2, 4] and variant["omitted"] == 3
    assert full["results"]["A"]["perplexity_change_pct"] == 0.0
    assert variant["results"]["A"]["loss"] != full["results"]["A"]["loss"]
    assert report["validation"]["batches"] == 4


def test_random_omission_with_compare(capsys, trained):
    _, run_dir = trained
    rc, out, err = _run(capsys, "--checkpoint", str(run_dir), "--compare", str(run_dir.parent), "--omit-fraction",
                        "0.5", "--trials", "3", "--seed", "1", "--batches", "2", "--json")
    assert rc == 0, err
    report = json.loads(out)
    assert [c["label"] for c in report["checkpoints"]] == ["A", "B"]
    assert len(report["rows"]) == 4 and report["omitted_stages"] == 3
    for row in report["rows"]:  # the same checkpoint twice: identical columns
        assert row["results"]["A"] == row["results"]["B"]
    assert set(report["mean"]) == {"A", "B"}


def test_table_output(capsys, trained):
    rc, out, err = _run(capsys, "--checkpoint", str(trained[1]), "--omit-fraction", "0.33", "--trials", "2",
                        "--batches", "2")
    assert rc == 0, err
    assert "0,1,2,3,4,5 (full)" in out and "mean of 2 subsets" in out and "A ppl" in out


@pytest.mark.parametrize("argv, needle", [
    ([], "--checkpoint"),
    (["--checkpoint", "/definitely/not/here"], "does not exist"),
    (["--keep-stages", "1,2"], "stage 0"),
    (["--keep-stages", "0,7"], "out of range"),
    (["--keep-stages", "0,a"], "integers"),
    (["--omit-fraction", "1.0"], "[0, 1)"),
    (["--omit-fraction", "-0.2"], "[0, 1)"),
    (["--omit-fraction", "half"], "number"),
    (["--omit-fraction", "0.5", "--keep-stages", "0,1"], "not both"),
    (["--trials", "3"], "--omit-fraction"),
    (["--branch-scale", "0"], "(0, 1]"),
    (["--branch-scale", "x"], "number"),
])
def test_user_errors_are_one_line(capsys, trained, argv, needle):
    if argv and argv[0] != "--checkpoint":
        argv = ["--checkpoint", str(trained[1])] + argv
    rc, out, err = _run(capsys, *argv)
    assert rc != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err
    assert "Traceback" not in err


def test_corrupt_checkpoint_is_one_line(capsys, tmp_path, trained):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(trained[1], copy)
    (copy / "stage1" / "path-trainer.pt").write_bytes(b"not a checkpoint")
    rc, _, err = _run(capsys, "--checkpoint", str(copy))
    assert rc != 0 and len(err.strip().splitlines()) == 1 and "corrupt" in err


def test_branch_scale_changes_the_full_model_and_is_reported(capsys, trained):
    rc, out, _ = _run(capsys, "--checkpoint", str(trained[1]), "--json", "--batches", "2")
    plain = json.loads(out)
    rc2, out2, _ = _run(capsys, "--checkpoint", str(trained[1]), "--json", "--batches", "2", "--branch-scale", "0.6")
    scaled = json.loads(out2)
    assert rc == rc2 == 0
    assert plain["branch_scale"] == 1.0 and scaled["branch_scale"] == 0.6
    assert scaled["rows"][0]["results"]["A"]["loss"] != plain["rows"][0]["results"]["A"]["loss"]
