"""Imports go one way: protocol <- scheduler <- node. Checked on the source, so a stray import fails CI."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
OURS = {"protocol", "scheduler", "node"}
ALLOWED = {"protocol": set(), "scheduler": {"protocol"}, "node": {"protocol", "scheduler"}}
#: scheduler/ is pure: no network, torch or process control.
FORBIDDEN_IN_SCHEDULER = {"torch", "hivemind", "libp2p", "socket", "asyncio", "subprocess", "trio"}


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_lower_layers(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"{package}/ has no modules"
    for path in files:
        ours = (_imports(path) & OURS) - {package}
        bad = ours - ALLOWED[package]
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"
        if package == "scheduler":
            impure = _imports(path) & FORBIDDEN_IN_SCHEDULER
            assert not impure, f"{path.relative_to(ROOT)} imports {sorted(impure)}"
