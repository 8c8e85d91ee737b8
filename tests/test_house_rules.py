"""House rules a reader relies on, checked on the source so a regression fails CI.

- **No import cycle** inside ``node/``, ``scheduler/`` or ``protocol/``: a reader can then start at any file and
  reach the bottom without coming back. Every import counts, wherever it stands: at module level, under
  ``if TYPE_CHECKING:`` and inside a function. A function-local import only defers a dependency to run time;
  the two files still need each other, so it closes a cycle just as a top-level one does. Importing a
  package counts as importing its ``__init__.py``; ``from pkg import name`` also counts as importing
  ``pkg.name`` when that is a module.
- **Few probes**: ``getattr``/``hasattr`` on objects whose type the code should know hide the seams between
  parts; ``node/`` keeps them at most :data:`MAX_PROBES_PER_1000_LINES`.
- **README at most 8 KB**, so it stays a front page; details live in docs/.
- **No issue numbers** in code or docs: they say where a change came from (the history's job), not why the
  code is as it is.
"""

import ast
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
CYCLE_FREE = ("node", "scheduler", "protocol")
#: ``getattr``/``hasattr`` calls allowed per 1,000 lines of ``node/``: what is left is for truly dynamic objects
#: (file-system errors, streams, hivemind records, argparse's optional sub-command), about what mature
#: peer-to-peer training code bases need.
MAX_PROBES_PER_1000_LINES = 2.0
#: the README is the project's front page: 8 KB reads in a few minutes
MAX_README_BYTES = 8192
#: "issue 30", "issues #7", "PR 12", or a bare "#27" (not a CSS colour such as "#222;")
ISSUE_NUMBER = re.compile(r"(?i)\b(issues?|PR|pull request|ticket)\s*#?\d+\b|(?<![\w&#])#\d{1,4}(?![\w;\"])")
#: files the issue-number rule reads: code and docs, not data
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".yml", ".yaml", ".txt", ".cfg", ".ini", ""}


def _modules() -> dict:
    mods = {}
    for pkg in CYCLE_FREE:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def _imported_names(name: str, path: pathlib.Path) -> set:
    """Every module name an import statement of the file names, anywhere in the file (see the module docstring)."""
    names = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package[:len(package) - (node.level - 1)]
                base = ".".join(parent + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict:
    """module -> the modules of ours it imports (each import resolved to the longest module name that exists)."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        targets = set()
        for imported in _imported_names(name, path):
            while imported and imported not in mods:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def import_cycles(graph: dict) -> list:
    """The strongly connected components with more than one module (Tarjan, iterative), each sorted."""
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_cycle_finder_sees_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_a_function_local_import_counts(tmp_path):
    mod = tmp_path / "m.py"
    mod.write_text("def f():\n    from node.train import trainer\n")
    assert "node.train.trainer" in _imported_names("node.train.m", mod)


def test_no_import_cycles():
    cycles = import_cycles(import_graph())
    assert not cycles, "import cycles (every import counts, function-local ones too): " + "; ".join(
        " <-> ".join(c) for c in cycles)


def _probe_count(text: str) -> int:
    tree = ast.parse(text)
    return sum(1 for n in ast.walk(tree)
               if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr"))


def test_node_probes_are_rare():
    probes, lines, where = 0, 0, []
    for path in sorted((ROOT / "node").rglob("*.py")):
        text = path.read_text()
        lines += len(text.splitlines())
        n = _probe_count(text)
        probes += n
        if n:
            where.append(f"{path.relative_to(ROOT)}: {n}")
    assert probes <= MAX_PROBES_PER_1000_LINES * lines / 1000, (
        f"{probes} getattr/hasattr in {lines} lines of node/ (at most {MAX_PROBES_PER_1000_LINES} per 1,000): {where}")


def test_readme_fits_8kb():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= MAX_README_BYTES, f"README.md is {size} bytes (at most {MAX_README_BYTES})"


def _tracked_text_files():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for rel in out.splitlines():
        path = ROOT / rel
        if path.suffix in TEXT_SUFFIXES and path.is_file() and path.name != pathlib.Path(__file__).name:
            yield rel, path


def test_issue_number_pattern():
    for text in ("see issue 30", "Issues #7 item 4", "(#27)", "PR 12", "fixed in #3."):
        assert ISSUE_NUMBER.search(text), text
    for text in ("color: #222;", "fill: \"#333\"", "#fff", "# 1 hop", "x#1y", "stage 3 of 4"):
        assert not ISSUE_NUMBER.search(text), text


def test_no_issue_numbers_in_code_or_docs():
    found = []
    for rel, path in _tracked_text_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for i, line in enumerate(text.splitlines(), 1):
            if ISSUE_NUMBER.search(line):
                found.append(f"{rel}:{i}: {line.strip()[:80]}")
    assert not found, found
