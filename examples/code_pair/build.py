"""The build directory: its marker, one subdirectory per stage with a `stage.json` marker (the stage's settings and
its inputs' fingerprints), locks between processes, and `build`, which runs the stages in order."""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

from examples.code_pair import check, data, heads, regen, target
from examples.code_pair.recipe import (FULL, SETTINGS, STAGES, Incomplete, Recipe, RecipeError, check_recipe, inputs,
                                       jsonable, now, write_json)
from pjax.checkpoint import output_kind, write_output_dir

BUILD_KIND = "code-pair-build"


@dataclasses.dataclass
class Build:
    """A build directory and how this run treats it."""
    out: Path
    recipe: Recipe
    force: bool = False
    progress: bool = True
    deadline: Optional[float] = None  # time.time() after which no step or stage starts
    save_seconds: float = 240.0  # training checkpoints at least this often
    implementation: str = "auto"
    log: Callable[[str], None] = print
    should_stop: Optional[Callable[[], bool]] = None  # checked after every training step, besides the deadline
    _keys: dict = dataclasses.field(default_factory=dict, repr=False)

    def dir(self, stage: str) -> Path:
        return self.out / stage

    def settings(self, stage: str) -> dict:
        if stage == "regen" and self.recipe.head_data == "corpus":  # the regen_* settings are then unused
            return {"head_data": "corpus"}
        return {k: jsonable(getattr(self.recipe, k)) for k in SETTINGS[stage]}

    def key(self, stage: str) -> str:
        """Fingerprint of a stage: its settings and the fingerprints of its inputs."""
        if stage not in self._keys:
            ident = dict(stage=stage, settings=self.settings(stage), upstream=[self.key(u) for u in inputs(stage)])
            self._keys[stage] = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
        return self._keys[stage]

    def marker(self, stage: str) -> Optional[dict]:
        try:
            return json.loads((self.dir(stage) / "stage.json").read_text())
        except (OSError, ValueError):
            return None

    def done(self, stage: str) -> bool:
        m = self.marker(stage)
        return m is not None and m.get("key") == self.key(stage)

    def stop_now(self) -> bool:
        return (self.deadline is not None and time.time() >= self.deadline) or bool(self.should_stop and
                                                                                   self.should_stop())

    def save_or_stop(self, name: str, done: int, total: int, last_save: float, bar, ckpt, save) -> float:
        """After a training step: `save()` (a checkpoint and the history) when the run stops here or save_seconds
        have passed since `last_save`; when it stops (the deadline, should_stop), close the bar and the
        checkpointer and raise Incomplete. Returns the time of the last save."""
        stopping = self.stop_now() and done < total
        if done < total and (stopping or time.time() - last_save >= self.save_seconds):
            save()
            last_save = time.time()
        if stopping:
            if bar is not None:
                bar.close()
            ckpt.close()
            raise Incomplete(f"{name}: stopped at step {done}/{total} (checkpoint saved)")
        return last_save

    def bar(self, total, desc, initial=0, unit="it"):
        if not self.progress:
            return None
        from tqdm.auto import tqdm
        return tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True)


def _differences(b, stage: str, marker: dict) -> str:
    old = marker.get("settings", {})
    diff = [f"{k}: {old.get(k)!r} -> {v!r}" for k, v in b.settings(stage).items() if old.get(k) != v]
    changed = [u for u in inputs(stage) if marker.get("inputs", {}).get(u) != b.key(u)]
    if changed:
        diff.append(f"rebuilt inputs: {', '.join(changed)}")
    return "; ".join(diff) or "unknown settings"


def open_build(out, *, force: bool) -> Path:
    """Create DIR (absent or empty) with the build marker, or accept an existing build of this recipe."""
    out = Path(os.path.abspath(out))
    if output_kind(out) != BUILD_KIND:
        with write_output_dir(out, force=force, kind=BUILD_KIND):
            pass
    return out


