"""The benchmark sweep: prompt sets rendered to requests, every (drafting, K, concurrency) configuration compiled
and warmed up, then timed, its metrics computed, and at temperature 0 its outputs compared with plain decoding's.

Order: per dataset, per concurrency, `none` first (the reference of the speedups and of exactness), then for each K
`sequential` and `parallel`; so a run cut short by its time budget still holds complete concurrencies.
"""
from __future__ import annotations

import dataclasses
import datetime
import platform
import time
from typing import Callable, Optional, Sequence

import jax
import numpy as np

from pjax.bench import exactness as X
from pjax.bench.backend import Backend, Request, RunSettings
from pjax.bench.datasets import Dataset
from pjax.bench.errors import BenchError
from pjax.bench.metrics import by_category, summarize
from pjax.decode.compiled import compile_stats
from pjax.decode.inputs import check_sampling
from pjax.decode.budget import K_MAX
from pjax.decode.drafting import Drafting
from pjax.decode.state import drafting_slack

__all__ = ["BenchResult", "BenchSettings", "PromptSet", "build_prompt_set", "environment", "run_bench"]


@dataclasses.dataclass(frozen=True)
class BenchSettings:
    """The sweep. drafting: modes to run; ks: drafts per round (speculative modes); auto: also each speculative mode
    with the budget that follows the load (`EngineConfig.num_speculative_tokens="auto"`); concurrency: requests in
    flight; num_prompts: None (every prompt), one count, or one count per concurrency; tree_budgets: each speculative
    mode also runs a tree of each N >= K per K (`EngineConfig.tree_budget`); simulate_acceptance: None or at
    least max(ks) probabilities, the first K used at K (the engine's simulated verdicts: outputs are then not the
    target's); eos_token_ids: ids that end a request (empty: every request runs max_new_tokens); time_budget_s:
    a configuration starts only while the time since `run_bench`'s `t_start` plus the longest configuration so far
    fits in it."""
    drafting: tuple[str, ...] = ("parallel", "sequential", "none")
    ks: tuple[int, ...] = (3, 7, 11)
    tree_budgets: tuple[int, ...] = ()
    concurrency: tuple[int, ...] = (1,)
    num_prompts: Optional[tuple[int, ...]] = None
    max_new_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0
    simulate_acceptance: Optional[tuple[float, ...]] = None
    eos_token_ids: tuple[int, ...] = ()
    time_budget_s: Optional[float] = None
    auto: bool = False

    @property
    def speculative(self) -> tuple[str, ...]:
        return tuple(d for d in self.drafting if d != "none")

    def validate(self) -> "BenchSettings":
        """BenchError naming the flag of the first bad value."""
        if not self.drafting:
            raise BenchError("--drafting: give at least one of parallel, sequential, none")
        bad = [d for d in self.drafting if d not in Drafting.names()]
        if bad:
            raise BenchError(f"--drafting {','.join(bad)}: expected parallel, sequential and / or none")
        if len(set(self.drafting)) != len(self.drafting):
            raise BenchError(f"--drafting {','.join(self.drafting)}: a mode is repeated")
        if not (self.ks or self.auto) or any(k <= 0 for k in self.ks):
            raise BenchError(f"--k {','.join(map(str, self.ks))}: K must be integers >= 1")
        if not self.concurrency or any(c <= 0 for c in self.concurrency):
            raise BenchError(f"--concurrency {','.join(map(str, self.concurrency))}: concurrency must be integers "
                             ">= 1")
        if self.num_prompts is not None:
            if len(self.num_prompts) not in (1, len(self.concurrency)):
                raise BenchError(f"--num-prompts: give one count or one per concurrency ({len(self.concurrency)}), "
                                 f"got {len(self.num_prompts)}")
            if any(n <= 0 for n in self.num_prompts):
                raise BenchError(f"--num-prompts {','.join(map(str, self.num_prompts))}: counts must be >= 1")
        if self.max_new_tokens < 1:
            raise BenchError(f"--max-new-tokens {self.max_new_tokens}: must be >= 1")
        try:
            check_sampling(1, self.temperature, None, None, 0)
        except (TypeError, ValueError) as e:
            raise BenchError(f"--temperature {self.temperature}: {e}") from None
        if self.simulate_acceptance is not None:
            p = self.simulate_acceptance
            if not self.speculative:
                raise BenchError("--simulate-acceptance needs a speculative mode in --drafting (parallel / "
                                 "sequential)")
            if not all(0.0 <= x <= 1.0 for x in p):
                raise BenchError(f"--simulate-acceptance {','.join(map(str, p))}: probabilities must lie in [0, 1]")
            if len(p) < max(self.ks, default=0):
                raise BenchError(f"--simulate-acceptance gives {len(p)} value{'s' * (len(p) != 1)} but --k goes up "
                                 f"to {max(self.ks)}: give one probability per draft position up to the largest K")
        if self.tree_budgets:
            given = ",".join(map(str, self.tree_budgets))
            if any(n < 1 for n in self.tree_budgets) or len(set(self.tree_budgets)) != len(self.tree_budgets):
                raise BenchError(f"--tree-budget {given}: budgets must be distinct integers >= 1")
            if not self.speculative:
                raise BenchError(f"--tree-budget {given}: trees need parallel or sequential in --drafting")
            if not any(n >= k for n in self.tree_budgets for k in self.ks):
                raise BenchError(f"--tree-budget {given}: no budget is >= a K of --k (a tree of N >= K tokens)")
            if self.simulate_acceptance is not None:
                raise BenchError(f"--tree-budget {given}: simulated acceptance takes chains only")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise BenchError(f"--time-budget {self.time_budget_s}: must be > 0 seconds")
        return self

    def prompts_for(self, concurrency: int) -> Optional[int]:
        if self.num_prompts is None:
            return None
        if len(self.num_prompts) == 1:
            return self.num_prompts[0]
        return self.num_prompts[self.concurrency.index(concurrency)]

    def simulated(self, k) -> Optional[tuple[float, ...]]:
        """The simulated verdicts of K drafts (all of them for "auto", which uses the first K_max)."""
        if self.simulate_acceptance is None:
            return None
        return tuple(self.simulate_acceptance if k == "auto" else self.simulate_acceptance[:k])


