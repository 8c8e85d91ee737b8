"""Every `skippipe ...` line of README.md parses, and each one that takes under a minute runs as written.

Daemons and training swarms (`up`, `node run`, `swarm ...`) only parse here (they run for minutes and are
covered by their own tests); `--help`, `plan`, `simulate`, `eval`, `generate`, `export` and `checkpoint` run for real, in
a scratch folder holding a tiny `skippipe-up/checkpoints` the way `skippipe up` leaves it.
"""

from __future__ import annotations

import pathlib
import re
import shlex

import pytest

from node.cli import build_parser, main

from tests.userdata.helpers import save_node_checkpoints

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
#: subcommands that finish in seconds on the tiny model and are run as written
QUICK = ("plan", "simulate", "eval", "generate", "export", "checkpoint")
#: long-running ones: parsed only
LONG = ("up", "node", "swarm")


def readme_commands() -> list[list[str]]:
    text = README.read_text(encoding="utf-8")
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            line = line.strip()
            if line.startswith("skippipe "):
                commands.append(shlex.split(line, comments=True)[1:])
    return commands


def test_readme_lists_the_commands():
    names = {c[0] for c in readme_commands()}
    assert {"--help", "up", "node", "plan", "simulate", "eval", "generate", "export"} <= names
    assert all(c[0] in QUICK + LONG + ("--help",) for c in readme_commands())


@pytest.mark.parametrize("argv", [c for c in readme_commands() if c[0] in LONG], ids=lambda c: " ".join(c)[:60])
def test_long_readme_commands_parse(argv):
    args = build_parser().parse_args(argv)
    assert getattr(args, "func", None) is not None


def _exit_code(argv) -> int:
    """What ``skippipe ARGV`` exits with (``--help`` may return 0 or raise SystemExit(0))."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def test_quick_readme_commands_run_as_written(tmp_path, monkeypatch, capsys):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model: one thread is 10x faster than two contended ones on a busy CI box
    monkeypatch.chdir(tmp_path)
    save_node_checkpoints(tmp_path / "skippipe-up" / "checkpoints", run_id="up", one_root=True)
    try:
        for argv in readme_commands():
            if argv[0] == "--help":
                assert _exit_code(argv) == 0
            elif argv[0] in QUICK:
                assert main(argv) == 0, argv
                assert _exit_code([argv[0], "--help"]) == 0  # and each has a --help
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "SkipPipe" in out and "ROMEO:" in out
    assert (tmp_path / "schedule.json").is_file() and (tmp_path / "hf-model" / "model.safetensors").is_file()
