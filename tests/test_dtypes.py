"""One dtype parser for every entry point: the API loaders, generate, the save functions and the CLI flags take the
same spellings and refuse the same dtypes, naming the argument."""
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pjax
from pjax.config import LayerSpec, ModelConfig, RopeSpec
from pjax.dtypes import parse_dtype
from tests.engine_utils import FAST, make_drafter

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny target in the Hugging Face layout (written by transformers) and a head saved by pjax."""
    import torch
    import transformers as tf
    root = tmp_path_factory.mktemp("dtypes")
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2))
    model.save_pretrained(root / "target")
    target = pjax.load_target(root / "target", dtype="float32")
    head = pjax.save_drafter(make_drafter(target), root / "head", dtype="f32")
    return root / "target", head


@pytest.mark.parametrize("spelling,want", [("bf16", jnp.bfloat16), ("BFloat16", jnp.bfloat16), ("fp32", jnp.float32),
                                           (jnp.float16, jnp.float16), (np.dtype("float32"), jnp.float32)])
def test_loaders_take_every_spelling(saved, spelling, want):
    target_dir, head_dir = saved
    target = pjax.load_target(target_dir, dtype=spelling)
    assert target.dtype == want
    assert pjax.load_drafter(head_dir, dtype=spelling, target=target).dtype == want


@pytest.mark.parametrize("bad,match", [(jnp.float64, r"float64 .*64-bit floats are not supported"),
                                       ("int8", r"int8 is not supported here"), ("half-ish", r"'half-ish' is not")])
def test_loaders_refuse_the_same_dtypes(saved, bad, match):
    target_dir, head_dir = saved
    with pytest.raises(ValueError, match=r"load_target dtype=" + match if "'" not in match else match):
        pjax.load_target(target_dir, dtype=bad)
    with pytest.raises(ValueError, match=match):
        pjax.load_drafter(head_dir, dtype=bad)
    with pytest.raises(ValueError, match=match):
        pjax.save_drafter(pjax.load_drafter(head_dir, dtype="f32"), head_dir.parent / "other", dtype=bad)


def test_cli_dtype_flags_use_the_same_parser(saved, tmp_path):
    target_dir, _ = saved
    run = lambda *a: subprocess.run([sys.executable, "-m", "pjax", "convert", "target", str(target_dir),  # noqa: E731
                                     str(tmp_path / a[0]), "--dtype", a[1]], capture_output=True, text=True, cwd=ROOT)
    ok = run("bf", "bfloat16")
    assert ok.returncode == 0, ok.stderr
    bad = run("i8", "int8")
    assert bad.returncode == 2 and "--dtype=int8 is not supported here" in bad.stderr
    assert not (tmp_path / "i8").exists()


def test_parser_names_the_argument():
    with pytest.raises(ValueError, match=r"^cache_dtype=float64 .*expected one of bfloat16, float32, float16"):
        parse_dtype("float64", what="cache_dtype")
    assert parse_dtype("f16", allowed=("float16",)) == jnp.float16
    with pytest.raises(ValueError, match="expected one of float16"):
        parse_dtype("bf16", allowed=("float16",))


def test_generate_cache_dtype_spellings():
    rope = RopeSpec(theta=10000.0)
    cfg = ModelConfig("llama", 61, 32, 64, 4, (LayerSpec(8, 2, rope),) * 2, rms_norm_eps=1e-5)
    target = pjax.init_target(cfg, jax.random.key(0), jnp.float32, scale=0.3)
    drafter = make_drafter(target)
    a = pjax.generate(target, drafter, [[1, 2, 3]], max_new_tokens=4, cache_dtype="bf16", compiler_options=FAST)
    b = pjax.generate(target, drafter, [[1, 2, 3]], max_new_tokens=4, cache_dtype=jnp.bfloat16, compiler_options=FAST)
    assert a.tokens == b.tokens
