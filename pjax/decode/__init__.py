"""Speculative decoding engine: prefill, jitted rounds (verify -> accept -> draft), generate()."""
from pjax.decode.generate import GenerateResult, generate, make_spec
from pjax.decode.state import DecodeState, EngineSpec, Sampling
from pjax.decode.step import decode_loop, prefill, prefill_single, round_single, spec_round, verify

__all__ = ["DecodeState", "EngineSpec", "GenerateResult", "Sampling", "decode_loop", "generate", "make_spec",
           "prefill", "prefill_single", "round_single", "spec_round", "verify"]