@dataclasses.dataclass
class PromptSet:
    """A dataset rendered to requests (request i = prompt i of `dataset.select`); `prompts` says how the token ids
    were made (tokenizer, chat template, random ids of which lengths)."""
    dataset: Dataset
    requests: list[Request]
    categories: list[Optional[str]]
    prompts: str


def build_prompt_set(dataset: Dataset, count: Optional[int], *, render: Optional[Callable] = None,
                     random_vocab: Optional[int] = None, prompt_len: Optional[int] = None, seed: int = 0,
                     how: str = "") -> PromptSet:
    """Requests for the first `count` prompts of `dataset` (its even spread, `Dataset.select`).

    render(content) -> token ids (the tokenizer, chat template applied or not). random_vocab: make random token
    ids in [0, random_vocab) instead (random-weight targets), of length `prompt_len`, or of the rendered length when
    prompt_len is None. Request i gets sampling seed `seed + i`."""
    if count is not None and count > len(dataset.prompts):
        raise BenchError(f"--num-prompts {count}: {dataset.name} has only {len(dataset.prompts)} prompts")
    prompts = dataset.select(count)
    rng = np.random.default_rng(seed)
    requests = []
    for i, p in enumerate(prompts):
        ids = list(render(p.content)) if render is not None and (random_vocab is None or prompt_len is None) else None
        if ids is not None and not ids:
            raise BenchError(f"{dataset.name}: prompt {p.id} renders to no tokens")
        if random_vocab is not None:
            ids = rng.integers(0, random_vocab, prompt_len or len(ids)).tolist()
        requests.append(Request(p.id, tuple(int(t) for t in ids), seed + i))
    return PromptSet(dataset, requests, [p.category for p in prompts], how)


@dataclasses.dataclass
class BenchResult:
    """rows: one dict per configuration run; requests: one dict per request of each; skipped: the configurations
    the time budget left out (or, in a partial result, not reached yet); scheduling: how the backend schedules
    requests in flight; planned: how many configurations the run has (more than the rows + skipped only in a
    partial result, while the run goes on)."""
    rows: list[dict]
    requests: list[dict]
    skipped: list[dict]
    scheduling: str
    planned: Optional[int] = None

    @property
    def partial(self) -> bool:
        return any(s.get("pending") for s in self.skipped)


