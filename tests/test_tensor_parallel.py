"""Tensor- and expert-parallel decoding on a ("data", "model") mesh of 8 fake CPU devices: the weights are placed as
planned (per-device bytes = 1/n of each split weight), loading never copies a whole split tensor to a device, and the
sharded engine emits the single-device tokens (greedy: plain greedy decoding, token for token; sampled: the same
seeds give the same tokens), also with the Pallas kernels running per shard (`pjax.models.per_shard`).

The suite's process has 4 devices (conftest.py), and JAX fixes the device count when it starts: `test_on_8_devices`
runs this module again in one subprocess with 8 (the tests below it skip in the 4-device process, the subprocess
skips the driver). The two-process `jax.distributed` run (two subprocesses of 4 devices each, `tp_distributed.py`)
is a driver-level test."""
import functools
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import pjax
from pjax.check.families import FAMILIES
from pjax.checkpoint.hf_export import save_hf_target
from pjax.decode import Engine, EngineConfig, RequestParams
from pjax.models import sharding as SH
from pjax.models.families import config_from_hf
from pjax.models.target import abstract_target, target_logits

from engine_utils import FAST, make_drafter

HERE = Path(__file__).resolve().parent
EIGHT = jax.device_count() == 8
inner = pytest.mark.skipif(not EIGHT, reason="runs in the 8-device subprocess of test_on_8_devices")
V = 128  # divisible by every mesh's model axis: the vocabulary is split
# the tiny families (pjax.check.families) with 8 query heads, so that 8 devices split them; KV heads 2 (replicated
# over 4 or 8 devices, split over 2) or 8 (qwen3: split everywhere); MoE with 8 experts
OVERRIDES = {"llama": dict(num_attention_heads=8, num_key_value_heads=2),
             "qwen3": dict(num_attention_heads=8, num_key_value_heads=8, head_dim=8),
             "qwen3_moe": dict(num_attention_heads=8, num_key_value_heads=2, num_experts=8),
             "gpt_oss": dict(num_attention_heads=8, num_key_value_heads=2, num_local_experts=8),
             "gemma4": dict(num_attention_heads=8, num_key_value_heads=2, model_type="gemma4_text")}
PROMPTS = [[5, 17, 3], [9, 1, 44, 60, 2, 71, 33, 8, 90, 12, 4], [30, 31, 32, 33, 34, 35]]
NEW = 10
K = 7  # K + 1 > the sliding window (6) of gpt_oss and gemma4


@functools.lru_cache(maxsize=None)
def tp_target(family: str):
    """A float32 target of the tiny family's geometry (OVERRIDES), every weight random (norms 1 + noise, biases and
    sinks too)."""
    kw = dict(FAMILIES[family][2], vocab_size=V, model_type=family)
    t = abstract_target(config_from_hf(dict(kw, **OVERRIDES[family])), jnp.float32)
    leaves, tree = jax.tree.flatten_with_path(t.params)
    rng = np.random.default_rng(1)
    out = []
    for path, x in leaves:
        noise = rng.standard_normal(x.shape).astype(np.float32)
        norm = str(getattr(path[-1], "key", "")) in ("weight", "layer_scalar")
        out.append(jnp.asarray(1 + 0.1 * noise if norm else 0.3 * noise))
    return pjax.Target(t.config, t.graphdef, jax.tree.unflatten(tree, out))


@functools.lru_cache(maxsize=None)
def tp_drafter(family: str):
    return make_drafter(tp_target(family))


@functools.lru_cache(maxsize=None)
def plain_greedy(family: str) -> list[list[int]]:
    """Plain greedy continuations of PROMPTS on one device: one full causal forward per token (one program)."""
    target = tp_target(family)
    total = max(map(len, PROMPTS)) + NEW
    tokens = np.zeros((len(PROMPTS), total), np.int32)
    lengths = np.array([len(p) for p in PROMPTS])
    for i, p in enumerate(PROMPTS):
        tokens[i, :len(p)] = p
    for _ in range(NEW):
        logits = np.asarray(target_logits(target, jnp.asarray(tokens)))
        tokens[np.arange(len(PROMPTS)), lengths] = logits[np.arange(len(PROMPTS)), lengths - 1].argmax(-1)
        lengths += 1
    return [tokens[i, len(p):len(p) + NEW].tolist() for i, p in enumerate(PROMPTS)]


