"""The heads' data: with head data "regenerated", training-file prompts continued by the target (and held-out-file
prompts for evaluation); with "corpus", the corpus' own files."""
from __future__ import annotations

import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from examples.code_pair.corpus import function_prompts, read_texts
from examples.code_pair.data import documents, load_tokenizer, special_ids
from examples.code_pair.target import load_code_target


def _prompts(b, split: str, count: int, seed: int) -> tuple[list[list[int]], int]:
    """`count` regeneration prompts of the split, shuffled with `seed`: regen_function_fraction of them functions'
    signatures and docstrings (`function_prompts`; BOS + the tokenized prompt, at most regen_prompt_tokens; fewer
    when the split has fewer), the rest prefixes of its files (BOS + 32..regen_prompt_tokens tokens, file and length
    drawn with `seed`). Returns (prompts, function prompts among them)."""
    r = b.recipe
    rng = np.random.default_rng(seed)
    functions = []
    want = int(round(count * r.regen_function_fraction))
    if want:
        tok = load_tokenizer(b)
        for p in function_prompts(read_texts(b.dir("corpus") / f"{split}.jsonl")):
            ids = tok.encode(p.prompt).ids
            if len(ids) <= r.regen_prompt_tokens:
                functions.append(ids)
                if len(functions) == want:
                    break
    docs = [d for d in documents(b, split) if len(d.tokens) > 33]
    picks = rng.integers(0, len(docs), count - len(functions))
    lengths = [int(rng.integers(32, min(r.regen_prompt_tokens, len(docs[i].tokens) - 1) + 1)) for i in picks]
    prompts = functions + [docs[i].tokens[:n].tolist() for i, n in zip(picks, lengths)]
    return [prompts[i] for i in rng.permutation(len(prompts))], len(functions)


def _continue(b, target, prompts: list[list[int]], seed: int, label: str):
    """The prompts continued by the target (`pjax.generate`, regen_temperature; stops at EOS) -> (token arrays, loss
    masks: 1 on the continuation, new tokens)."""
    import pjax
    r = b.recipe
    eos = special_ids(b)["eos_token"]
    bar = b.bar(len(prompts), label, unit="prompt")
    out_tokens, out_mask, t0, new = [], [], time.time(), 0
    for i in range(0, len(prompts), r.regen_batch):
        batch = prompts[i:i + r.regen_batch]
        res = pjax.generate(target, None, batch, max_new_tokens=r.regen_new_tokens, drafting="none",
                            temperature=r.regen_temperature, seed=[seed + i + j for j in range(len(batch))],
                            eos_token_id=eos, implementation=b.implementation)
        for p, g in zip(batch, res.tokens):
            out_tokens.append(np.asarray(p + g, np.int32))
            out_mask.append(np.concatenate([np.zeros(len(p), np.int8), np.ones(len(g), np.int8)]))
            new += len(g)
        if bar is not None:
            bar.update(len(batch))
            bar.set_postfix_str(f"{new / (time.time() - t0):.0f} new tok/s")
    if bar is not None:
        bar.close()
    return out_tokens, out_mask, new


def _save_documents(work: Path, name: str, tokens, masks) -> None:
    np.save(work / f"{name}tokens.npy", np.concatenate(tokens))
    np.save(work / f"{name}loss_mask.npy", np.concatenate(masks))
    np.save(work / f"{name}offsets.npy", np.concatenate([[0], np.cumsum([len(t) for t in tokens])]).astype(np.int64))


def _load_documents(work: Path, name: str):
    from pjax.train.data import Document
    toks, mask = np.load(work / f"{name}tokens.npy"), np.load(work / f"{name}loss_mask.npy")
    offs = np.load(work / f"{name}offsets.npy")
    return [Document(toks[a:e], mask[a:e]) for a, e in zip(offs[:-1], offs[1:])]


def stage_regen(b, work: Path) -> dict:
    """With head_data "regenerated": training-file prompts (`_prompts`) continued by the target (`_continue`) ->
    documents whose continuation is supervised; and regen_eval_prompts held-out-file prompts, continued the same way,
    for the heads' held-out evaluation. With "corpus": nothing to do."""
    r = b.recipe
    if r.head_data == "corpus":
        return dict(head_data="corpus")
    target = load_code_target(b, jnp.dtype(r.compute_dtype or "float32"))
    t0 = time.time()
    prompts, functions = _prompts(b, "train", r.regen_prompts, r.seed + 4)
    tokens, masks, new = _continue(b, target, prompts, r.seed + 4, "regenerate")
    _save_documents(work, "", tokens, masks)
    seconds = time.time() - t0
    b.log(f"regen: {len(tokens)} continuations ({functions} of functions' signatures and docstrings), "
          f"{new / 1e6:.2f} M new tokens in {seconds:.0f} s")
    prompts, held_functions = _prompts(b, "held_out", r.regen_eval_prompts, r.seed + 5)
    held, held_masks, held_new = _continue(b, target, prompts, r.seed + 5, "regenerate held-out")
    _save_documents(work, "held_out_", held, held_masks)
    b.log(f"regen: {len(held)} held-out continuations ({held_functions} of functions), {held_new / 1e6:.2f} M new "
          "tokens")
    prompt_tokens = int(sum(int(np.sum(m == 0)) for m in masks))
    return dict(head_data="regenerated", prompts=len(tokens), function_prompts=functions, prompt_tokens=prompt_tokens,
                new_tokens=new, seconds=round(seconds, 1), held_out_prompts=len(held),
                held_out_function_prompts=held_functions, held_out_new_tokens=held_new)


def head_documents(b, split: str = "train"):
    """The heads' training (split "train") or evaluation ("held_out") documents: the corpus' files of that split, or
    the regenerated continuations of its prefixes."""
    if b.recipe.head_data == "corpus":
        return documents(b, split)
    return _load_documents(b.dir("regen"), "" if split == "train" else "held_out_")


