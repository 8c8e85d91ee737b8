"""The ``skippipe`` entry point: version, help, and user errors without tracebacks."""

import subprocess
import sys

from node import __version__
from node.cli import main


def test_version_flag(capsys):
    try:
        main(["--version"])
    except SystemExit as e:
        assert e.code == 0
    assert __version__ in capsys.readouterr().out


def test_help_lists_commands():
    out = subprocess.run([sys.executable, "-m", "node", "--help"], capture_output=True, text=True, check=True).stdout
    assert "skippipe" in out and "quick start" in out


def test_unknown_command_is_a_usage_error():
    proc = subprocess.run([sys.executable, "-m", "node", "no-such-command"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