@contextlib.contextmanager
def locked(out: Path, stage: str):
    """Hold `stage` for this process (exclusive) and its inputs against a rebuild (shared): different stages of one
    build may run at once, e.g. the two heads each on its own GPU (examples/benchmarks/code_pair_table.py --gpus)."""
    with contextlib.ExitStack() as stack:
        for name, mode in [(stage, fcntl.LOCK_EX)] + [(u, fcntl.LOCK_SH) for u in inputs(stage)]:
            f = stack.enter_context(open(out / f".{name}.lock", "a"))
            try:
                fcntl.flock(f, mode | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RecipeError(f"{out}: stage {name} is in use by another process (being built, or read by a "
                                  f"stage being built)" if name == stage else
                                  f"{out}: stage {name}, which stage {stage} reads, is being built by another "
                                  f"process") from None
        yield


RUN = {"corpus": data.stage_corpus, "tokenizer": data.stage_tokenizer, "tokens": data.stage_tokens,
       "target": target.stage_target, "regen": regen.stage_regen, "peagle": heads.stage_peagle,
       "eagle3": heads.stage_eagle3, "export": check.stage_export, "check": check.stage_check}
TRAINING = ("target", "peagle", "eagle3")


def run_stage(b, stage: str) -> str:
    """Run one stage unless it is done; returns "done" (skipped) or "built"."""
    missing = [u for u in inputs(stage) if not b.done(u)]
    if missing:
        raise RecipeError(f"stage {stage} needs {', '.join(missing)} first (run without --stage, or --stage "
                          f"{missing[0]})")
    if b.done(stage):
        return "done"
    d = b.dir(stage)
    old = b.marker(stage)
    progress_file = d / "progress.json"
    started = json.loads(progress_file.read_text()) if progress_file.exists() else None
    stale = old if old is not None else (started if started and started.get("key") != b.key(stage) else None)
    if stale is not None:
        if not b.force:
            raise RecipeError(f"stage {stage} in {b.out} was {'built' if old else 'started'} with other settings "
                              f"({_differences(b, stage, stale)}); pass --force to rebuild it")
        shutil.rmtree(d)
    if b.stop_now():
        raise Incomplete(f"time limit reached before stage {stage}")
    ident = dict(key=b.key(stage), settings=b.settings(stage), inputs={u: b.key(u) for u in inputs(stage)})
    t0 = time.time()
    if stage in TRAINING:
        d.mkdir(exist_ok=True)
        write_json(progress_file, ident)
        summary = RUN[stage](b, d)
        work = d
    else:
        work = b.out / f".{stage}.tmp"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        summary = RUN[stage](b, work)
    write_json(work / "stage.json", dict(stage=stage, **ident, summary=summary, seconds=round(time.time() - t0, 1),
                                          finished_at=now()))
    if work != d:
        os.rename(work, d)
    return "built"


def build(out, recipe: Recipe = FULL, *, stages=STAGES, force: bool = False, progress: bool = True,
          max_minutes: Optional[float] = None, save_minutes: float = 4.0, implementation: str = "auto",
          log: Callable[[str], None] = print,
          should_stop: Optional[Callable[[], bool]] = None) -> dict:
    """Run `stages` (in recipe order) of the build at `out`; returns {stage: "done" | "built"}. Raises Incomplete
    when the time limit (or `should_stop`) stopped it (the same call continues), RecipeError when it cannot go on."""
    check_recipe(recipe)
    out = open_build(out, force=force)
    deadline = None if max_minutes is None else time.time() + 60 * max_minutes
    b = Build(out, recipe, force=force, progress=progress, deadline=deadline, save_seconds=60 * save_minutes,
              implementation=implementation, log=log, should_stop=should_stop)
    result = {}
    for stage in [s for s in STAGES if s in stages]:
        t0 = time.time()
        with locked(out, stage):
            result[stage] = run_stage(b, stage)
            if result[stage] == "built":
                log(f"stage {stage}: built in {time.time() - t0:.0f} s")
    return result


