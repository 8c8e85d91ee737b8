"""Nothing in the daemon, the protocol or the scheduler unpickles: every byte from outside the process
(a peer's answer, a checkpoint someone placed) is decoded by code that cannot run what it reads.

An AST scan, so a new call site fails here before review: ``torch.load`` must pass
``weights_only=True`` literally; ``pickle``/``dill``/``cloudpickle``/``joblib`` ``load``/``loads``/
``Unpickler`` and ``numpy.load(allow_pickle=True)`` are refused outright (bench/ may compare with
them, it is outside the scope)."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCOPE = ("node", "protocol", "scheduler")
PICKLERS = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}
LOADERS = {"load", "loads", "Unpickler", "open"}


def _name(node: ast.AST) -> str:
    """Dotted name of a call's target (``torch.load``, ``np.load``), '' if not a plain name chain."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _kw(call: ast.Call, name: str):
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return None


def violations(source: str, filename: str = "<src>") -> list:
    """``[(line, what)]`` of every unsafe load in ``source``."""
    tree = ast.parse(source, filename)
    aliases = {}  # local name -> module it stands for (import pickle as p; from pickle import loads)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            root = node.module.split(".")[0]
            for a in node.names:
                if root in PICKLERS and a.name in LOADERS:
                    aliases[a.asname or a.name] = f"{root}.{a.name}"
                elif root in ("torch", "numpy") and a.name == "load":
                    aliases[a.asname or a.name] = f"{root}.load"
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _name(node.func)
        head, _, rest = name.partition(".")
        full = aliases.get(head, head) + (f".{rest}" if rest else "")
        module, _, func = full.rpartition(".")
        if module.split(".")[0] in PICKLERS and func in LOADERS:
            found.append((node.lineno, f"{full}: unpickles"))
        elif full in ("torch.load", "torch.serialization.load"):
            wo = _kw(node, "weights_only")
            if not (isinstance(wo, ast.Constant) and wo.value is True):
                found.append((node.lineno, "torch.load without weights_only=True"))
        elif full in ("numpy.load", "np.load") or (module == "numpy" and func == "load"):
            ap = _kw(node, "allow_pickle")
            if ap is not None and not (isinstance(ap, ast.Constant) and ap.value is False):
                found.append((node.lineno, "numpy.load with allow_pickle"))
    return found


def _sources():
    for top in SCOPE:
        yield from sorted((ROOT / top).rglob("*.py"))


def test_no_unsafe_load_in_the_daemon_protocol_or_scheduler():
    bad = []
    for path in _sources():
        for line, what in violations(path.read_text(), str(path)):
            bad.append(f"{path.relative_to(ROOT)}:{line}: {what}")
    assert not bad, "loads that can run code on bytes from outside the process:\n" + "\n".join(bad)


@pytest.mark.parametrize("source", [
    "import torch\ntorch.load(f)",
    "import torch\ntorch.load(f, weights_only=False)",
    "import torch\ntorch.load(f, weights_only=flag)",
    "from torch import load\nload(f)",
    "import pickle\npickle.loads(b)",
    "import pickle as p\np.load(f)",
    "from pickle import loads as l\nl(b)",
    "import dill\ndill.loads(b)",
    "import cloudpickle\ncloudpickle.loads(b)",
    "import pickle\npickle.Unpickler(f).load()",
    "import numpy as np\nnp.load(f, allow_pickle=True)",
    "import numpy\nnumpy.load(f, allow_pickle=x)",
])
def test_the_scan_catches(source):
    assert violations(source), source


@pytest.mark.parametrize("source", [
    "import torch\ntorch.load(f, map_location='cpu', weights_only=True)",
    "import numpy as np\nnp.load(f)",
    "import numpy as np\nnp.load(f, allow_pickle=False)",
    "import json\njson.loads(s)",
    "import msgpack\nmsgpack.unpackb(b)",
])
def test_the_scan_passes_safe_loads(source):
    assert not violations(source), source
