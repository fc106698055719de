"""A code corpus from the Python sources installed on the machine, with a manifest, a held-out split by file and
benchmark prompts drawn from the held-out files.

What is collected: the `.py` files of the standard library and of a named list of installed packages
(`DEFAULT_PACKAGES`, all under permissive licences; a package that is not installed is recorded as absent).
Packages are located with `importlib.util.find_spec` (nothing is imported) and walked in sorted order. Skipped,
with the reason counted in the manifest: files that are not UTF-8, contain NUL bytes, are empty, larger than
`max_file_bytes`, have a line longer than `max_line_chars` (generated tables, embedded data), or repeat the bytes
of a file collected earlier (vendored copies). Test directories (`test`, `tests`, `idle_test`) are left out unless
`include_tests`: they are dominated by fixtures, generated data tables and long runs of assertions, CPython's hold
files that are malformed on purpose (bad encodings, syntax errors), and the benchmark is library code (a function's
signature and docstring to its body), which test code rarely has. Each file is named `PACKAGE/RELATIVE/PATH.py`,
independent of where the package is installed.

The split: a file is held out when the first 8 bytes of sha256(name), read as an integer, fall below
`held_out_fraction * 2**64` — deterministic from the name alone, so a file keeps its side across machines, package
versions and corpus subsets. Held-out files are never trained on (neither the tokenizer nor the models).

Benchmark prompts (`benchmark_prompts`): functions and methods of held-out files that have a docstring and a body
of `min_body_lines`..`max_body_lines` non-blank lines; the prompt is the function's source (decorators, signature,
docstring) dedented to column 0 with a final newline, the reference is the rest of its body. A function whose body
appears line for line (stripped, blank lines ignored) in a training file is dropped (it could be recalled, not
predicted). Selection is deterministic: by sha256 of "NAME:QUALNAME", at most `per_file` per file.
`function_prompts` draws prompts of the same form from training files (drafter training data shaped like its use).

Files written by `collect_corpus` into its directory: `train.jsonl` and `held_out.jsonl` ({"path", "text"} per
line, in collection order) and `manifest.json` (format "pjax-corpus" version 1: settings, per package its version,
licence, roots, counts and skips; per file its name, bytes, sha256 and split; the corpus sha256 over
"NAME<TAB>SHA256<LF>" of every file in name order). `write_prompts` writes the prompts as .jsonl rows {"id",
"prompt", "reference", "source", "line"} (`python -m pjax bench --dataset FILE.jsonl` reads "prompt").
"""
from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import sys
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

__all__ = ["CorpusError", "CorpusPackage", "DEFAULT_PACKAGES", "Prompt", "benchmark_prompts", "collect_corpus",
           "corpus_sha256", "function_prompts", "held_out", "package_roots", "read_texts", "write_prompts"]

FORMAT = "pjax-corpus"
VERSION = 1
TEST_DIRS = frozenset({"test", "tests", "idle_test"})
ALWAYS_SKIPPED_DIRS = frozenset({"__pycache__", "site-packages", "dist-packages"})


class CorpusError(ValueError):
    """The corpus cannot be built or read as asked; the message names the package, file or setting."""


@dataclasses.dataclass(frozen=True)
class CorpusPackage:
    """A source of Python files: `name` is the import name ("stdlib" for the standard library), `distribution`
    the installed distribution whose version is recorded, `license` its SPDX licence expression."""
    name: str
    distribution: Optional[str]
    license: str


DEFAULT_PACKAGES = (
    CorpusPackage("stdlib", None, "PSF-2.0"),
    CorpusPackage("numpy", "numpy", "BSD-3-Clause"),
    CorpusPackage("scipy", "scipy", "BSD-3-Clause"),
    CorpusPackage("sympy", "sympy", "BSD-3-Clause"),
    CorpusPackage("mpmath", "mpmath", "BSD-3-Clause"),
    CorpusPackage("networkx", "networkx", "BSD-3-Clause"),
    CorpusPackage("pandas", "pandas", "BSD-3-Clause"),
    CorpusPackage("sklearn", "scikit-learn", "BSD-3-Clause"),
    CorpusPackage("statsmodels", "statsmodels", "BSD-3-Clause"),
    CorpusPackage("skimage", "scikit-image", "BSD-3-Clause"),
    CorpusPackage("matplotlib", "matplotlib", "LicenseRef-Matplotlib (PSF-based, permissive)"),
    CorpusPackage("torch", "torch", "BSD-3-Clause"),
    CorpusPackage("transformers", "transformers", "Apache-2.0"),
    CorpusPackage("tokenizers", "tokenizers", "Apache-2.0"),
    CorpusPackage("safetensors", "safetensors", "Apache-2.0"),
    CorpusPackage("huggingface_hub", "huggingface-hub", "Apache-2.0"),
    CorpusPackage("accelerate", "accelerate", "Apache-2.0"),
    CorpusPackage("peft", "peft", "Apache-2.0"),
    CorpusPackage("timm", "timm", "Apache-2.0"),
    CorpusPackage("jax", "jax", "Apache-2.0"),
    CorpusPackage("flax", "flax", "Apache-2.0"),
    CorpusPackage("optax", "optax", "Apache-2.0"),
    CorpusPackage("orbax", "orbax-checkpoint", "Apache-2.0"),
    CorpusPackage("chex", "chex", "Apache-2.0"),
    CorpusPackage("equinox", "equinox", "Apache-2.0"),
    CorpusPackage("xarray", "xarray", "Apache-2.0"),
    CorpusPackage("jinja2", "jinja2", "BSD-3-Clause"),
    CorpusPackage("pygments", "pygments", "BSD-2-Clause"),
    CorpusPackage("rich", "rich", "MIT"),
    CorpusPackage("requests", "requests", "Apache-2.0"),
)


