"""The bench/ scripts as modules, for their unit tests (bench/ is not a package)."""

import importlib.util
import pathlib
import sys

BENCH_DIR = pathlib.Path(__file__).resolve().parents[2] / "bench"


def load_bench(name: str):
    """``bench/<name>.py`` freshly executed as a module."""
    spec = importlib.util.spec_from_file_location(f"{name}_bench_under_test", BENCH_DIR / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod
