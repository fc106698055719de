"""The converter command: inspect / validate checkpoints, write pjax-native copies, re-export heads.

    inspect PATH [--json]                 a target (Hugging Face or pjax-native) or a drafter head (either
                                          layout): kind, geometry, on-disk dtypes; full validation
    target HF_DIR OUT_DIR [--dtype bf16]  pjax-native (orbax) copy of a target, written atomically
    drafter SRC OUT_DIR [--target DIR]    a P-EAGLE / EAGLE-3 head (either layout) re-written in the speculators format

Run as `python -m pjax convert ...` (or `python -m convert ...` from a checkout). Exit status: 0 done; 2 bad
usage or bad input (a malformed checkpoint, a refused or unwritable output: one line `error: ...` on stderr);
130 interrupted. --force replaces only an OUT_DIR that pjax wrote before (same kind); never the source.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import jax.numpy as jnp

from pjax._io import NATIVE_MARKER, OutputError, prepare_output
from pjax.checkpoint.errors import CheckpointError
from pjax.checkpoint.files import read_hf_config
from pjax.checkpoint.heads import describe_head, load_drafter, save_drafter
from pjax.checkpoint.hf import load_hf_params, read_target_config
from pjax.checkpoint.native import load_native_target, param_count, read_marker, save_native_target
from pjax.checkpoint.safetensors import Checkpoint
from pjax.checkpoint.target import load_target
from pjax.command import run_command
from pjax.config import ConfigError
from pjax.dtypes import parse_dtype

def _dtype_flag(value: str):
    try:
        return parse_dtype(value, what="--dtype")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _dtype_arg(p, default="bf16", what="parameter dtype of the copy"):
    p.add_argument("--dtype", default=default, type=_dtype_flag, metavar="{bf16,f32,f16}",
                   help=f"{what}: bf16 (default), f32, f16 (or bfloat16, float32, float16)")


def _check_args(p, verify: bool = True):
    p.add_argument("--no-finite-check", action="store_true",
                   help="accept NaN / inf weights (by default every floating tensor is checked, on device)")
    if verify:
        p.add_argument("--no-verify", action="store_true",
                       help="skip comparing a pjax-native copy's per-tensor checksums (faster load; file presence "
                            "and sizes are still checked)")


def _dtype_counts(ckpt: Checkpoint) -> dict:
    dtypes, nbytes = Counter(), Counter()
    for f in ckpt.files.values():
        for name in f.keys():
            dt = f.header[name]["dtype"]
            dtypes[dt] += 1
            nbytes[dt] += f.nbytes(name)
    return {k: {"tensors": dtypes[k], "bytes": nbytes[k]} for k in sorted(dtypes)}


# ------------------------------------------------------------------------------------------- inspect
def _inspect_args(p):
    p.add_argument("path", help="Hugging Face model directory, pjax-native copy, or drafter head directory")
    p.add_argument("--json", action="store_true", help="print a JSON report instead of text")
    _check_args(p)


def _inspect_head(path: Path, hf: dict, args) -> dict:
    """Full validation of a head (every tensor, shapes, dtypes, d2t / t2d) and its description."""
    drafter = load_drafter(path, dtype=jnp.float32, check_finite=not args.no_finite_check)
    cfg, ckpt = drafter.config, Checkpoint(path)
    return {"path": str(path), "format": "speculators" if "speculators_model_type" in hf else "vllm-native",
            "kind": cfg.model_kind, "model_type": cfg.layer.model_type, "num_layers": cfg.layer.num_layers,
            "hidden_size": cfg.hidden_size, "target_hidden_size": cfg.target_hidden_size,
            "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.draft_vocab_size,
            "mask_token_id": cfg.mask_token_id, "has_mask_hidden": cfg.has_mask_hidden,
            "aux_layer_ids": list(cfg.aux_layer_ids), "num_aux": cfg.num_aux, "num_depths": cfg.num_depths,
            "norms": {k: getattr(cfg, k) for k in ("norm_before_residual", "norm_before_fc", "fc_norm",
                                                    "norm_output")},
            "files": len(ckpt.files), "tensors": len(ckpt.where), "dtypes": _dtype_counts(ckpt),
            "num_params": param_count(drafter.params)}


def _inspect_target(path: Path, args) -> dict:
    hf, cfg = read_target_config(path)
    report = {"path": str(path), "model_type": cfg.model_type, "num_layers": cfg.num_layers,
              "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size}
    if (path / NATIVE_MARKER).exists():
        marker = read_marker(path)
        target = load_native_target(path, jnp.dtype(marker["dtype"]), verify=not args.no_verify,
                                    check_finite=not args.no_finite_check)
        report.update(format="pjax-native", dtype=marker["dtype"], num_params=param_count(target.params),
                      checksums="not checked" if args.no_verify else f"verified ({len(marker['checksums'])} tensors)")
    else:
        ckpt = Checkpoint(path)
        abstract = load_hf_params(path, cfg, hf, jnp.float32, materialize=False,
                                  check_finite=not args.no_finite_check)
        quant = hf.get("quantization_config") or (hf.get("text_config") or {}).get("quantization_config")
        report.update(format="huggingface", files=len(ckpt.files), tensors=len(ckpt.where),
                      dtypes=_dtype_counts(ckpt), quantization=(quant or {}).get("quant_method"),
                      num_params=param_count(abstract.params))
    kinds = Counter(("sliding" if s.sliding_window else "full") + ("+k_eq_v" if s.k_eq_v else "")
                    + ("+moe" if s.moe else "") + f" hd{s.head_dim}/kv{s.num_kv_heads}" for s in cfg.layers)
    report["layers"] = dict(kinds)
    if cfg.moe is not None:
        report["moe"] = {"experts": cfg.moe.num_experts, "top_k": cfg.moe.top_k,
                         "intermediate_size": cfg.moe.intermediate_size}
    return report


def run_inspect(args) -> int:
    path = Path(args.path)
    hf = read_hf_config(path)
    report = _inspect_head(path, hf, args) if describe_head(path, hf) else _inspect_target(path, args)
    report["finite_check"] = "skipped" if args.no_finite_check else "passed"
    report["valid"] = True
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for k, v in report.items():
            print(f"{k:>18}: {v}")
    return 0


# -------------------------------------------------------------------------------------------- target
def _target_args(p):
    p.add_argument("hf_dir", help="Hugging Face model directory (config.json + safetensors)")
    p.add_argument("out_dir", help="output directory (must not exist unless --force)")
    _dtype_arg(p)
    p.add_argument("--force", action="store_true",
                   help="replace OUT_DIR when it is a pjax-native copy written before (anything else is refused)")
    _check_args(p)


def run_target(args) -> int:
    dtype = args.dtype
    prepare_output(args.out_dir, force=args.force, kind="target", sources=[args.hf_dir])  # fail before loading
    target = load_target(args.hf_dir, dtype=dtype, verify=not args.no_verify, check_finite=not args.no_finite_check,
                         weights="dequantized")  # a native copy holds every weight in `dtype`
    out = save_native_target(target, read_hf_config(args.hf_dir), args.out_dir, overwrite=args.force,
                             sources=[args.hf_dir])
    print(f"wrote {out} ({target.config.model_type}, {param_count(target.params):,} params, {dtype.name})")
    return 0


# --------------------------------------------------------------------------------------------- drafter
def _drafter_args(p):
    p.add_argument("src", help="drafter directory (speculators or vLLM-native EAGLE-3 / P-EAGLE layout)")
    p.add_argument("out_dir", help="output directory for the speculators-format copy (must not exist unless --force)")
    _dtype_arg(p, what="floating dtype written")
    p.add_argument("--target", default=None,
                   help="target model directory: validates vocab / width / aux layer ids and supplies "
                        "embed_tokens when the head has none")
    p.add_argument("--verifier", default=None, help="verifier name_or_path recorded in speculators_config")
    p.add_argument("--force", action="store_true",
                   help="replace OUT_DIR when it is a head pjax wrote before (anything else is refused)")
    _check_args(p)


def run_drafter(args) -> int:
    sources = [args.src] + ([args.target] if args.target else [])
    prepare_output(args.out_dir, force=args.force, kind="drafter", sources=sources)  # fail before loading
    check = not args.no_finite_check
    target = load_target(args.target, dtype=jnp.float32, verify=not args.no_verify, check_finite=check) \
        if args.target else None
    drafter = load_drafter(args.src, dtype=jnp.float32, target=target, check_finite=check)
    out = save_drafter(drafter, args.out_dir, dtype=args.dtype.name, verifier_name_or_path=args.verifier,
                       overwrite=args.force, sources=sources)
    cfg = drafter.config
    print(f"wrote {out} ({cfg.model_kind}, {cfg.layer.model_type} x{cfg.layer.num_layers}, "
          f"Vd={cfg.draft_vocab_size}/V={cfg.vocab_size}, mask_token_id={cfg.mask_token_id})")
    return 0


COMMANDS = {
    "inspect": ("validate a target (Hugging Face or pjax-native) or a drafter head: every tensor, shapes, dtypes, "
                "finite values; print its kind, geometry and on-disk dtypes", _inspect_args, run_inspect),
    "target": ("convert a Hugging Face target to a pjax-native (orbax) checkpoint", _target_args, run_target),
    "drafter": ("validate a P-EAGLE / EAGLE-3 head (either layout) and write it in the speculators format",
                _drafter_args, run_drafter),
}


def build_parser(prog: str = "python -m pjax convert") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_, configure, _) in COMMANDS.items():
        configure(sub.add_parser(name, help=help_, description=help_))
    return parser


def main(argv=None, prog: str = "python -m pjax convert") -> int:
    args = build_parser(prog).parse_args(argv)
    return run_command(lambda: COMMANDS[args.command][2](args),
                       user_errors=(CheckpointError, ConfigError, OutputError, OSError))


if __name__ == "__main__":
    sys.exit(main())
