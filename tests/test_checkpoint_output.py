"""Output directories: --force / overwrite replace only a previous pjax output of the same kind; a source is never
written over; interrupted writers leave no temporaries behind; an unwritable location is one line, exit 2."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
import torch
import transformers as tf

import pjax
from pjax.checkpoint.cli import main as cli_main
from pjax import _io as files
from pjax.config import LayerSpec, ModelConfig, RopeSpec
from pjax.models.drafter import DrafterConfig

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "tiny_llama"
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    tf.LlamaForCausalLM(cfg).float().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def drafter():
    layer = ModelConfig("llama", 61, 32, 40, 4, (LayerSpec(8, 2, RopeSpec(theta=10000.0)),), rms_norm_eps=1e-5)
    cfg = DrafterConfig(layer=layer, num_aux=3, target_hidden_size=32, draft_vocab_size=40, mask_token_id=60,
                        aux_layer_ids=(0, 1, 2))
    return pjax.init_drafter(cfg, jax.random.key(0), jnp.float32, scale=0.2)


def snapshot(path: Path) -> dict:
    """Every file under `path` with its bytes (what must stay untouched)."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def hidden(path: Path) -> list:
    return sorted(p.name for p in path.iterdir() if p.name.startswith("."))


# ------------------------------------------------------------------------------------- the --force rule
def test_force_refuses_a_model_directory(hf_dir, tmp_path, capsys):
    """`convert target SRC OUT --force` never replaces a directory that pjax did not write."""
    other = tmp_path / "other_model"
    other.mkdir()
    for f in hf_dir.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    before = snapshot(other)
    assert cli_main(["target", str(hf_dir), str(other), "--force"]) == 2
    err = capsys.readouterr().err
    assert f"{other}: already exists and is not a pjax output" in err and err.count("\n") == 1
    assert snapshot(other) == before and hidden(tmp_path) == []


def test_force_refuses_the_source_and_nested_paths(hf_dir, tmp_path, capsys):
    before = snapshot(hf_dir)
    assert cli_main(["target", str(hf_dir), str(hf_dir), "--force"]) == 2
    assert f"{hf_dir}: is the source" in capsys.readouterr().err
    assert cli_main(["target", str(hf_dir), str(hf_dir / "copy"), "--force"]) == 2
    assert f"{hf_dir / 'copy'}: lies inside the source {hf_dir}" in capsys.readouterr().err
    assert snapshot(hf_dir) == before and not (hf_dir / "copy").exists()
    # a pjax output is still refused when it is the source (or holds it)
    native = tmp_path / "native"
    assert cli_main(["target", str(hf_dir), str(native), "--dtype", "f32"]) == 0
    kept = snapshot(native)
    assert cli_main(["target", str(native), str(native), "--force"]) == 2
    assert "is the source" in capsys.readouterr().err
    with pytest.raises(pjax.OutputError, match=r"contains the source"):
        files.prepare_output(native, force=True, kind="target", sources=[native / "params"])
    assert snapshot(native) == kept and hidden(tmp_path) == []