def held_out(name: str, fraction: float) -> bool:
    """True when the file `name` belongs to the held-out split (sha256 of the name; see the module docstring)."""
    h = int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big")
    return h < int(fraction * 2 ** 64)


def _order_key(name: str) -> bytes:
    """A deterministic order independent of the split's hash (the split takes the smallest name hashes, so ordering
    by that same hash would fill a `max_files` subset with held-out files)."""
    return hashlib.sha256(b"order\0" + name.encode("utf-8")).digest()


def package_roots(pkg: CorpusPackage) -> list[Path]:
    """Directories holding `pkg`'s sources on this machine ([] when it is not installed); nothing is imported."""
    if pkg.name == "stdlib":
        return [Path(sysconfig.get_paths()["stdlib"])]
    try:
        spec = importlib.util.find_spec(pkg.name)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    if spec.submodule_search_locations:
        return sorted({Path(p) for p in spec.submodule_search_locations if os.path.isdir(p)})
    return [Path(spec.origin).parent] if spec.origin and spec.origin.endswith(".py") else []


def _version(pkg: CorpusPackage) -> Optional[str]:
    if pkg.distribution is None:
        return ".".join(map(str, sys.version_info[:3]))
    try:
        return importlib.metadata.version(pkg.distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _license_metadata(pkg: CorpusPackage) -> Optional[str]:
    """What the installed distribution declares: License-Expression, else its licence classifiers, else the first
    line of its License field."""
    if pkg.distribution is None:
        return "PSF-2.0 (the Python standard library)"
    try:
        meta = importlib.metadata.metadata(pkg.distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    if meta.get("License-Expression"):
        return meta["License-Expression"]
    classifiers = [c.split(" :: ")[-1] for c in (meta.get_all("Classifier") or []) if c.startswith("License ::")]
    if classifiers:
        return "; ".join(classifiers)
    text = (meta.get("License") or "").strip()
    return text.splitlines()[0][:120] if text else None


def _walk(root: Path, include_tests: bool) -> Iterator[Path]:
    skip = ALWAYS_SKIPPED_DIRS | (frozenset() if include_tests else TEST_DIRS)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith("."))
        for f in sorted(filenames):
            if f.endswith(".py"):
                yield Path(dirpath) / f


def _reject(data: bytes, max_file_bytes: int, max_line_chars: int) -> tuple[Optional[str], Optional[str]]:
    """(reason, None) for a rejected file, (None, text) for an accepted one."""
    if len(data) > max_file_bytes:
        return "too_large", None
    if b"\x00" in data:
        return "binary", None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return "not_utf8", None
    if not text.strip():
        return "empty", None
    if max(map(len, text.splitlines())) > max_line_chars:
        return "long_lines", None
    return None, text


def corpus_sha256(files: Iterable[tuple[str, str]]) -> str:
    """sha256 over "NAME<TAB>SHA256<LF>" of (name, file sha256) pairs, in name order: one hash for the corpus."""
    h = hashlib.sha256()
    for name, sha in sorted(files):
        h.update(f"{name}\t{sha}\n".encode("utf-8"))
    return h.hexdigest()


def _write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def collect_corpus(out_dir, packages: Sequence[CorpusPackage] = DEFAULT_PACKAGES, *, held_out_fraction: float = 0.03,
                   include_tests: bool = False, max_file_bytes: int = 1_000_000, max_line_chars: int = 2000,
                   max_files: Optional[int] = None, progress: bool = False) -> dict:
    """Collect the corpus into `out_dir` (created; its three files replaced); returns the manifest.

    max_files: keep only the `max_files` collected files first in a salted sha256-of-name order (a deterministic subset
    whose split agrees with the full corpus'). progress: a tqdm bar over packages."""
    if not 0 < held_out_fraction < 1:
        raise CorpusError(f"held_out_fraction={held_out_fraction} must be in (0, 1)")
    names = [p.name for p in packages]
    if len(set(names)) != len(names):
        raise CorpusError(f"packages name {sorted({n for n in names if names.count(n) > 1})} more than once")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seen: dict[str, str] = {}  # content sha256 -> name of the first file with those bytes
    files, pkg_rows = [], []
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(packages), desc="corpus", unit="pkg", dynamic_ncols=True)
    for pkg in packages:
        roots = package_roots(pkg)
        row = dict(name=pkg.name, distribution=pkg.distribution, version=_version(pkg), license=pkg.license,
                   license_metadata=_license_metadata(pkg), roots=[str(r) for r in roots], installed=bool(roots),
                   skipped={})
        for root in roots:
            for path in _walk(root, include_tests):
                rel = path.relative_to(root).as_posix()
                name = f"{pkg.name}/{rel}" if len(roots) == 1 else f"{pkg.name}/{root.name}/{rel}"
                try:
                    data = path.read_bytes()
                except OSError:
                    row["skipped"]["unreadable"] = row["skipped"].get("unreadable", 0) + 1
                    continue
                reason, text = _reject(data, max_file_bytes, max_line_chars)
                sha = hashlib.sha256(data).hexdigest()
                if reason is None and sha in seen:
                    reason = "duplicate"
                if reason is not None:
                    row["skipped"][reason] = row["skipped"].get(reason, 0) + 1
                    continue
                seen[sha] = name
                files.append(dict(path=name, package=pkg.name, bytes=len(data), sha256=sha,
                                  split="held_out" if held_out(name, held_out_fraction) else "train", text=text))
        pkg_rows.append(row)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(files=len(files))
    if bar is not None:
        bar.close()
    if max_files is not None:
        keep = {f["path"] for f in sorted(files, key=lambda f: _order_key(f["path"]))[:max_files]}
        files = [f for f in files if f["path"] in keep]
    if not files:
        raise CorpusError(f"no Python files found for packages {names}")
    for row in pkg_rows:
        mine = [f for f in files if f["package"] == row["name"]]
        row.update(files=len(mine), bytes=sum(f["bytes"] for f in mine),
                   train_files=sum(f["split"] == "train" for f in mine),
                   held_out_files=sum(f["split"] == "held_out" for f in mine))
    splits = {}
    for split in ("train", "held_out"):
        part = [f for f in files if f["split"] == split]
        splits[split] = dict(files=len(part), bytes=sum(f["bytes"] for f in part))
        _write_jsonl(out / f"{split}.jsonl", ({"path": f["path"], "text": f["text"]} for f in part))
    splits["held_out"]["fraction_of_files"] = splits["held_out"]["files"] / len(files)
    splits["held_out"]["fraction_of_bytes"] = splits["held_out"]["bytes"] / sum(f["bytes"] for f in files)
    manifest = dict(
        format=FORMAT, version=VERSION, python=sys.version.split()[0],
        settings=dict(held_out_fraction=held_out_fraction, include_tests=include_tests, max_file_bytes=max_file_bytes,
                      max_line_chars=max_line_chars, max_files=max_files, packages=names),
        sha256=corpus_sha256((f["path"], f["sha256"]) for f in files), packages=pkg_rows, **splits,
        files=[{k: f[k] for k in ("path", "bytes", "sha256", "split")} for f in files])
    tmp = out / f".manifest.json.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, out / "manifest.json")
    return manifest


