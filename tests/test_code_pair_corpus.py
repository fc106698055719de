"""examples/code_pair/corpus.py (collection, skips, split, manifest, benchmark prompts) and bpe.py (the code tokenizer
in the Hugging Face layout) on small synthetic package trees."""
import hashlib
import json
import textwrap

import pytest
import transformers as tf

from examples.code_pair import corpus as C
from examples.code_pair.bpe import SPECIAL_TOKENS, train_bpe_tokenizer, write_tokenizer_files

MODULE = textwrap.dedent('''\
    """A module."""
    import os


    @decorator
    def top(a, b=1):
        """Add two numbers.

        Returns their sum.
        """
        total = a + b
        if total > 10:
            total -= 1
        return total


    class Box:
        """A box."""

        def area(self, w, h):
            """Area of the box."""
            x = w * h
            y = x + 0
            return y

        def short(self):
            """Too short."""
            return 1

        def inline(self):
            """Body on the docstring line."""; a = 1; b = 2
            return a + b


    def no_doc(x):
        y = x + 1
        z = y + 1
        return z
    ''')


def make_package(root, name, files):
    for rel, data in files.items():
        p = root / name / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data if isinstance(data, bytes) else data.encode())
    return root


@pytest.fixture
def fake_packages(tmp_path, monkeypatch):
    root = tmp_path / "site"
    make_package(root, "alpha", {
        "__init__.py": "", "core.py": MODULE, "zcopy.py": MODULE, "latin1.py": b"x = '\xe9'\n",
        "nul.py": b"x = 1\x00\n", "big.py": "x = 1\n" * 400, "wide.py": "x = '" + "a" * 300 + "'\n",
        "tests/test_core.py": "def test():\n    assert True\n", "sub/util.py": "def f():\n    return 2\n"})
    make_package(root, "beta", {"__init__.py": "VALUE = 3\n"})
    monkeypatch.syspath_prepend(str(root))
    return [C.CorpusPackage("alpha", None, "MIT"), C.CorpusPackage("beta", None, "BSD-3-Clause"),
            C.CorpusPackage("missing_pkg_xyz", "missing-pkg-xyz", "MIT")]


def test_collect_skips_split_and_manifest(fake_packages, tmp_path, monkeypatch):
    monkeypatch.setattr(C, "_version", lambda p: "1.0")
    monkeypatch.setattr(C, "_license_metadata", lambda p: None)
    m = C.collect_corpus(tmp_path / "c", fake_packages, held_out_fraction=0.5, max_file_bytes=1000,
                         max_line_chars=200)
    alpha, beta, missing = m["packages"]
    assert alpha["skipped"] == {"empty": 1, "duplicate": 1, "not_utf8": 1, "binary": 1, "too_large": 1,
                                "long_lines": 1}
    assert [f["path"] for f in m["files"]] == ["alpha/core.py", "alpha/sub/util.py", "beta/__init__.py"]
    assert missing["installed"] is False and missing["files"] == 0
    for f in m["files"]:
        assert f["split"] == ("held_out" if C.held_out(f["path"], 0.5) else "train")
    texts = {s: dict(C.read_texts(tmp_path / "c" / f"{s}.jsonl")) for s in ("train", "held_out")}
    assert set(texts["train"]) | set(texts["held_out"]) == {f["path"] for f in m["files"]}
    assert not set(texts["train"]) & set(texts["held_out"])
    assert m["sha256"] == C.corpus_sha256((f["path"], hashlib.sha256(
        (texts["train"] | texts["held_out"])[f["path"]].encode()).hexdigest()) for f in m["files"])
    assert json.loads((tmp_path / "c" / "manifest.json").read_text()) == m
    with_tests = C.collect_corpus(tmp_path / "t", fake_packages, include_tests=True, max_file_bytes=1000,
                                  max_line_chars=200)
    assert "alpha/tests/test_core.py" in {f["path"] for f in with_tests["files"]}
    subset = C.collect_corpus(tmp_path / "s", fake_packages, max_files=2, max_file_bytes=1000, max_line_chars=200)
    assert len(subset["files"]) == 2 and {f["path"] for f in subset["files"]} <= {f["path"] for f in m["files"]}


