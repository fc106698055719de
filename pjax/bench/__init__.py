"""Benchmarking speculative decoding on real checkpoints (`python -m pjax bench`): throughput, latency, acceptance
and exactness per drafting mode, K and concurrency, defined as `vllm bench serve` defines them.

The parts: `datasets` (MT-Bench, Spec-Bench, HumanEval, JSON-lines files), `backend` (the `Backend` protocol;
`BatchBackend`, static batches, and `EngineBackend`, continuous batching, both on `pjax.decode.Engine`), `simulate`
(simulated acceptance: the engine's acceptance hook for timing random weights), `metrics`, `exactness` (outputs vs
plain decoding, near-ties), `models` (random-weight targets and heads of published geometries), `runner` (the
sweep), `report` (bench.json, bench.md, plots), `cli`.
"""
from pjax.bench.backend import Backend, BatchBackend, EngineBackend, Request, RequestResult, RunResult, RunSettings
from pjax.bench.datasets import DATASET_NAMES, Dataset, Prompt, load_dataset
from pjax.bench.errors import BenchError
from pjax.bench.exactness import NEAR_TIE_EPS, Mismatch, compare_outputs, next_token_logits
from pjax.bench.runner import BenchResult, BenchSettings, PromptSet, build_prompt_set, run_bench

__all__ = ["DATASET_NAMES", "NEAR_TIE_EPS", "Backend", "BatchBackend", "BenchError", "BenchResult", "BenchSettings",
           "Dataset", "EngineBackend", "Mismatch", "Prompt", "PromptSet", "Request", "RequestResult", "RunResult",
           "RunSettings", "build_prompt_set", "compare_outputs", "load_dataset", "next_token_logits", "run_bench"]
