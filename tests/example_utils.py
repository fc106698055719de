"""Import a script of examples/ (not an installed package) as a module, for the tests that run it in-process."""
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_example(relpath: str):
    """examples/<relpath> (e.g. "benchmarks/bench_train.py") as a module named after the file. It is registered in
    sys.modules first: dataclasses resolve a module's annotations there."""
    path = ROOT / "examples" / relpath
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