def spec_of(x) -> P:
    return x.sharding.spec


def device_bytes(tree) -> dict:
    """Bytes each device holds of the arrays of `tree`."""
    out = {}
    for x in jax.tree.leaves(tree):
        for s in x.addressable_shards:
            out[s.device] = out.get(s.device, 0) + s.data.nbytes
    return out


def planned_bytes(tree, n: int) -> int:
    """Per-device bytes by the plan: 1/n of each leaf split over "model", all of a replicated one."""
    return sum(x.nbytes // (n if SH.MODEL_AXIS in tuple(spec_of(x)) else 1) for x in jax.tree.leaves(tree))


# ---------------------------------------------------------------------------------------------------- the driver

@pytest.mark.skipif(EIGHT, reason="the 8-device subprocess itself")
def test_on_8_devices(request):
    """This module's tests in one subprocess with 8 fake CPU devices."""
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")  # the suite's flags (conftest.py), the device count replaced
    args = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(Path(__file__))]
    if request.config.getoption("--full"):
        args.append("--full")
    run = subprocess.run(args, env=env, cwd=HERE.parent, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and " failed" not in run.stdout, run.stdout[-3000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.full
@pytest.mark.skipif(EIGHT, reason="a driver-level test")
def test_two_processes(tmp_path):
    """Two processes of 4 devices each (`jax.distributed` on 127.0.0.1) decode on one 2 x 4 mesh (rows split between
    the processes, weights within each): both print the single-process tokens."""
    family = "llama"
    save_hf_target(tp_target(family), tmp_path / "target", dtype="float32")
    pjax.save_drafter(tp_drafter(family), tmp_path / "head", dtype="float32")
    port = _free_port()
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu", PYTHONPATH=str(HERE.parent))
    procs = [subprocess.Popen([sys.executable, str(HERE / "tp_distributed.py"), str(i), str(port), str(tmp_path),
                               json.dumps(PROMPTS), str(NEW), str(K)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    want = plain_greedy(family)
    for out, _ in outs:
        assert json.loads(out.strip().splitlines()[-1]) == want


# ---------------------------------------------------------------------------------------------------- the plan

@inner
@pytest.mark.parametrize("family", list(OVERRIDES))
def test_plan_and_bytes(family):
    """Every weight gets its planned sharding on 1 x 8 and 2 x 4 meshes, and each device holds 1/n of each split
    weight (the replicated ones whole)."""
    target = tp_target(family)
    for data, model in ((1, 8), (2, 4)):
        mesh = pjax.make_mesh(data, model)
        for experts in ("expert", "intermediate") if family == "qwen3_moe" else ("expert",):
            placed = pjax.models.place_target(target, mesh, experts)
            params = placed.params
            layer = params["layers"][0]
            att = layer["self_attn"]
            kv = SH.MODEL_AXIS if target.config.layers[0].num_kv_heads % model == 0 else None
            assert spec_of(att["q_proj"]["kernel"]) == P(None, "model")
            assert spec_of(att["o_proj"]["kernel"]) == P("model", None)
            assert spec_of(att["k_proj"]["kernel"]) == P(None, kv)
            assert spec_of(params["embed_tokens"]["embedding"]) == P("model", None)
            if "lm_head" in params:
                assert spec_of(params["lm_head"]["kernel"]) == P(None, "model")
            assert spec_of(params["norm"]["weight"]) == P()
            mlp = layer["mlp"]
            if "gate_up" in mlp:
                want = (P("model", None, None), P("model", None, None)) if experts == "expert" else (
                    P(None, None, "model"), P(None, "model", None))
                assert (spec_of(mlp["gate_up"]), spec_of(mlp["down"])) == want
                assert spec_of(mlp["router"]["kernel"]) == P()
            else:
                assert spec_of(mlp["gate_proj"]["kernel"]) == P(None, "model")
                assert spec_of(mlp["down_proj"]["kernel"]) == P("model", None)
            if family == "gpt_oss":
                assert spec_of(att["sinks"]) == P("model")
            got = device_bytes(params)
            assert len(got) == 8 and set(got.values()) == {planned_bytes(params, model)}
            split = sum(x.nbytes for x in jax.tree.leaves(params) if SH.MODEL_AXIS in tuple(spec_of(x)))
            assert split > 0.5 * sum(x.nbytes for x in jax.tree.leaves(params))  # most bytes are split


# ---------------------------------------------------------------------------------------------------- loading

@inner
def test_loading_places_slices(tmp_path, monkeypatch):
    """load_target(mesh=) reads each tensor into its shards: every block a device receives is its slice (never a
    whole split tensor), the placement and per-device bytes are the plan's, and the values are the unsharded
    load's; load_drafter(mesh=) replicates the head."""
    target, drafter = tp_target("llama"), tp_drafter("llama")
    save_hf_target(target, tmp_path / "target", dtype="float32")
    pjax.save_drafter(drafter, tmp_path / "head", dtype="float32")
    mesh = pjax.make_mesh(1, 8)
    blocks = []  # (global shape, block shape) of every block handed to a device
    real = jax.make_array_from_callback

    def spy(shape, sharding, callback, *a, **kw):
        def record(idx):
            block = callback(idx)
            blocks.append((tuple(shape), block.shape, sharding.spec))
            return block
        return real(shape, sharding, record, *a, **kw)
    monkeypatch.setattr(jax, "make_array_from_callback", spy)
    loaded = pjax.load_target(tmp_path / "target", jnp.float32, mesh=mesh)
    n_leaves = len(jax.tree.leaves(loaded.params))
    assert len({b[0] for b in blocks}) > 1 and len(blocks) >= n_leaves  # every tensor came through the callback
    for shape, block, spec in blocks:
        assert block == tuple(d // (8 if ax == "model" else 1) for d, ax in zip(shape, tuple(spec) + (None,) * 4))
    placed = pjax.models.place_target(target, mesh)
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(placed.params)):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert set(device_bytes(loaded.params).values()) == {planned_bytes(loaded.params, 8)}
    head = pjax.load_drafter(tmp_path / "head", jnp.float32, target=loaded, mesh=mesh)
    assert all(x.sharding.is_fully_replicated and len(x.sharding.device_set) == 8 for x in jax.tree.leaves(head))


# ---------------------------------------------------------------------------------------------------- decoding

CASES = [(f, m, e) for m in ((1, 2), (1, 4), (1, 8), (2, 4)) for f in OVERRIDES
         for e in (("expert", "intermediate") if f == "qwen3_moe" else ("expert",))]
DEFAULT = {("gpt_oss", (1, 8), "expert")}  # sinks, sliding windows, experts over 8 devices, heads over 8


@inner
@pytest.mark.parametrize("family,mesh_shape,experts", [
    pytest.param(*c, marks=() if c in DEFAULT else pytest.mark.full, id=f"{c[0]}-{c[1][0]}x{c[1][1]}-{c[2]}")
    for c in CASES])
def test_sharded_greedy(family, mesh_shape, experts):
    """P-EAGLE generation on the mesh (target split, head replicated) == plain single-device greedy, token for
    token."""
    mesh = pjax.make_mesh(*mesh_shape)
    target = pjax.models.place_target(tp_target(family), mesh, experts)
    res = pjax.generate(target, tp_drafter(family), PROMPTS, max_new_tokens=NEW, num_speculative_tokens=K, mesh=mesh,
                        compiler_options=FAST)
    assert res.tokens == plain_greedy(family)


PALLAS = [("llama", (1, 2), None, "expert"), ("qwen3_moe", (2, 4), None, "expert"), ("llama", (1, 2), 12, "expert"),
          ("llama", (2, 4), 12, "expert"), ("qwen3_moe", (1, 2), 12, "expert"), ("qwen3_moe", (1, 8), None, "expert"),
          ("qwen3_moe", (2, 4), None, "intermediate"), ("gpt_oss", (1, 8), None, "expert"),
          ("gemma4", (1, 4), None, "expert"), ("qwen3", (2, 4), 12, "expert")]
PALLAS_DEFAULT = PALLAS[1:2]  # rows split, KV heads replicated, experts split (KV heads split: the test below)


@inner
@pytest.mark.parametrize("family,mesh_shape,tree_budget,experts", [
    pytest.param(*c, marks=() if c in PALLAS_DEFAULT else pytest.mark.full,
                 id=f"{c[0]}-{c[1][0]}x{c[1][1]}-{c[2]}-{c[3]}") for c in PALLAS])
def test_pallas_per_shard(family, mesh_shape, tree_budget, experts):
    """implementation="pallas" on the mesh (the kernels per shard, interpret mode) == plain single-device greedy
    decoding with the XLA ops, token for token; tree_budget: each round verifies a draft tree (the tree mask);
    experts "intermediate": the MoE runs its XLA reference, the attention per shard."""
    data, _ = mesh_shape
    mesh = pjax.make_mesh(*mesh_shape)
    target = pjax.models.place_target(tp_target(family), mesh, experts)
    res = pjax.generate(target, tp_drafter(family), PROMPTS, max_new_tokens=NEW, num_speculative_tokens=K, mesh=mesh,
                        compiler_options=FAST, implementation="pallas", tree_budget=tree_budget,
                        prefill="padded" if data > 1 else "auto")  # both prefill layouts' flash attention
    assert res.tokens == plain_greedy(family)


@inner
def test_cache_attention_per_shard():
    """Cache attention per shard on a 2 x 2 mesh (rows on "data", query and KV heads on "model") over a draft tree with
    sinks and a sliding window, traced under the mesh as the engine traces its programs == the one-device
    reference."""
    from jax.sharding import NamedSharding
    from pjax.kernels.cache_attention import TreeMask, reference
    from pjax.models import per_shard
    mesh = pjax.make_mesh(2, 2)
    b, t, s, nh, nkv, hd = 2, 5, 24, 4, 2, 16
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in ((b, t, nh, hd), (b, s, nkv, hd),
                                                                           (b, s, nkv, hd)))
    start = np.array([9, 14], np.int32)
    parent = np.array([-1, 0, 0, 1, 2])  # a root, two children, a grandchild under each
    depth = np.array([0, 1, 1, 2, 2])
    visible = np.zeros((t, t), bool)
    for i in range(t):
        j = i
        while j >= 0:
            visible[i, j], j = True, parent[j]
    args = dict(q=q, k=k, v=v, q_pos=start[:, None] + depth[None], sinks=rng.standard_normal(nh).astype(np.float32),
                tree=TreeMask(start, np.broadcast_to(visible, (b, t, t))))
    kw = dict(scale=hd ** -0.5, window=8)

    def sharded(a):
        with per_shard.traced_on(mesh):
            return per_shard.cache_attention(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("q_pos"),
                                             implementation="pallas", **a, **kw)
    placed = jax.device_put(args, NamedSharding(mesh, P()))
    got = jax.jit(sharded)(placed)
    want = reference.cache_attention(**{n: jnp.asarray(x) for n, x in args.items() if n != "tree"},
                                     tree=jax.tree.map(jnp.asarray, args["tree"]), **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@inner
def test_kernels_run_per_shard():
    """Traced under a 2 x 4 mesh with implementation="pallas", the engine's chunk program runs cache attention and
    the expert matmul inside shard_map, the prefill the flash attention and grouped matmul kernels; no kernel runs on
    whole arrays (acceptance and the drafter's inputs run their references over the split vocabulary)."""
    from pjax.decode import Sampling, make_spec, prefill
    from pjax.decode.engine import fixed_chunk
    from pjax.models.per_shard import traced_on
    from kernel_jaxpr import shard_kernel_names
    mesh = pjax.make_mesh(2, 4)
    target, drafter = pjax.models.place_target(tp_target("qwen3_moe"), mesh), tp_drafter("qwen3_moe")
    spec = make_spec(target, drafter, EngineConfig(num_speculative_tokens=3, implementation="pallas"),
                     max_new_tokens=8)
    rows = 4
    sampling = Sampling(jnp.zeros((rows,)), jnp.zeros((rows,), jnp.int32), jnp.ones((rows,)),
                        jnp.zeros((rows,), jnp.uint32))
    prompts, lengths = jnp.ones((rows, 16), jnp.int32), jnp.full((rows,), 16, jnp.int32)

    def prefilled(t, d, p, n, s):
        with traced_on(mesh, t.experts):
            return prefill(t, d, p, n, s, spec=spec, capacity=32)
    inside, outside = shard_kernel_names(prefilled, target, drafter, prompts, lengths, sampling)
    assert {"pjax_flash_attention_fwd", "pjax_grouped_matmul"} <= inside and not outside, (inside, outside)
    state = jax.eval_shape(prefilled, target, drafter, prompts, lengths, sampling)
    chunk = functools.partial(fixed_chunk, spec=spec, rounds=1, mesh=mesh)
    inside, outside = shard_kernel_names(chunk, target, drafter, state, sampling)
    assert {"pjax_cache_attention", "pjax_cache_attention_merge", "pjax_expert_matmul"} <= inside and not outside, (
        inside, outside)


@inner
def test_engine_sharded_requests():
    """The serving engine on a 2 x 4 mesh (2 slots, one per data row; 4 requests joining as slots free, greedy and
    sampled with top-k / top-p) gives each request the tokens it gets on one device."""
    family = "llama"
    reqs = [([5, 17, 3], RequestParams(NEW)),
            ([9, 1, 44, 60, 2, 71], RequestParams(NEW, temperature=1.0, seed=3)),
            ([30, 31, 32], RequestParams(NEW, temperature=0.8, top_k=20, top_p=0.9, seed=7)),
            ([7], RequestParams(6, stop_token_ids=(plain_greedy(family)[0][2],)))]
    cfg = EngineConfig(max_slots=2, max_len=64, max_admit_rows=1, rounds_per_step=4, num_speculative_tokens=3,
                       compiler_options=FAST)  # two programs: a one-row admission, the chunk that ends

    def serve(mesh):
        eng = Engine(tp_target(family), tp_drafter(family), cfg, mesh=mesh)
        ids = [eng.submit(p, r) for p, r in reqs]
        out = {i: [] for i in ids}
        while eng.has_work:
            for ev in eng.step():
                out[ev.request_id] += ev.new_tokens
        return [out[i] for i in ids]
    one = serve(None)
    assert one[0] == plain_greedy(family)[0]
    assert serve(pjax.make_mesh(2, 4)) == one


@inner
def test_mesh_settings_and_errors():
    """--tensor-parallel N of the server and the benchmark is a 1 x N mesh of the first N devices; an engine refuses
    a data axis that does not divide its slots and a mesh without the axes "data" and "model", naming them."""
    from pjax.bench.cli import build_parser as bench_parser
    from pjax.decode.settings import mesh_from_flags
    from pjax.serve.cli import build_parser as serve_parser
    serve = serve_parser().parse_args(["--target", "x", "--tensor-parallel", "4"])
    mesh = mesh_from_flags(serve)
    assert dict(mesh.shape) == {"data": 1, "model": 4} and list(mesh.devices.flat) == jax.devices()[:4]
    bench = bench_parser().parse_args(["--target", "x", "--out", "y"])
    assert bench.tensor_parallel == 1 and mesh_from_flags(bench) is None
    with pytest.raises(ValueError, match="--tensor-parallel 16: only 8"):
        mesh_from_flags(bench_parser().parse_args(["--target", "x", "--out", "y", "--tensor-parallel", "16"]))
    with pytest.raises(ValueError, match="make_mesh: model=3 does not divide the 8 devices"):
        pjax.make_mesh(model=3)
    target = tp_target("llama")
    with pytest.raises(ValueError, match="max_slots: the mesh's 3 data-parallel rows must divide the 4 slots"):
        Engine(target, None, EngineConfig(max_slots=4, drafting="none"), mesh=pjax.make_mesh(3, 2))
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh with axes 'data' and 'model'"):
        Engine(target, None, EngineConfig(drafting="none"), mesh=jax.make_mesh((2,), ("x",)))


@inner
@pytest.mark.full
def test_native_copy_loads_on_mesh(tmp_path):
    """A pjax-native copy restores straight into the planned shards (MoE split by intermediate dimension here)."""
    target = tp_target("qwen3_moe")
    hf = dict(FAMILIES["qwen3_moe"][2], vocab_size=V, model_type="qwen3_moe", **OVERRIDES["qwen3_moe"])
    pjax.save_native_target(target, hf, tmp_path / "native")
    mesh = pjax.make_mesh(2, 4)
    loaded = pjax.load_target(tmp_path / "native", jnp.float32, mesh=mesh, experts="intermediate")
    placed = pjax.models.place_target(target, mesh, "intermediate")
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(placed.params)):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@inner
@pytest.mark.full
def test_bench_tensor_parallel(tmp_path, capsys):
    """python -m pjax bench --tensor-parallel 2 on a random target: the run completes, exact against plain decoding."""
    from pjax.bench.cli import main
    rc = main(["--target", "random:tiny", "--head", "random:1", "--drafting", "parallel,none", "--k", "3",
               "--prompt-len", "8", "--num-prompts", "2", "--max-new-tokens", "8", "--tensor-parallel", "2",
               "--no-progress", "--out", str(tmp_path / "out")])
    assert rc == 0 and re.search(r"parallel K=3 c=1: .*, exact 2/2", capsys.readouterr().out)
    assert "tensor parallel over 2 devices" in (tmp_path / "out" / "bench.md").read_text()


@inner
def test_accept_over_split_vocabulary():
    """The acceptance rule on logits split by vocabulary over 8 devices (as the LM head leaves them) gives the
    one-device tokens: greedy rows with the top logit tied across shards (lowest id wins), sampled rows with and
    without top-k / top-p."""
    from jax.sharding import NamedSharding
    from pjax.kernels import accept
    b, k = 8, 3
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((b, k + 1, V)).astype(np.float32)
    logits[:, :, [5, 37, 100]] = logits.max() + 1.0  # ties in three shards of 16 lanes
    drafts = np.where(rng.random((b, k)) < 0.5, 5, rng.integers(0, V, (b, k))).astype(np.int32)
    kw = dict(temperature=jnp.asarray([0, 0, 1, 1, 0.7, 0.7, 1.3, 1.3], jnp.float32),
              top_k=jnp.asarray([0, 0, 0, 0, 10, 0, 40, 2], jnp.int32),
              top_p=jnp.asarray([1, 1, 1, 0.9, 1, 0.5, 0.8, 1], jnp.float32),
              seeds=jnp.arange(b, dtype=jnp.uint32), positions=jnp.full((b,), 9, jnp.int32),
              num_drafts=jnp.full((b,), k, jnp.int32), implementation="xla")
    one = accept(jnp.asarray(logits), jnp.asarray(drafts), **kw)
    split = jax.device_put(logits, NamedSharding(pjax.make_mesh(1, 8), P(None, None, "model")))
    got = accept(split, jnp.asarray(drafts), **kw)
    for a, c in zip(one, got):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    greedy = np.asarray(one.tokens)[:2]
    assert (greedy[greedy >= 0] == 5).all()  # the lowest of the tied ids, in the first shard
