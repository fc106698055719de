"""The converter command: inspect / validate checkpoints, write pjax-native copies, re-export heads.

    inspect PATH [--json]                 model type, parameters, on-disk dtypes; full validation
    target HF_DIR OUT_DIR [--dtype bf16]  pjax-native (orbax) copy of a target, written atomically
    drafter SRC OUT_DIR [--target DIR]    a P-EAGLE / EAGLE-3 head (either layout) re-written in the speculators format

Run as `python -m pjax convert ...` (or `python -m convert ...` from a checkout). Errors (CheckpointError /
ConfigError) print one line and exit with status 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import jax.numpy as jnp

from pjax.checkpoint.errors import CheckpointError
from pjax.checkpoint.files import NATIVE_MARKER, read_hf_config
from pjax.checkpoint.heads import load_drafter, save_drafter
from pjax.checkpoint.hf import load_hf_params, read_target_config
from pjax.checkpoint.native import load_native_target, param_count, read_marker, save_native_target
from pjax.checkpoint.safetensors import Checkpoint
from pjax.checkpoint.target import load_target
from pjax.config import ConfigError

DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "f32": "float32", "float32": "float32",
          "f16": "float16", "float16": "float16"}


def _dtype(name: str):
    if name not in DTYPES:
        raise SystemExit(f"unknown --dtype {name!r} (choose from {sorted(DTYPES)})")
    return jnp.dtype(DTYPES[name])


# ------------------------------------------------------------------------------------------- inspect
def _inspect_args(p):
    p.add_argument("path", help="Hugging Face model directory or pjax-native directory")
    p.add_argument("--json", action="store_true", help="print a JSON report instead of text")
    p.add_argument("--no-finite-check", action="store_true", help="skip the NaN/inf scan of every tensor")


def run_inspect(args) -> int:
    path = Path(args.path)
    hf, cfg = read_target_config(path)
    report = {"path": str(path), "model_type": cfg.model_type, "num_layers": cfg.num_layers,
              "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size}
    if (path / NATIVE_MARKER).exists():
        marker = read_marker(path)
        target = load_native_target(path, jnp.dtype(marker["dtype"]))
        report.update(format="pjax-native", dtype=marker["dtype"], num_params=param_count(target.params))
    else:
        ckpt = Checkpoint(path)
        dtypes, nbytes = Counter(), Counter()
        for f in ckpt.files.values():
            for name in f.keys():
                dt = f.header[name]["dtype"]
                dtypes[dt] += 1
                b, e = f.header[name]["data_offsets"]
                nbytes[dt] += e - b
        abstract = load_hf_params(path, cfg, hf, jnp.float32, materialize=False,
                                  check_finite=not args.no_finite_check)
        quant = hf.get("quantization_config") or (hf.get("text_config") or {}).get("quantization_config")
        report.update(format="huggingface", files=len(ckpt.files), tensors=len(ckpt.where),
                      dtypes={k: {"tensors": dtypes[k], "bytes": nbytes[k]} for k in sorted(dtypes)},
                      quantization=(quant or {}).get("quant_method"), num_params=param_count(abstract.params))
    kinds = Counter(("sliding" if s.sliding_window else "full") + ("+k_eq_v" if s.k_eq_v else "")
                    + ("+moe" if s.moe else "") + f" hd{s.head_dim}/kv{s.num_kv_heads}" for s in cfg.layers)
    report["layers"] = dict(kinds)
    if cfg.moe is not None:
        report["moe"] = {"experts": cfg.moe.num_experts, "top_k": cfg.moe.top_k,
                         "intermediate_size": cfg.moe.intermediate_size}
    report["valid"] = True
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for k, v in report.items():
            print(f"{k:>12}: {v}")
    return 0


# -------------------------------------------------------------------------------------------- target
def _target_args(p):
    p.add_argument("hf_dir", help="Hugging Face model directory (config.json + safetensors)")
    p.add_argument("out_dir", help="output directory (must not exist unless --force)")
    p.add_argument("--dtype", default="bf16", help="parameter dtype of the copy: bf16 (default), f32, f16")
    p.add_argument("--force", action="store_true", help="replace an existing OUT_DIR")


def run_target(args) -> int:
    dtype = _dtype(args.dtype)
    target = load_target(args.hf_dir, dtype=dtype)
    out = save_native_target(target, read_hf_config(args.hf_dir), args.out_dir, overwrite=args.force)
    print(f"wrote {out} ({target.config.model_type}, {param_count(target.params):,} params, {dtype.name})")
    return 0


# --------------------------------------------------------------------------------------------- drafter

def _drafter_args(p):
    p.add_argument("src", help="drafter directory (speculators or vLLM-native EAGLE-3 / P-EAGLE layout)")
    p.add_argument("out_dir", help="output directory for the speculators-format copy")
    p.add_argument("--dtype", default="bf16", help="floating dtype written: bf16 (default), f32, f16")
    p.add_argument("--target", default=None,
                   help="target model directory: validates vocab / width / aux layer ids and supplies "
                        "embed_tokens when the head has none")
    p.add_argument("--verifier", default=None, help="verifier name_or_path recorded in speculators_config")
    p.add_argument("--force", action="store_true", help="replace the files of an existing OUT_DIR")


def run_drafter(args) -> int:
    names = {"bf16": "bfloat16", "bfloat16": "bfloat16", "f32": "float32", "float32": "float32",
             "f16": "float16", "float16": "float16"}
    if args.dtype not in names:
        raise CheckpointError(f"unknown --dtype {args.dtype!r} (choose from {sorted(names)})")
    if Path(args.out_dir).exists() and not args.force:
        raise CheckpointError(f"{args.out_dir}: already exists (pass --force to replace its files)")
    target = None
    if args.target:
        target = load_target(args.target, dtype=jnp.float32)
    drafter = load_drafter(args.src, dtype=jnp.float32, target=target)
    out = save_drafter(drafter, args.out_dir, dtype=names[args.dtype], verifier_name_or_path=args.verifier)
    cfg = drafter.config
    print(f"wrote {out} ({cfg.model_kind}, {cfg.layer.model_type} x{cfg.layer.num_layers}, "
          f"Vd={cfg.draft_vocab_size}/V={cfg.vocab_size}, mask_token_id={cfg.mask_token_id})")
    return 0


COMMANDS = {
    "inspect": ("show model type, parameter count and dtypes; validate every tensor", _inspect_args, run_inspect),
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
    try:
        return COMMANDS[args.command][2](args)
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