def test_split_depends_on_the_name_only():
    names = [f"pkg/mod_{i}.py" for i in range(4000)]
    held = [n for n in names if C.held_out(n, 0.03)]
    assert 0.02 <= len(held) / len(names) <= 0.04
    assert held == [n for n in names if C.held_out(n, 0.03)]
    assert set(held) <= {n for n in names if C.held_out(n, 0.1)}  # a larger fraction only adds files


def test_benchmark_prompts():
    prompts = C.benchmark_prompts([("alpha/core.py", MODULE)], [], min_body_lines=3, per_file=5)
    by_id = {p.id: p for p in prompts}
    assert set(by_id) == {"alpha/core.py:top", "alpha/core.py:Box.area"}
    top = by_id["alpha/core.py:top"]
    assert top.prompt.startswith("@decorator\ndef top(a, b=1):\n") and top.prompt.endswith('Returns their sum.\n    """\n')
    assert top.reference == "    total = a + b\n    if total > 10:\n        total -= 1\n    return total\n"
    assert top.line == 5 and top.source == "alpha/core.py"
    area = by_id["alpha/core.py:Box.area"]
    assert area.prompt == 'def area(self, w, h):\n    """Area of the box."""\n'  # dedented to column 0
    assert area.reference == "    x = w * h\n    y = x + 0\n    return y\n"
    # a body that appears in a training file (re-indented, other blank lines) is dropped
    train = "class Other:\n    def g(self):\n        x = w * h\n\n        y = x + 0\n        return y\n"
    assert [p.id for p in C.benchmark_prompts([("alpha/core.py", MODULE)], [("beta/x.py", train)],
                                              per_file=5)] == ["alpha/core.py:top"]
    assert len(C.benchmark_prompts([("alpha/core.py", MODULE)], [], per_file=1)) == 1
    assert C.benchmark_prompts([("bad.py", "def f(:\n")], []) == []


def test_function_prompts():
    """Training data of the benchmark's form: the same prompts as `benchmark_prompts` (no decontamination), at most
    per_file a file, files in a fixed order independent of the order given, drawn lazily."""
    files = [("alpha/core.py", MODULE), ("beta/core.py", MODULE), ("bad.py", "def f(:\n")]
    bench = {p.prompt for p in C.benchmark_prompts([("alpha/core.py", MODULE)], [], per_file=5)}
    got = list(C.function_prompts(files))
    assert len(got) == 4 and {p.prompt for p in got} == bench
    assert [p.id for p in got] == [p.id for p in C.function_prompts(files[::-1])]
    assert sorted({p.source for p in got}) == ["alpha/core.py", "beta/core.py"]
    assert [p.source for p in C.function_prompts(files, per_file=1)] == [got[0].source, got[2].source]
    lazy = C.function_prompts(iter(files))
    assert next(lazy).id == got[0].id


def test_write_prompts(tmp_path):
    prompts = C.benchmark_prompts([("alpha/core.py", MODULE)], [], per_file=5)
    path = C.write_prompts(prompts, tmp_path / "p.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["id"] for r in rows] == [p.id for p in prompts]
    assert set(rows[0]) == {"id", "prompt", "reference", "source", "line"}


def test_tokenizer_hf_layout(tmp_path):
    texts = [MODULE * 3, "import numpy as np\n\n\ndef f(x):\n    return np.sum(x ** 2)\n" * 20,
             "caf\u00e9 = '\u2603'\n"]
    tok = train_bpe_tokenizer(texts, 400)
    again = train_bpe_tokenizer(texts, 400)
    assert tok.to_str() == again.to_str()  # deterministic
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS.values()] == list(range(len(SPECIAL_TOKENS)))
    out = write_tokenizer_files(tok, tmp_path / "tok")
    hf = tf.AutoTokenizer.from_pretrained(out)
    for text in texts + ["    def g(self):\n\treturn  1\r\n"]:
        ids = hf(text)["input_ids"]
        assert ids == tok.encode(text).ids and ids[0] == hf.bos_token_id
        assert hf.decode(ids, skip_special_tokens=True) == text
        assert hf(text, add_special_tokens=False)["input_ids"] == ids[1:]
    assert (hf.bos_token, hf.eos_token, hf.pad_token, hf.mask_token) == tuple(
        SPECIAL_TOKENS[k] for k in ("bos_token", "eos_token", "pad_token", "mask_token"))
    chat = hf.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|bos|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert ids.count(hf.bos_token_id) == 1
    with pytest.raises(ValueError, match="smaller than"):
        train_bpe_tokenizer(texts, 100)