def read_texts(path) -> Iterator[tuple[str, str]]:
    """(name, text) of each row of a `train.jsonl` / `held_out.jsonl` written by `collect_corpus`."""
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"{path}: not found (write it with collect_corpus)")
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            try:
                row = json.loads(line)
                yield row["path"], row["text"]
            except (ValueError, KeyError, TypeError):
                raise CorpusError(f"{path}:{n}: expected a JSON object with 'path' and 'text'") from None


# ------------------------------------------------------------------------------------------- benchmark prompts
@dataclasses.dataclass(frozen=True)
class Prompt:
    id: str  # NAME:QUALNAME
    prompt: str  # decorators + signature + docstring, dedented, ending in a newline
    reference: str  # the rest of the function's body, dedented like the prompt
    source: str  # NAME of the held-out file
    line: int  # 1-based line of the function's first line (first decorator) in the file


def _normalized(lines: Iterable[str]) -> tuple[str, ...]:
    return tuple(s for s in (line.strip() for line in lines) if s)


def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.AST]]:
    """(qualname, node) of module-level functions and methods of (nested) classes; not functions inside functions."""
    stack = [("", node) for node in tree.body]
    while stack:
        prefix, node = stack.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
        elif isinstance(node, ast.ClassDef):
            stack.extend((f"{prefix}{node.name}.", child) for child in node.body)