def environment() -> dict:
    """Hardware, software versions and date of this process (every row carries them)."""
    devs = jax.devices()
    from importlib import metadata
    try:
        pjax_version = metadata.version("pjax")
    except metadata.PackageNotFoundError:
        pjax_version = "source tree, not installed"
    try:
        jaxlib_version = metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        jaxlib_version = None
    return {"hardware": f"{devs[0].device_kind} x{len(devs)} ({devs[0].platform})", "platform": devs[0].platform,
            "jax_version": jax.__version__, "jaxlib_version": jaxlib_version, "pjax_version": pjax_version,
            "python_version": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _configurations(sets: Sequence[PromptSet], s: BenchSettings) -> list[tuple]:
    """(prompt set, drafting, K, concurrency, tree budget or None) in run order ("auto" after every K)."""
    out = []
    for ps in sets:
        for c in s.concurrency:
            if "none" in s.drafting:
                out.append((ps, "none", 0, c, None))
            for k in s.ks if s.speculative else ():
                modes = [d for d in ("sequential", "parallel") if d in s.drafting]
                out += [(ps, d, k, c, None) for d in modes]
                out += [(ps, d, k, c, n) for d in modes for n in s.tree_budgets if n >= k]
            if s.auto:
                out += [(ps, d, "auto", c, None) for d in ("sequential", "parallel") if d in s.drafting]
    return out


def _requests_for(ps: PromptSet, s: BenchSettings, c: int) -> tuple[list[Request], list[Optional[str]]]:
    n = s.prompts_for(c)
    n = len(ps.requests) if n is None else n
    return ps.requests[:n], ps.categories[:n]


def _max_positions(ps: PromptSet, s: BenchSettings) -> int:
    """KV positions of the longest request of the set with its new tokens and drafting slack (`drafting_slack` of the
    largest K and tree): one value for every configuration of a dataset, so every mode and K reads the same cache
    size."""
    k = max(s.ks + ((K_MAX,) if s.auto else ()), default=0) if s.speculative else 0
    slack = drafting_slack(k, max(s.tree_budgets + (k,)), "sequential" in s.drafting and bool(s.tree_budgets))
    return max(len(r.tokens) for r in ps.requests) + s.max_new_tokens + slack


def _exactness_reason(s: BenchSettings, drafting: str, have_reference: bool) -> Optional[str]:
    """Why a configuration's outputs are not compared with plain decoding's (None: they are)."""
    if drafting == "none":
        return "reference"
    if s.simulate_acceptance is not None:
        return "not checked: simulated acceptance (the outputs are not the target's)"
    if s.temperature > 0:
        return "not checked: temperature > 0 (outputs follow the target's distribution, not its tokens)"
    if not have_reference:
        return "not checked: no 'none' run at this concurrency (add none to --drafting)"
    return None


def _compiled_since(before: dict) -> dict:
    """{program name: {"programs": n, "seconds": s}} compiled since `compile_stats()` returned `before`."""
    out = {}
    for name, (n, sec) in compile_stats().items():
        n0, s0 = before.get(name, (0, 0.0))
        if n > n0:
            out[name] = {"programs": n - n0, "seconds": round(sec - s0, 2)}
    return out


def _programs_text(by_program: dict) -> str:
    """": <name> <seconds> s (<n> programs), <name> <seconds> s (<n>), ..." (largest first), or "" when nothing was
    compiled."""
    parts = [f"{name} {v['seconds']:.1f} s ({v['programs']}{' programs' if not i else ''})"
             for i, (name, v) in enumerate(sorted(by_program.items(), key=lambda kv: -kv[1]["seconds"]))]
    return (": " + ", ".join(parts)) if parts else ""


def _request_lines(ps: PromptSet, drafting: str, k: int, c: int, tree: Optional[int], requests, cats,
                   results) -> list[dict]:
    """requests.jsonl lines of one configuration."""
    return [{"dataset": ps.dataset.name, "drafting": drafting, "k": k, "tree_budget": tree, "concurrency": c,
             "prompt_id": req.id,
             "category": cat, "prompt_tokens": len(req.tokens), "output_tokens": res.output_tokens,
             "ttft_ms": 1e3 * res.ttft_s, "tpot_ms": None if res.tpot_s is None else 1e3 * res.tpot_s,
             "e2el_ms": 1e3 * res.e2e_s, "rounds": res.rounds, "num_drafts": res.num_drafts,
             "num_accepted_tokens": res.num_accepted_tokens,
             "acceptance_length": 1 + res.num_accepted_tokens / res.num_drafts if res.num_drafts else None,
             "stop_reason": res.stop_reason} for req, cat, res in zip(requests, cats, results)]


def _not_run(ps: PromptSet, drafting: str, k: int, c: int, tree: Optional[int], reason: str, *,
             pending: bool = False) -> dict:
    """A configuration of the run that did not run (`BenchResult.skipped`): left out by the time budget, or
    `pending` (not reached yet, in a partial result)."""
    out = {"dataset": ps.dataset.name, "drafting": drafting, "k": k, "tree_budget": tree, "concurrency": c,
           "reason": reason}
    return {**out, "pending": True} if pending else out


def run_bench(backend: Backend, sets: Sequence[PromptSet], settings: BenchSettings, *, meta: dict,
              next_logits: Optional[Callable[[list[int]], np.ndarray]] = None, compute_dtype=None,
              progress: bool = True, t_start: Optional[float] = None,
              log: Callable[[str], None] = lambda msg: None,
              on_partial: Optional[Callable[[BenchResult], None]] = None) -> BenchResult:
    """Run every configuration: `backend.prepare` (compile, warm up), `backend.run` (timed), metrics, and at
    temperature 0 the exactness of each speculative output against the `none` output of the same prompt at the
    same concurrency (next_logits(prefix) -> [V] target logits for the near-tie check; compute_dtype: the target's
    compute dtype, which sets the near-tie threshold). meta: fields every row carries (models, dtype, hardware...).
    on_partial(result so far) runs after each configuration but the last, its configurations still to run listed
    in `skipped` with "pending": True, so that a run stopped from outside (a machine's time limit) keeps what it
    measured.
    """
    s = settings.validate()
    t_start = time.perf_counter() if t_start is None else t_start
    configs = _configurations(sets, s)
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=sum(len(_requests_for(ps, s, c)[0]) for ps, _, _, c, _ in configs), desc="bench", unit="req",
                   dynamic_ncols=True)
    rows, details, skipped = [], [], []
    references: dict[tuple[int, int], list[list[int]]] = {}  # (prompt set, concurrency) -> none's outputs
    longest_config = 0.0
    try:
        for i, (ps, drafting, k, c, tree) in enumerate(configs):
            requests, cats = _requests_for(ps, s, c)
            label = (f"{ps.dataset.name} {drafting}" + (f" K={k}" if k else "") + (f" tree {tree}" if tree else "")
                     + f" c={c}")
            elapsed = time.perf_counter() - t_start
            if s.time_budget_s is not None and elapsed + longest_config > s.time_budget_s:
                skipped.append(_not_run(ps, drafting, k, c, tree, f"time budget: {elapsed:.0f} s spent, the longest "
                                        f"configuration took {longest_config:.0f} s, budget {s.time_budget_s:.0f} s"))
                log(f"skipped {label} (time budget)")
                if bar is not None:
                    bar.total -= len(requests)
                    bar.refresh()
                continue
            t_config = time.perf_counter()
            if bar is not None:
                bar.set_postfix_str(f"{label}: compiling")
            run_settings = RunSettings(drafting=drafting, k=k, concurrency=c, max_new_tokens=s.max_new_tokens,
                                       max_positions=_max_positions(ps, s), temperature=s.temperature,
                                       eos_token_ids=tuple(s.eos_token_ids),
                                       simulate_acceptance=s.simulated(k) if k else None, tree_budget=tree)
            programs_before = compile_stats()
            compile_s = backend.prepare(requests, run_settings)
            if bar is not None:
                bar.set_postfix_str(label)
            result = backend.run(requests, run_settings, on_progress=bar.update if bar is not None else None)

            row = {"dataset": ps.dataset.name, "drafting": drafting, "k": k, "tree_budget": tree, "concurrency": c,
                   "max_new_tokens": s.max_new_tokens, "temperature": s.temperature,
                   "simulated": run_settings.simulate_acceptance is not None,
                   "simulate_acceptance": list(run_settings.simulate_acceptance or []) or None,
                   **summarize(result.requests, result.duration_s, k)}
            outputs = [r.tokens for r in result.requests]
            key = (id(ps), c)
            if drafting == "none":
                references[key] = outputs
            reason = _exactness_reason(s, drafting, key in references)
            exact, mismatches = None, []
            if reason is None:
                exact, mismatches = X.compare_outputs(outputs, references[key], [r.tokens for r in requests],
                                                      [r.id for r in requests], next_logits, compute_dtype)
            row.update(exact_matches=exact, exactness=reason or f"compared with none at concurrency {c}",
                       mismatches=None if reason else len(mismatches),
                       near_tie_mismatches=None if reason else sum(bool(m.near_tie) for m in mismatches),
                       mismatch_details=[m.as_dict() for m in mismatches])
            if any(cats):
                row["categories"] = by_category(result.requests, cats, k)
            row.update(compile_s=compile_s, compile_s_during_timing=result.compile_s,
                       compile_by_program=_compiled_since(programs_before), prompts=ps.prompts,
                       dataset_source=ps.dataset.source, scheduling=backend.scheduling, **meta)
            rows.append(row)
            details += _request_lines(ps, drafting, k, c, tree, requests, cats, result.requests)
            longest_config = max(longest_config, time.perf_counter() - t_config)
            log(f"{label}: {row['output_tokens_per_s']:.1f} output tok/s"
                + (f", AL {row['mean_acceptance_length']:.2f}" if row["mean_acceptance_length"] else "")
                + (f", exact {exact}/{len(requests)}" if exact is not None else "")
                + f" (compiled in {compile_s:.1f} s{_programs_text(row['compile_by_program'])}, configuration "
                f"{time.perf_counter() - t_config:.0f} s)")
            if on_partial is not None and i + 1 < len(configs):
                pending = [_not_run(*config, "not reached: this output was written while the benchmark ran (a "
                                    "complete run replaces it)", pending=True) for config in configs[i + 1:]]
                on_partial(BenchResult(list(rows), list(details), skipped + pending, backend.scheduling,
                                       len(configs)))
    finally:
        if bar is not None:
            bar.close()
    return BenchResult(rows, details, skipped, backend.scheduling, len(configs))
