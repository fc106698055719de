"""The package layering holds: a lower layer never imports a higher one, and no import cycle exists inside pjax/ or
convert/. Every import statement counts, also those inside functions (a lazy import is still a dependency).

Layers, lowest first: _io (atomic output files) < config / _compat / dtypes / command / precision < kernels < models <
checkpoint < decode < text, train < bench, serve, check (the device self-check) < cli, the package root and convert/.
A module may import its own layer and the layers below it. A private name (`_name`) is used only inside the package
that holds it, also by the examples."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = [
    ("pjax._io",),
    ("pjax.config", "pjax._compat", "pjax.dtypes", "pjax.command", "pjax.precision"),
    ("pjax.kernels",),
    ("pjax.models",),
    ("pjax.checkpoint",),
    ("pjax.decode",),
    ("pjax.text", "pjax.train"),
    ("pjax.bench", "pjax.serve", "pjax.check"),
    ("pjax.cli", "pjax.__main__", "pjax", "convert"),
]


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def layer_of(module: str) -> int:
    best, rank = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:  # the longest matching prefix decides ("pjax" only matches the package root itself)
            if (module == p or (p != "pjax" and module.startswith(p + "."))) and len(p) > best:
                best, rank = len(p), i
    if rank is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}")
    return rank


def imports_of(path: Path, module: str) -> set[str]:
    """Modules of pjax / convert that `path` imports (absolute names; `from X import Y` counts Y when it is a module)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out.update(n for n in names if n.split(".")[0] in ("pjax", "convert"))
    return out


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    files = sorted(list((root / "pjax").rglob("*.py")) + list((root / "convert").rglob("*.py")))
    modules = {module_name(f, root): f for f in files}
    g = {}
    for name, f in modules.items():
        # keep only edges to real modules (drop `from pkg import function` second halves)
        g[name] = {m for m in imports_of(f, name) if m in modules and m != name}
    return g


def back_imports(g) -> list[str]:
    return sorted(f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
                  for a, deps in g.items() for b in deps if layer_of(b) > layer_of(a))


def cycles(g) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def package_edges_only(g):
    """Package __init__ re-exports point down into their own package: not a cycle with the modules they list when
    those modules do not import the package back. Drop edges from a package to its own submodules."""
    return {a: {b for b in deps if not b.startswith(a + ".")} for a, deps in g.items()}


def test_no_lower_layer_imports_a_higher_one():
    g = graph()
    assert sum(map(len, g.values())) > 100  # the parser sees the real import graph
    assert back_imports(g) == []


def test_no_import_cycles():
    assert cycles(package_edges_only(graph())) == []


@pytest.mark.parametrize("bad", ["kernel_imports_decode", "cycle", "private_name"])
def test_checks_catch_violations(tmp_path, bad):
    """The checks fail on a deliberate back-import and on a deliberate cycle (in a copy of the tree)."""
    import shutil
    for d in ("pjax", "convert"):
        shutil.copytree(ROOT / d, tmp_path / d)
    (tmp_path / "examples").mkdir()
    if bad == "kernel_imports_decode":
        p = tmp_path / "pjax" / "kernels" / "rng.py"
        p.write_text(p.read_text() + "\nimport pjax.decode.step  # deliberate back-import\n")
        assert any("pjax.kernels.rng" in line for line in back_imports(graph(tmp_path)))
    elif bad == "private_name":
        p = tmp_path / "pjax" / "kernels" / "flash_attention" / "pallas.py"
        p.write_text(p.read_text() + "\nfrom pjax.kernels.cache_attention.pallas import _kernel  # deliberate\n")
        assert all_private_uses(tmp_path) == ["pjax.kernels.flash_attention.pallas imports "
                                              "pjax.kernels.cache_attention.pallas._kernel"]
    else:
        p = tmp_path / "pjax" / "models" / "layers.py"
        p.write_text(p.read_text() + "\nfrom pjax.models import drafter  # deliberate cycle\n")
        assert any("pjax.models.layers" in c for c in cycles(package_edges_only(graph(tmp_path))))



def private_uses(path: Path, module: str, root: Path = ROOT) -> list[str]:
    """Private names of pjax (a module or attribute whose name starts with one underscore) that `path` reaches from
    outside the package holding them: `from pjax.a.b import _c`, `import pjax.a._b`, `mod._c` on an imported pjax
    module. A private name is usable only inside its own package (`pjax._compat` everywhere in pjax,
    `pjax.kernels._pallas_util` inside `pjax.kernels`)."""
    def private(name):
        return name.startswith("_") and not name.startswith("__")

    def owner(parts):  # the package holding the first private segment (a module's package for a module's name)
        i = next(i for i, p in enumerate(parts) if private(p))
        return ".".join(parts[:i] if root.joinpath(*parts[:i], "__init__.py").exists() else parts[:i - 1])

    def inside(pkg):
        return module == pkg or module.startswith(pkg + ".")

    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out, modules = [], {}
    for node in ast.walk(tree):
        full = []
        if isinstance(node, ast.Import):
            for a in node.names:
                full.append(a.name)
                if a.name.startswith("pjax.") and a.asname:
                    modules[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                full.append(f"{base}.{a.name}")
                modules[a.asname or a.name] = f"{base}.{a.name}"
        for name in full:
            parts = name.split(".")
            if parts[0] == "pjax" and any(private(p) for p in parts) and not inside(owner(parts)):
                out.append(f"{module} imports {name}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                and modules[node.value.id].startswith("pjax") and private(node.attr)):
            name = f"{modules[node.value.id]}.{node.attr}"
            if not inside(owner(name.split("."))):
                out.append(f"{module} uses {name}")
    return sorted(set(out))


def all_private_uses(root: Path = ROOT) -> list[str]:
    files = sorted(p for d in ("pjax", "convert", "examples") for p in (root / d).rglob("*.py"))
    return [line for f in files for line in private_uses(f, module_name(f, root), root)]


def test_no_private_name_is_used_outside_its_package():
    assert all_private_uses() == []
