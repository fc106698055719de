"""Speculative decoding engine: prefill (`prefill_target` then `prefill_drafter`), jitted rounds (verify -> accept ->
draft), `generate` and the streaming `Generation`; `prefill_single` / `round_single` are the single-sequence research
API (jax.vmap them)."""
from pjax.decode.generate import (Chunk, GenerateResult, Generation, GenerationInterrupted, compile_count, generate,
                                  make_spec, precompile)
from pjax.decode.state import STOP_NAMES, DecodeState, EngineSpec, Sampling
from pjax.decode.step import (decode_loop, prefill, prefill_drafter, prefill_single, prefill_target, round_single,
                              spec_round, target_spec, verify)

__all__ = ["STOP_NAMES", "Chunk", "DecodeState", "EngineSpec", "GenerateResult", "Generation",
           "GenerationInterrupted", "Sampling", "compile_count", "decode_loop", "generate", "make_spec", "prefill",
           "precompile", "prefill_drafter", "prefill_single", "prefill_target", "round_single", "spec_round",
           "target_spec", "verify"]
