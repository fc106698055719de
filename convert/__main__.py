"""`python -m convert` — inspect / validate checkpoints and write pjax-native copies.

    python -m convert inspect PATH [--json]                 model type, parameters, on-disk dtypes; full validation
    python -m convert target HF_DIR OUT_DIR [--dtype bf16]  pjax-native (orbax) copy of a target, written atomically

Subcommands live in the `COMMANDS` registry: decorate a `run(args) -> int` function with
`@command(name, help)` and give it a `configure(parser)` attribute (or pass `configure=`) to add
arguments. Modules listed in `EXTENSIONS` that define `register_cli(command)` are imported and
called at start-up, so other packages (e.g. the drafter converter) can add subcommands without
editing this file. Errors (CheckpointError / ConfigError) print one line and exit with status 2.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Callable, Optional

COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}
EXTENSIONS = ("convert.drafter",)
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "f32": "float32", "float32": "float32",
          "f16": "float16", "float16": "float16"}


def command(name: str, help: str, configure: Optional[Callable[[argparse.ArgumentParser], None]] = None):
    """Register `run(args) -> int` as subcommand `name`; `configure(parser)` adds its arguments."""
    def deco(run):
        COMMANDS[name] = (help, configure or getattr(run, "configure", lambda p: None), run)
        return run
    return deco


def _dtype(name: str):
    import jax.numpy as jnp
    if name not in DTYPES:
        raise SystemExit(f"unknown --dtype {name!r} (choose from {sorted(DTYPES)})")
    return jnp.dtype(DTYPES[name])


# ------------------------------------------------------------------------------------------- inspect
def _inspect_args(p):
    p.add_argument("path", help="Hugging Face model directory or pjax-native directory")
    p.add_argument("--json", action="store_true", help="print a JSON report instead of text")
    p.add_argument("--no-finite-check", action="store_true", help="skip the NaN/inf scan of every tensor")


@command("inspect", "show model type, parameter count and dtypes; validate every tensor", _inspect_args)
def run_inspect(args) -> int:
    import jax.numpy as jnp

    from convert.native import load_native_target, param_count, read_marker
    from convert.safetensors_io import Checkpoint
    from convert.target import NATIVE_MARKER, load_hf_params, read_target_config

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


@command("target", "convert a Hugging Face target to a pjax-native (orbax) checkpoint", _target_args)
def run_target(args) -> int:
    from convert.native import param_count, save_native_target
    from convert.target import load_target, read_hf_config

    dtype = _dtype(args.dtype)
    target = load_target(args.hf_dir, dtype=dtype)
    out = save_native_target(target, read_hf_config(args.hf_dir), args.out_dir, overwrite=args.force)
    print(f"wrote {out} ({target.config.model_type}, {param_count(target.params):,} params, {dtype.name})")
    return 0


# ---------------------------------------------------------------------------------------------- main
def _load_extensions():
    for mod in EXTENSIONS:
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        if hasattr(m, "register_cli"):
            m.register_cli(command)


def build_parser() -> argparse.ArgumentParser:
    _load_extensions()
    parser = argparse.ArgumentParser(prog="python -m convert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_, configure, _) in COMMANDS.items():
        configure(sub.add_parser(name, help=help_, description=help_))
    return parser


def main(argv=None) -> int:
    from convert.errors import CheckpointError
    from pjax.config import ConfigError

    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command][2](args)
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