def _candidate(name: str, qualname: str, node, lines: list[str], min_body: int, max_body: int,
               max_prompt_chars: int, max_reference_chars: int) -> Optional[Prompt]:
    body = node.body
    if len(body) < 2 or not (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                             and isinstance(body[0].value.value, str)):
        return None
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    doc_end, end = body[0].end_lineno, node.end_lineno
    if body[1].lineno <= doc_end or lines[doc_end - 1].encode("utf-8")[body[0].end_col_offset:].strip():
        return None  # the body starts on the docstring's last line
    indent = lines[first - 1][:len(lines[first - 1]) - len(lines[first - 1].lstrip())]
    text = lines[first - 1:end]
    if any(line.strip() and not line.startswith(indent) for line in text):
        return None  # a line left of the function's indentation (a multi-line string): cannot dedent
    text = [line[len(indent):] if line.strip() else "" for line in text]
    head, rest = text[:doc_end - first + 1], text[doc_end - first + 1:]
    while rest and not rest[-1]:
        rest.pop()
    n_body = sum(1 for line in rest if line.strip())
    prompt, reference = "\n".join(head) + "\n", "\n".join(rest) + "\n"
    if not min_body <= n_body <= max_body or len(prompt) > max_prompt_chars or len(reference) > max_reference_chars:
        return None
    return Prompt(f"{name}:{qualname}", prompt, reference, name, first)


def _file_prompts(name: str, text: str, min_body: int, max_body: int, max_prompt_chars: int,
                  max_reference_chars: int) -> list[Prompt]:
    """The prompt-shaped functions of one file, in sha256 order of their ids ([] when it does not parse)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")  # the line breaks ast counts
    found = [c for qual, node in _functions(tree)
             if (c := _candidate(name, qual, node, lines, min_body, max_body, max_prompt_chars,
                                 max_reference_chars)) is not None]
    return sorted(found, key=lambda p: _order_key(p.id))


def function_prompts(files: Iterable[tuple[str, str]], *, per_file: int = 8, min_body_lines: int = 3,
                     max_body_lines: int = 40, max_prompt_chars: int = 1500) -> Iterator[Prompt]:
    """Prompts of the benchmark's form (signature and docstring) from (name, text) files, at most `per_file` per
    file, files taken in a deterministic order spread over packages (parsed lazily: take as many as needed). Training
    data shaped like the prompts a code drafter is asked to continue; no decontamination (pass training files)."""
    for name, text in sorted(files, key=lambda f: _order_key(f[0])):
        yield from _file_prompts(name, text, min_body_lines, max_body_lines, max_prompt_chars, sys.maxsize)[:per_file]


def benchmark_prompts(held_out_files: Iterable[tuple[str, str]], train_files: Iterable[tuple[str, str]], *,
                      max_prompts: int = 200, per_file: int = 2, min_body_lines: int = 3, max_body_lines: int = 40,
                      max_prompt_chars: int = 1500, max_reference_chars: int = 2000) -> list[Prompt]:
    """Prompts from (name, text) held-out files, without functions whose body appears in a (name, text) training
    file; see the module docstring. Files that do not parse with this Python are skipped."""
    by_file: dict[str, list[Prompt]] = {}
    for name, text in held_out_files:
        found = _file_prompts(name, text, min_body_lines, max_body_lines, max_prompt_chars, max_reference_chars)
        if found:
            by_file[name] = found
    # decontamination: the normalized body as consecutive normalized lines of a training file
    bodies = {p.id: _normalized(p.reference.splitlines()) for ps in by_file.values() for p in ps}
    firsts: dict[str, list[str]] = {}
    for pid, body in bodies.items():
        firsts.setdefault(body[0], []).append(pid)
    seen_in_train = set()
    for _, text in train_files:
        norm = _normalized(text.splitlines())
        for i, line in enumerate(norm):
            for pid in firsts.get(line, ()):
                if pid not in seen_in_train and norm[i:i + len(bodies[pid])] == bodies[pid]:
                    seen_in_train.add(pid)
    chosen = []
    for name in sorted(by_file, key=_order_key):
        chosen.extend([p for p in by_file[name] if p.id not in seen_in_train][:per_file])
    chosen.sort(key=lambda p: _order_key(p.id))
    return chosen[:max_prompts]


def write_prompts(prompts: Sequence[Prompt], path) -> Path:
    """Write prompts as .jsonl rows {"id", "prompt", "reference", "source", "line"} (atomic)."""
    path = Path(path)
    _write_jsonl(path, (dataclasses.asdict(p) for p in prompts))
    return path
