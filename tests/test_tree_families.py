"""Draft trees on every target family: `pjax.generate` with a tree budget (P-EAGLE's best-first tree from its one
pass, EAGLE-3's dynamic tree grown depth by depth) gives transformers' greedy continuation on the tiny checkpoints of
each family (ragged batch; trees deeper than the sliding windows of gpt_oss and gemma4). The default run takes each
family once and each drafting mode on two of them; llama's trees (both modes, several budgets) are in
tests/test_tree.py and "auto" budgets in tests/test_budget.py; --full runs the other mode on each family."""
import dataclasses

import pytest

import pjax
from tests.engine_utils import AVAILABLE, FAST, NEW, PROMPTS, build, make_eagle3

# family -> (depth K, tree budget N): K + 1 > the sliding window (6) where the family has one
SHAPES = {"qwen3": (3, 8), "qwen3_moe": (3, 6), "gpt_oss": (7, 10), "gemma4": (7, 10)}
DEFAULT = {("qwen3", "parallel"), ("qwen3_moe", "sequential"), ("gpt_oss", "parallel"), ("gemma4", "sequential")}


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tree_families")


@pytest.mark.parametrize("name,drafting", [
    pytest.param(name, drafting, id=f"{name}-{drafting}",
                 marks=() if (name, drafting) in DEFAULT else pytest.mark.full)
    for name in SHAPES if name in AVAILABLE for drafting in ("parallel", "sequential")])
def test_tree_greedy_equals_transformers(tmp_root, name, drafting):
    target, drafter, ref = build(name, tmp_root)
    if drafting == "parallel":  # a confident head: trees several levels deep
        head = dataclasses.replace(drafter, params={**drafter.params,
                                                   "lm_head": {"kernel": drafter.params["lm_head"]["kernel"] * 6}})
    else:
        head = make_eagle3(target, draft_vocab_size=64)
    k, n = SHAPES[name]
    res = pjax.generate(target, head, PROMPTS, max_new_tokens=NEW, num_speculative_tokens=k, tree_budget=n,
                        drafting=drafting, compiler_options=FAST)
    assert res.tokens == [r[:NEW] for r in ref]
    assert res.stats["stop_reasons"] == ["length"] * len(PROMPTS) and len(res.stats["acceptance_rates"]) == k
    assert res.stats["num_draft_tokens"] >= n * res.stats["num_drafts"] - 2 * n  # every round verifies the tree
