"""The public API is listable and reachable: `dir(pjax)` shows every name of `pjax.__all__` and the subpackages;
`import pjax` alone reaches each subpackage (imported on first use); every subpackage's `__all__` resolves; each
kernel op is exported from `pjax.kernels`."""
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import pjax

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ["bench", "checkpoint", "decode", "kernels", "models", "serve", "text", "train"]


def test_dir_lists_all_and_the_subpackages():
    listed = dir(pjax)
    assert set(pjax.__all__) <= set(listed)
    assert set(SUBPACKAGES) <= set(listed)
    for name in pjax.__all__:
        assert getattr(pjax, name) is not None


def test_import_pjax_alone_reaches_the_subpackages():
    """A fresh interpreter: `pjax.text.load` etc. after `import pjax` only, and none of the heavy subpackages is
    imported by `import pjax` itself."""
    code = ("import sys, pjax\n"
            "lazy = [m for m in ('pjax.text', 'pjax.serve', 'pjax.train', 'pjax.bench') if m in sys.modules]\n"
            "assert not lazy, lazy\n"
            "print(pjax.text.load.__module__, pjax.serve.__name__, pjax.train.train_drafter.__name__, "
            "pjax.bench.__name__, pjax.train_drafter.__name__)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["pjax.text.generate", "pjax.serve", "train_drafter", "pjax.bench", "train_drafter"]


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nonesuch'"):
        pjax.nonesuch  # noqa: B018


@pytest.mark.parametrize("name", SUBPACKAGES)
def test_subpackage_all_resolves(name):
    mod = importlib.import_module(f"pjax.{name}")
    assert mod.__all__ and len(set(mod.__all__)) == len(mod.__all__)
    for attr in mod.__all__:
        assert hasattr(mod, attr), f"pjax.{name}.{attr}"


def test_kernels_export_each_op():
    import pjax.kernels as K
    for op in ("accept", "attention", "build_draft_inputs", "cache_attention", "expert_matmul"):
        assert op in K.__all__ and callable(getattr(K, op))
