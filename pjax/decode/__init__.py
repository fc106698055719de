"""Speculative decoding: the engine (`Engine`: continuous batching over device slots; `generate` and the streaming
`Generation` run a static batch on it), its one settings object (`EngineConfig`), drafting strategy (`Drafting`) and
chooser of a budget that follows the load (`BudgetChooser`), and the pure device functions: prefill (`prefill_target`
then `prefill_drafter`) and jitted rounds (verify -> accept -> draft); `prefill_single` / `round_single` are the
single-sequence research API (jax.vmap them)."""
from pjax.decode._generate import Chunk, GenerateResult, Generation, GenerationInterrupted, compile_count, generate
from pjax.decode.budget import BudgetChooser
from pjax.decode.drafting import Drafting
from pjax.decode.engine import Engine, Event, RequestParams
from pjax.decode.settings import EngineConfig, make_spec
from pjax.decode.state import STOP_NAMES, DecodeState, EngineSpec, Sampling
from pjax.decode.step import (decode_loop, prefill, prefill_drafter, prefill_single, prefill_target, round_single,
                              spec_round, verify)

__all__ = ["STOP_NAMES", "BudgetChooser", "Chunk", "DecodeState", "Drafting", "Engine", "EngineConfig", "EngineSpec",
           "Event", "GenerateResult", "Generation", "GenerationInterrupted", "RequestParams", "Sampling",
           "compile_count", "decode_loop", "generate", "make_spec", "prefill", "prefill_drafter", "prefill_single",
           "prefill_target", "round_single", "spec_round", "verify"]
