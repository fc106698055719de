"""Build a trained pair from scratch on one GPU: a code language model (Llama architecture) trained on the Python
sources installed on the machine, and a P-EAGLE head and an EAGLE-3 head trained against it on the same data with
the same budget; exported as a Hugging Face target and two speculators-format heads, with benchmark prompts drawn
from files no model has seen.

    python -m examples.code_pair --out out/code_pair --max-minutes 8   # repeat until it prints "pair complete"
    python -m examples.code_pair --out /tmp/tiny_pair --tiny             # the same path on a CPU, in minutes
    python -m examples.code_pair --out out/code_pair --stage peagle --peagle-depths 12 --force

from the repository root (the examples are not installed with pjax).

Stages, each resumable (a re-run skips finished stages, and continues a training stage from its last orbax
checkpoint):
    corpus     standard library + installed packages (`corpus`): manifest, held-out split by file,
               benchmark prompts (held-out functions: signature + docstring -> body)
    tokenizer  byte-level BPE on the training split (`bpe`), Hugging Face layout
    tokens     every file encoded once: BOS + tokens + EOS
    target     next-token training (`pjax.train.train_target_lm`) for `target_tokens` tokens; held-out loss
    regen      with --head-data regenerated: training-file prompts continued by the target (half functions'
               signatures and docstrings, half file prefixes), and held-out-file prompts for evaluation (else nothing)
    peagle     P-EAGLE head (COD sampling, `peagle_depths` trained depths) on the head data; accuracy per depth on
               held-out data (acc, cond_acc given the earlier depths right, chain_acc of the whole chain)
    eagle3     EAGLE-3 head (training-time test) on the same rows, same steps, rows per step and row length
    export     DIR/pair: target/ (Hugging Face), peagle/ and eagle3/ (speculators), prompts.jsonl, pair.json
    check      greedy decoding of benchmark prompts: plain vs each head (acceptance length, equality), and each head
               teacher-forced over the same sequences beside its decoding acceptance
A head whose held-out depth-0 accuracy or decoding acceptance says it learned nothing is logged as a warning.
No feature stage: the heads compute the target's features in each training step (stored, 4 x 1024 values per token
of the full target would take 8 KB a token, 105 GB for the heads' 13 M tokens).

Head data (--head-data): "regenerated" (default), training-file prompts continued greedily by the target, the loss
on the continuations: what a head sees when decoding (published heads train on target-regenerated responses to prompts
like their users', spec D.6; here --regen-function-fraction of the prompts are functions' signatures and docstrings,
the form of the benchmark's prompts, the rest file prefixes). "corpus": rows of the corpus' training split with the
target's own next-token distributions as the loss targets (computed online in each step); it costs no generation
stage, but a depth-d label is then a human-written token where at decode time it is the target's own.

Output rule: DIR is created with a pjax marker; an existing directory that is not a build of this recipe is refused.
A stage built with other settings (or whose inputs were rebuilt) is refused unless --force, which rebuilds it.
--max-minutes stops the run cleanly (training stages checkpoint first) once that much time has passed, with exit
status 75: run the same command again to continue.

The modules: `recipe` (the settings, stages and their inputs), `build` (the build directory, stage markers, locks,
`build`), `data` (corpus, tokenizer and token stages), `target` (the target's training), `regen` (the heads' data),
`heads` (P-EAGLE and EAGLE-3 training), `check` (export and the decoding check), `cli`; `corpus` and `bpe` build the
corpus and its tokenizer.
"""
from examples.code_pair.build import Build, build, locked, open_build, run_stage
from examples.code_pair.cli import main, parse_args, recipe_from_args
from examples.code_pair.data import documents, load_tokenizer, special_ids
from examples.code_pair.recipe import (EXIT_INCOMPLETE, FULL, STAGES, TINY, Incomplete, Recipe, RecipeError,
                                       inputs, not_learned)
from examples.code_pair.regen import head_documents

__all__ = ["EXIT_INCOMPLETE", "FULL", "STAGES", "TINY", "Build", "Incomplete", "Recipe", "RecipeError", "build",
           "documents", "head_documents", "inputs", "load_tokenizer", "locked", "main", "not_learned", "open_build",
           "parse_args", "recipe_from_args", "run_stage", "special_ids"]