def test_force_replaces_a_previous_output_of_the_same_kind(hf_dir, tmp_path, capsys):
    out = tmp_path / "native"
    assert cli_main(["target", str(hf_dir), str(out), "--dtype", "f32"]) == 0
    assert files.output_kind(out) == "target"
    assert cli_main(["target", str(hf_dir), str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert cli_main(["target", str(hf_dir), str(out), "--force"]) == 0
    assert json.loads((out / "pjax_target.json").read_text())["dtype"] == "bfloat16"
    assert pjax.load_target(out).dtype == jnp.bfloat16
    assert sorted(os.listdir(tmp_path)) == ["native"]  # no temporaries, no old copy
    # an empty directory holds nothing to lose: --force uses it
    (tmp_path / "empty").mkdir()
    assert cli_main(["target", str(hf_dir), str(tmp_path / "empty")]) == 2
    assert "already exists (an empty directory" in capsys.readouterr().err
    assert cli_main(["target", str(hf_dir), str(tmp_path / "empty"), "--force"]) == 0
    assert files.output_kind(tmp_path / "empty") == "target"
    # a file, or a pjax output of another kind, is refused even with --force
    (tmp_path / "afile").write_text("keep me")
    assert cli_main(["target", str(hf_dir), str(tmp_path / "afile"), "--force"]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert (tmp_path / "afile").read_text() == "keep me"
    with files.write_output_dir(tmp_path / "bench", force=False, kind="bench") as d:
        (d / "result.json").write_text("{}")
    assert cli_main(["target", str(hf_dir), str(tmp_path / "bench"), "--force"]) == 2
    assert "is a pjax bench output, not a target one" in capsys.readouterr().err
    assert (tmp_path / "bench" / "result.json").exists()


def test_save_drafter_follows_the_rule(drafter, tmp_path, capsys):
    head = pjax.save_drafter(drafter, tmp_path / "head", dtype="float32")
    marker = json.loads((head / files.OUTPUT_MARKER).read_text())
    assert marker["format"] == "pjax-output" and marker["kind"] == "drafter" and marker["version"] == 1
    assert files.output_kind(head) == "drafter"
    with pytest.raises(pjax.OutputError, match="already exists"):
        pjax.save_drafter(drafter, head)
    pjax.save_drafter(drafter, head, overwrite=True)  # bf16 now
    assert json.loads((head / "config.json").read_text())["dtype"] == "bfloat16"
    assert sorted(os.listdir(tmp_path)) == ["head"]
    # a head pjax did not write (a downloaded checkpoint) is never replaced
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    for f in ("config.json", "model.safetensors"):
        (foreign / f).write_bytes((head / f).read_bytes())
    before = snapshot(foreign)
    with pytest.raises(pjax.OutputError, match="is not a pjax output"):
        pjax.save_drafter(drafter, foreign, overwrite=True)
    assert cli_main(["drafter", str(foreign), str(foreign), "--force"]) == 2
    assert "is the source" in capsys.readouterr().err
    assert cli_main(["drafter", str(head), str(head), "--force"]) == 2
    assert snapshot(foreign) == before and sorted(os.listdir(tmp_path)) == ["foreign", "head"]


def test_write_output_dir_is_atomic(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(RuntimeError):
        with files.write_output_dir(out, force=False, kind="bench") as d:
            (d / "partial.json").write_text("{}")
            raise RuntimeError("writer failed")
    assert os.listdir(tmp_path) == []
    with files.write_output_dir(out, force=False, kind="bench", metadata={"rounds": 3}) as d:
        assert d.parent == tmp_path and d.name.startswith(".run.tmp-")
        (d / "a.json").write_text("1")
    assert sorted(os.listdir(out)) == ["a.json", files.OUTPUT_MARKER]
    assert json.loads((out / files.OUTPUT_MARKER).read_text())["rounds"] == 3
    with files.write_output_dir(out, force=True, kind="bench") as d:
        (d / "b.json").write_text("2")
    assert sorted(os.listdir(out)) == ["b.json", files.OUTPUT_MARKER] and os.listdir(tmp_path) == ["run"]


def test_replacement_renames_the_old_output_aside(tmp_path):
    """An older output of the same kind is renamed aside, the new one renamed in, the old one removed."""
    for n in range(2):
        with files.write_output_dir(tmp_path / "run", force=True, kind="bench") as d:
            (d / f"{n}.json").write_text("{}")
    assert sorted(os.listdir(tmp_path / "run")) == ["1.json", files.OUTPUT_MARKER]
    assert os.listdir(tmp_path) == ["run"]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid  # reaped: no process has this id now (reuse within the test is vanishingly unlikely)


def test_stale_temporaries_are_removed(tmp_path):
    dead = _dead_pid()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        names = {f".out.tmp-{dead}-0123abcd": False, f".out.old-{dead}-0123abcd": False,
                 ".out.tmp-deadbeef": False,  # the pattern of copies written before the pid was recorded
                 f".out.tmp-{live.pid}-0123abcd": True,  # a writer still running: kept
                 f".other.tmp-{dead}-0123abcd": True, ".out.tmpx": True, "out.tmp-1-0123abcd": True}
        for n in names:
            (tmp_path / n).mkdir()
            (tmp_path / n / "blob").write_bytes(b"x" * 100)
        files.prepare_output(tmp_path / "out", force=False, kind="target")
        assert sorted(os.listdir(tmp_path)) == sorted(n for n, keep in names.items() if keep)
    finally:
        live.kill()
        live.wait()


WRITER = """
import sys, time
from pathlib import Path
from pjax.checkpoint import write_output_dir
with write_output_dir(Path(sys.argv[1]), force=False, kind="bench") as d:
    (d / "blob").write_bytes(b"x" * (8 << 20))
    print("WRITING", flush=True)
    time.sleep(120)
"""

NATIVE_WRITER = """
import json, sys, time
from pathlib import Path
import jax.numpy as jnp
import pjax
from pjax.checkpoint import native
src, out, stage = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
target = pjax.load_target(src, dtype=jnp.float32)
real_save, real_json = native._save_params, native.write_json

def save(directory, params):  # the signal arrives while orbax writes: it is held until the write ends
    print("WRITING", flush=True)
    time.sleep(3)
    real_save(directory, params)

def write_json(path, obj):  # the orbax write has landed, the conversion is stopped before it completes
    real_json(path, obj)
    print("WRITING", flush=True)
    time.sleep(120)

if stage == "orbax":
    native._save_params = save
else:
    native.write_json = write_json
native.save_native_target(target, json.loads((src / "config.json").read_text()), out)
"""


def _interrupt(script, args, sig):
    p = subprocess.Popen([sys.executable, "-c", script, *map(str, args)], cwd=ROOT, env=ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 240
        line = ""
        while "WRITING" not in line and time.time() < deadline:
            line = p.stdout.readline()
            if not line and p.poll() is not None:
                raise AssertionError(f"writer exited early: {p.stderr.read()}")
        p.send_signal(sig)
        _, err = p.communicate(timeout=120)  # drains both pipes while waiting: a full pipe cannot stall the exit
        return p.returncode, err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupted_writer_leaves_nothing(tmp_path, sig):
    rc, err = _interrupt(WRITER, [tmp_path / "out"], sig)
    assert rc != 0
    if sig == signal.SIGTERM:
        assert rc == 128 + signal.SIGTERM, err
    assert os.listdir(tmp_path) == [], err


@pytest.mark.parametrize("stage", ["orbax", "after"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupted_native_conversion_leaves_nothing(hf_dir, tmp_path, sig, stage):
    rc, err = _interrupt(NATIVE_WRITER, [hf_dir, tmp_path / "native", stage], sig)
    assert rc != 0
    if stage == "orbax":  # held until orbax's background writes end, so none lands after the cleanup
        assert "stopping once the orbax write in progress has finished" in err
    assert os.listdir(tmp_path) == [], err


def test_unwritable_location_is_one_line(hf_dir, drafter, tmp_path):
    (tmp_path / "afile").write_text("")
    bad = tmp_path / "afile" / "out"
    with pytest.raises(pjax.OutputError, match=rf"{bad}: cannot create the output directory here"):
        pjax.save_drafter(drafter, bad)
    r = subprocess.run([sys.executable, "-m", "convert", "target", str(hf_dir), str(bad)], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and str(bad) in lines[0] and "is not a directory" in lines[0], r.stderr


@pytest.mark.parametrize("argv", [
    ["target", "HF", "OUT", "--dtype", "f8"],  # bad choice
    ["inspect"],  # missing argument
    ["nosuchcommand"],
    ["inspect", "MISSING"],  # no such directory
    ["drafter", "MISSING", "OUT"],
])
def test_cli_exit_codes(argv, tmp_path, capsys):
    argv = [a.replace("MISSING", str(tmp_path / "missing")).replace("OUT", str(tmp_path / "o")) for a in argv]
    with pytest.raises(SystemExit) as e:
        raise SystemExit(cli_main(argv))
    assert e.value.code == 2
    assert not (tmp_path / "o").exists()
