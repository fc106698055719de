"""`python -m pjax generate` end to end (a subprocess) for --prompt, and in-process for --chat (streaming, a stop
string) and --file, the text equal to pjax.text's; bad usage and bad input exit 2 with one line naming the flag or file; Ctrl-C exits 130
after printing the text so far."""
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import pjax.text as T
import pjax.text.cli as cli
from tests.engine_utils import FAST
from tests.text_utils import CHAT, build

ROOT = Path(__file__).resolve().parents[1]
NEW = 16
STATS = re.compile(r"\d+ tokens, acceptance length \d+\.\d\d, [\d.]+ tokens/s, ttft \d+ ms, finish: \w+")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return build(tmp_path_factory.mktemp("cli"))


@pytest.fixture(scope="module")
def gen(dirs):
    return T.load(*dirs, dtype="float32", compiler_options=FAST)


def run_cli(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))  # the suite's XLA flags (conftest.py)
    return subprocess.run([sys.executable, "-m", "pjax", "generate", *map(str, args)], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=600)


def test_prompt(dirs, gen):
    target, head = dirs
    r = run_cli("--target", target, "--head", head, "--prompt", "The quick brown fox", "--max-new-tokens", NEW,
                "--k", 3, "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    want = gen.generate("The quick brown fox", max_new_tokens=NEW, k=3)
    assert r.stdout == want.text + "\n"
    assert STATS.search(r.stderr) and f"{len(want.token_ids)} tokens" in r.stderr


def fast_cli(monkeypatch, **kw):
    """The command in-process (`_main`), its generator compiled with FAST: the programs of `gen`'s same calls."""
    monkeypatch.setattr(cli, "TextGenerator", functools.partial(T.TextGenerator, compiler_options=FAST, **kw))


def test_chat_streamed_with_a_stop_string(dirs, gen, capsys, monkeypatch):
    target, _ = dirs
    free = gen.generate("Name three prime numbers.", chat=True, max_new_tokens=NEW, drafting="none")
    at = next(i for i in range(len(free.text) // 2, len(free.text) - 1) if "\ufffd" not in free.text[i:i + 2])
    stop = free.text[at:at + 2]
    want = gen.generate("Name three prime numbers.", chat=True, max_new_tokens=NEW, drafting="none", stop=[stop])
    assert want.finish_reason == "stop"
    fast_cli(monkeypatch)
    rc, out, err = _main(capsys, "--target", target, "--chat", "Name three prime numbers.", "--max-new-tokens", NEW,
                         "--dtype", "float32", "--stop", stop, "--stream")
    assert rc == 0, err
    assert out == want.text + "\n" and "finish: stop" in err


def test_file(dirs, gen, tmp_path, capsys, monkeypatch):
    target, _ = dirs
    rows = [{"prompt": "The quick brown fox", "id": 1}, {"messages": CHAT}, {"prompt": "def add(a, b):"}]
    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join([json.dumps(rows[0]), "", json.dumps(rows[1]), json.dumps(rows[2])]) + "\n")
    fast_cli(monkeypatch)
    rc, out, err = _main(capsys, "--target", target, "--file", f, "--max-new-tokens", NEW, "--dtype", "float32")
    assert rc == 0, err
    want = gen.generate(["The quick brown fox", CHAT, "def add(a, b):"], max_new_tokens=NEW, drafting="none")
    assert out == "".join(f"=== prompt {i} ===\n{o.text}\n" for i, o in enumerate(want, 1))
    assert [int(m) for m in re.findall(r"^\[prompt (\d)\] ", err, re.M)] == [1, 2, 3]
    assert len(STATS.findall(err)) == 3 and "total: 3 prompts" in err


def test_file_in_batches_streamed(dirs, gen, tmp_path, capsys, monkeypatch):
    """--batch-size 2 over three prompts, streamed: blocks in file order, numbered across batches."""
    target, head = dirs
    prompts = ["The quick brown fox", "def add(a, b):", "Name three prime numbers:"]
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    fast_cli(monkeypatch, rounds_per_step=1)
    rc, out, err = _main(capsys, "--target", target, "--head", head, "--file", f, "--max-new-tokens", NEW, "--k", 3,
                         "--dtype", "float32", "--batch-size", 2, "--stream")
    assert rc == 0, err
    want = gen.generate(prompts[:2], max_new_tokens=NEW, k=3) + [gen.generate(prompts[2], max_new_tokens=NEW, k=3)]
    assert out == "".join(f"=== prompt {i} ===\n{o.text}\n" for i, o in enumerate(want, 1))
    assert [int(m) for m in re.findall(r"^\[prompt (\d)\] ", err, re.M)] == [1, 2, 3] and "total: 3 prompts" in err


def test_bad_input_exits_2_with_one_line(tmp_path):
    r = run_cli("--target", tmp_path / "missing", "--prompt", "hi")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [f"error: --target: {tmp_path / 'missing'}: no such directory (expected "
                                             "a Hugging Face model directory with tokenizer.json and "
                                             "tokenizer_config.json)"]


def _main(capsys, *args):
    rc = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_bad_input_in_process(dirs, tmp_path, capsys):
    target, head = dirs
    base = ("--target", target, "--dtype", "float32")

    def fails(*args, match):
        rc, _, err = _main(capsys, *base, *args)
        assert rc == 2 and len(err.strip().splitlines()) == 1 and re.search(match, err), err

    def usage(*args, match):
        with pytest.raises(SystemExit) as e:
            cli.main([str(a) for a in args])
        err = capsys.readouterr().err
        assert e.value.code == 2 and re.search(match, err), err
    usage(*base, "--prompt", "a", "--k", "0", match=r"argument --k: 0 must be >= 1")
    usage("--target", target, "--prompt", "a", "--dtype", "int8", match=r"argument --dtype: int8 is not supported")
    usage(*base, "--prompt", "a", "--chat", "b", match=r"argument --chat: not allowed with argument --prompt")
    usage(*base, match=r"one of the arguments --prompt --chat --file is required")
    usage(*base, "--prompt", "a", "--top-p", "0", match=r"argument --top-p: 0 must be > 0")
    usage(*base, "--prompt", "a", "--temperature", "hot", match=r"argument --temperature: expected a number")
    fails("--prompt", "a", "--drafting", "parallel", match=r"--drafting parallel needs --head DIR")
    fails("--prompt", "a", "--k", "3", match=r"--k needs drafting")
    fails("--prompt", "a", "--compilation-cache", target / "config.json",
          match=r"--compilation-cache .*config.json: exists and is not a directory")
    fails("--file", tmp_path / "none.jsonl", match=r"--file .*none.jsonl: no such file")
    bad = tmp_path / "bad.jsonl"
    for text, match in [('{"prompt": "a"}\n{"prompt": ', r"bad.jsonl line 2: not valid JSON"),
                        ('{"text": "a"}', r'bad.jsonl line 1: expected an object with "prompt"'),
                        ('{"prompt": "a", "messages": []}', r'line 1: expected .* not both'),
                        ('{"prompt": 3}', r'line 1: "prompt" must be a string'),
                        ('\n{"messages": [{"content": "x"}]}', r"bad.jsonl line 2: \"messages\"\[0\] has no 'role'"),
                        ("\n\n", r"bad.jsonl: no prompts")]:
        bad.write_text(text)
        fails("--file", bad, match=match)
    no_tok = tmp_path / "no_tok"
    no_tok.mkdir()
    fails("--prompt", "a", "--tokenizer", no_tok,
          match=r"--tokenizer: .*no_tok: no tokenizer.json \(looked for tokenizer.json")
    fails("--prompt", "a", "--head", target, match=r"--head: .* not a drafter head")
    plain = tmp_path / "plain"
    plain.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (plain / name).write_bytes((target / name).read_bytes())
    fails("--chat", "a", "--tokenizer", plain, match=r"--chat: .*plain: no chat template")


def test_ctrl_c_prints_the_text_so_far(dirs, gen, capsys, monkeypatch):
    """Ctrl-C during the engine step after half the tokens came: exit 130, the text generated so far on stdout."""
    target, head = dirs
    full = gen.generate("The quick brown fox", max_new_tokens=NEW, k=3, ignore_eos=True)
    stream = T.TextGenerator.stream

    def interrupted(self, *a, **kw):
        s = stream(self, *a, **kw)
        step, seen = s._gen._engine.step, []

        def flaky(*args, **kw):
            if sum(len(e.new_tokens) for e in seen) >= NEW // 2:
                raise KeyboardInterrupt
            events = step(*args, **kw)
            seen.extend(events)
            return events
        s._gen._engine.step = flaky
        return s
    monkeypatch.setattr(T.TextGenerator, "stream", interrupted)
    monkeypatch.setattr(cli, "TextGenerator", functools.partial(T.TextGenerator, compiler_options=FAST,
                                                                rounds_per_step=1))
    for streaming in ([], ["--stream"]):
        rc, out, err = _main(capsys, "--target", target, "--head", head, "--prompt", "The quick brown fox",
                             "--max-new-tokens", NEW, "--k", 3, "--dtype", "float32", *streaming)
        assert rc == 130 and err.strip().splitlines()[-1] == "interrupted"
        assert out.endswith("\n") and 0 < len(out) - 1 < len(full.text) and full.text.startswith(out[:-1])


def test_one_nan_in_a_large_weight_is_refused(dirs, tmp_path, capsys):
    """One NaN in the float32 embedding (10,240 elements) stops `generate` with exit 2 naming the tensor."""
    import shutil

    import numpy as np

    from pjax.checkpoint.safetensors import SafetensorsFile, save_file
    target, _ = dirs
    nan = tmp_path / "nan"
    shutil.copytree(target, nan)
    f = SafetensorsFile(target / "model.safetensors")
    tensors = {k: np.array(f.get(k)) for k in f.keys()}
    tensors["model.embed_tokens.weight"][160, 7] = np.nan
    save_file(tensors, nan / "model.safetensors")
    rc, out, err = _main(capsys, "--target", nan, "--prompt", "a", "--dtype", "float32")
    assert rc == 2 and out == "" and "tensor 'model.embed_tokens.weight' has 1 non-finite" in err, err


def test_flags_agree_with_the_messages(dirs, tmp_path, capsys):
    """A file where a directory is expected says so; --max-new-tokens past the target's context (512 positions) is
    refused naming it, the default is capped to it; --no-finite-check, which the finite check's message suggests,
    exists."""
    target, _ = dirs
    f = tmp_path / "file"
    f.write_text("x")
    rc, _, err = _main(capsys, "--target", f, "--prompt", "a")
    assert rc == 2 and "file: is a file (expected a Hugging Face model directory" in err, err
    rc, _, err = _main(capsys, "--target", target, "--prompt", "a", "--max-new-tokens", 100000)
    assert rc == 2 and re.search(r"--max-new-tokens 100000: the longest prompt \(\d+ tokens\) \+ 100000 new tokens "
                                 r"exceed the target's context length \(max_position_embeddings=512\); at most \d+ "
                                 r"new tokens fit", err), err
    args = cli.build_parser().parse_args(["--target", str(target), "--prompt", "a", "--no-finite-check"])
    assert args.no_finite_check and args.max_new_tokens is None
    from pjax.config import ModelConfig
    cfg = ModelConfig("llama", 8, 8, 8, 1, (), max_position_embeddings=300)
    assert cli._max_new_tokens(args, cfg, [[1] * 100]) == 200
    assert cli._max_new_tokens(args, cfg, [[1] * 10]) == 256
    from pjax.bench.cli import build_parser as bench_parser
    from pjax.serve.cli import build_parser as serve_parser
    assert serve_parser().parse_args(["--target", str(target), "--no-finite-check"]).no_finite_check
    assert bench_parser().parse_args(["--target", str(target), "--out", "o", "--no-finite-check"]).no_finite_check
