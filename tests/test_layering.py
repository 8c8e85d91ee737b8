"""Imports go one way, checked on the source so a stray import fails CI.

Across the top level: protocol <- scheduler <- node. Inside ``node/`` the subpackages form layers too (each may
import only the ones listed for it, plus the shared ``node.errors``/``node.compat``), so a newcomer can read
the architecture from the folder names: the network, then the data plane on it, then training, then the
swarm that composes them, then the harnesses and the command line that drive everything.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
OURS = {"protocol", "scheduler", "node"}
ALLOWED = {"protocol": set(), "scheduler": {"protocol"}, "node": {"protocol", "scheduler"}}
#: scheduler/ is pure: no network, torch or process control.
FORBIDDEN_IN_SCHEDULER = {"torch", "hivemind", "libp2p", "socket", "asyncio", "subprocess", "trio"}

#: node's subpackages and what each may import from node (besides itself and the shared top-level modules).
NODE_LAYERS = {
    "net": set(),
    "dataplane": {"net"},
    "train": {"net", "dataplane"},
    "eval": {"train"},
    "ops": set(),
    "swarm": {"net", "dataplane", "ops"},
    "testing": {"net", "dataplane", "train", "eval", "ops", "swarm"},
    "cli": {"net", "dataplane", "train", "eval", "ops", "swarm", "testing"},
}
#: modules directly in node/ that every subpackage may use: they import nothing of node's subpackages
#: (``spec``: the training flags a run shares, read by the command line and the daemon's join banner).
NODE_SHARED = {"errors", "compat", "spec", "__init__"}


def _imported_modules(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            if node.module == "node":  # from node import x: a submodule or a name of node/__init__.py
                names.update(f"node.{alias.name}" if not alias.name.startswith("__") else "node"
                             for alias in node.names)
    return names


def _imports(path: pathlib.Path) -> set[str]:
    return {name.split(".")[0] for name in _imported_modules(path)}


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


def _node_part(module: str) -> str:
    """``node.train.model`` -> ``train``; ``node.errors`` -> ``errors``; ``node`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_node_has_only_known_subpackages_and_shared_modules():
    found = {p.name for p in (ROOT / "node").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert found == set(NODE_LAYERS), f"node/ subpackages {sorted(found)} != layers {sorted(NODE_LAYERS)}"
    top = {p.stem for p in (ROOT / "node").glob("*.py")}
    assert top <= NODE_SHARED | {"__main__"}, f"modules directly in node/ beyond the shared ones: {sorted(top - NODE_SHARED)}"


@pytest.mark.parametrize("layer", sorted(NODE_LAYERS))
def test_node_subpackages_import_one_way(layer):
    for path in sorted((ROOT / "node" / layer).rglob("*.py")):
        parts = {_node_part(m) for m in _imported_modules(path) if m == "node" or m.startswith("node.")}
        bad = parts - NODE_LAYERS[layer] - NODE_SHARED - {layer}
        assert not bad, f"{path.relative_to(ROOT)} imports node.{sorted(bad)} (allowed: {sorted(NODE_LAYERS[layer])})"


def test_shared_node_modules_import_no_subpackage():
    for name in NODE_SHARED - {"__init__"}:
        path = ROOT / "node" / f"{name}.py"
        parts = {_node_part(m) for m in _imported_modules(path) if m.startswith("node.")}
        assert parts <= NODE_SHARED, f"node/{name}.py imports node.{sorted(parts - NODE_SHARED)}"


#: a newcomer reads a module in one sitting and a class as one job; past these a split is due
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 400


def test_node_modules_and_classes_stay_small():
    too_big = []
    for path in sorted((ROOT / "node").rglob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            too_big.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                too_big.append(f"{path.relative_to(ROOT)}: class {node.name} {node.end_lineno - node.lineno + 1} lines")
    assert not too_big, too_big
