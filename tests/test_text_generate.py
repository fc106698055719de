"""pjax.text end to end on a tiny Hugging Face Llama with a real tokenizer and a P-EAGLE head: greedy text through the
speculative path equals plain decoding, stops (EOS from generation_config.json, stop ids, stop strings cut exactly
and ending the row on the device), streaming deltas concatenate to the returned text, Ctrl-C, bad input."""
import json
import shutil

import jax
import jax.numpy as jnp
import pytest

import pjax
import pjax.text as T
from pjax.config import LayerSpec, ModelConfig, RopeSpec
from tests.engine_utils import FAST
from tests.text_utils import BOS, CHAT, END, EOS, build

PROMPTS = ["The quick brown fox", CHAT, [BOS, 40, 41, 42]]  # text, a chat, token ids
NEW = 24
K = 3  # one K for every speculative call: the programs compile once per shape


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return build(tmp_path_factory.mktemp("text"))


@pytest.fixture(scope="module")
def gen(dirs):
    return T.load(*dirs, dtype="float32", compiler_options=FAST)


def test_load(gen, dirs):
    assert gen.tokenizer.eos_token_ids == (EOS, END)  # generation_config.json's list, the tokenizer's EOS in it
    assert gen.drafter is not None and gen.target.config.vocab_size == gen.tokenizer.vocab_size
    assert "TextGenerator(target=llama" in repr(gen)


@pytest.mark.parametrize("drafting", ["parallel", "sequential"])
def test_greedy_text_equals_plain_decoding(gen, drafting):
    plain = gen.generate(PROMPTS, max_new_tokens=NEW, drafting="none")
    spec = gen.generate(PROMPTS, max_new_tokens=NEW, drafting=drafting, k=K)
    assert [o.text for o in spec] == [o.text for o in plain]
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert spec[0].stats["num_drafts"] > 0 and plain[0].stats["num_drafts"] == 0
    # the text is the tokens' text; the ids are the engine's for the rendered prompts and the EOS ids
    tok = gen.tokenizer
    prompt_ids = [tok.render(PROMPTS[0]), tok.render(CHAT), PROMPTS[2]]
    assert [o.prompt_token_ids for o in spec] == prompt_ids
    ref = pjax.generate(gen.target, None, prompt_ids, max_new_tokens=NEW, drafting="none",
                        eos_token_id=list(tok.eos_token_ids), compiler_options=FAST)
    assert [o.token_ids for o in spec] == ref.tokens
    for o in spec:
        full = tok.decode(o.token_ids)
        assert full.startswith(o.text) and set(full[len(o.text):]) <= {"\ufffd"}  # an unfinished character dropped
        assert o.finish_reason in ("stop", "length") and o.stop_reason is None
        assert o.stats["output_tokens"] == len(o.token_ids)
        assert set(o.stats) >= {"mean_acceptance_length", "acceptance_rates", "ttft_s", "output_tokens_per_s"}


def test_single_prompt_and_chat_flag(gen):
    one = gen.generate("The quick brown fox", max_new_tokens=NEW, drafting="none")
    assert isinstance(one, T.TextOutput)
    as_chat = gen.generate("The quick brown fox", chat=True, max_new_tokens=NEW, drafting="none")
    msgs = gen.generate([{"role": "user", "content": "The quick brown fox"}], max_new_tokens=NEW, drafting="none")
    assert as_chat.prompt_token_ids == msgs.prompt_token_ids != one.prompt_token_ids
    assert as_chat.text == msgs.text


def _first_plain_token(tok, ids, start=2):
    """(index, id) of the first generated token at or after `start` that is not special and has text of its own."""
    for j in range(start, len(ids)):
        if ids[j] > END and tok.decode([ids[j]]).isprintable() and "\ufffd" not in tok.decode([ids[j]]):
            return j, ids[j]
    raise AssertionError("no plain token in the output")


def test_eos_from_generation_config_and_stop_token_ids(gen, dirs, tmp_path):
    tok = gen.tokenizer
    free = gen.generate(PROMPTS[0], max_new_tokens=NEW, ignore_eos=True, drafting="none")
    j, t = _first_plain_token(tok, free.token_ids)
    j = free.token_ids.index(t)
    # a stop id: the output ends with it, its text left out, stop_reason names it
    out = gen.generate(PROMPTS[0], max_new_tokens=NEW, ignore_eos=True, stop_token_ids=[t], drafting="none")
    assert out.token_ids == free.token_ids[:j + 1] and out.finish_reason == "stop" and out.stop_reason == t
    assert out.text == _text(tok, out.prompt_token_ids, free.token_ids[:j])
    assert out.stats["output_tokens"] == j + 1  # the row stopped on the device
    inc = gen.generate(PROMPTS[0], max_new_tokens=NEW, ignore_eos=True, stop_token_ids=[t], drafting="none",
                       include_stop_str_in_output=True)
    assert inc.text == _text(tok, out.prompt_token_ids, free.token_ids[:j + 1])
    # the same id as generation_config.json's EOS: stop_reason None
    eos_dir = tmp_path / "tok"
    shutil.copytree(dirs[0], eos_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    (eos_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [t]}))
    tok2 = T.load_tokenizer(eos_dir)
    assert tok2.eos_token_ids == (t, EOS)
    g2 = T.TextGenerator(gen.target, gen.drafter, tok2, compiler_options=FAST)
    out2 = g2.generate(PROMPTS[0], max_new_tokens=NEW, drafting="none")
    assert out2.token_ids == out.token_ids and out2.text == out.text
    assert out2.finish_reason == "stop" and out2.stop_reason is None


def _text(tok, prompt, ids):
    o = T.OutputText(tok, prompt)
    for t in ids:
        o.add(t)
    return o.text


def _stop_from(text, at, n):
    """A stop string of n characters at `at` in text, moved right past any U+FFFD."""
    while "\ufffd" in text[at:at + n]:
        at += 1
    assert at + n <= len(text)
    return text[at:at + n]


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_cut_exactly(gen, include):
    tok = gen.tokenizer
    free = gen.generate(PROMPTS, max_new_tokens=NEW, ignore_eos=True, k=K)
    stops = [_stop_from(free[0].text, len(free[0].text) // 2, 2), _stop_from(free[1].text, 3, 3)]
    out = gen.generate(PROMPTS, max_new_tokens=NEW, k=K, ignore_eos=True, stop=stops,
                       include_stop_str_in_output=include)
    for o, f in zip(out, free):
        # expected: the first token whose text completes a stop string; among those it completes, the earliest
        for n in range(1, len(f.token_ids) + 1):
            text = _text(tok, f.prompt_token_ids, f.token_ids[:n])
            hits = sorted((text.find(s), i, s) for i, s in enumerate(stops) if s in text)
            if hits:
                break
        if not hits:
            assert (o.text, o.token_ids, o.finish_reason) == (f.text, f.token_ids, "length")
            continue
        at, _, s = hits[0]
        assert o.text == text[:at + len(s) if include else at]
        assert o.token_ids == f.token_ids[:n] and o.finish_reason == "stop" and o.stop_reason == s
        assert o.stats["output_tokens"] == n < NEW  # the row stopped on the device
    assert out[0].stop_reason == stops[0] and out[1].stop_reason in stops


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.9, top_k=50, seed=[1, 2, 3])],
                         ids=["greedy", "sampled"])
@pytest.mark.parametrize("with_stop", [False, True])
def test_stream_deltas_concatenate_to_the_text(gen, sampling, with_stop):
    free = gen.generate(PROMPTS, max_new_tokens=NEW, k=K, **sampling)
    stop = [_stop_from(free[0].text, len(free[0].text) // 3, 2)] if with_stop else None
    kw = dict(max_new_tokens=NEW, k=K, stop=stop, **sampling)
    want = gen.generate(PROMPTS, **kw)
    fine = T.TextGenerator(gen.target, gen.drafter, gen.tokenizer, compiler_options=FAST, rounds_per_step=1)
    stream = fine.stream(PROMPTS, **kw)
    texts, ids, finished, deltas = ["", "", ""], [[], [], []], [None] * 3, 0
    for d in stream:
        assert finished[d.index] is None  # nothing after a request's last delta
        texts[d.index] += d.text
        ids[d.index] += d.token_ids
        deltas += 1
        if d.finished:
            finished[d.index] = d.finish_reason
    assert deltas > 6  # many device chunks
    got = stream.result()
    assert texts == [o.text for o in want] == [o.text for o in got]
    assert ids == [o.token_ids for o in want] == [o.token_ids for o in got]
    assert finished == [o.finish_reason for o in want]
    if with_stop:
        assert want[0].stop_reason == stop[0]
    left = fine.stream(PROMPTS, **kw)  # a stream left mid-chunk still completes every request in result()
    for n, _ in enumerate(left):
        if n == 1:  # the first chunk has one delta per request (the prefill token)
            break
    assert [o.text for o in left.result()] == texts


def test_ctrl_c_returns_the_text_so_far(gen):
    full = gen.generate(PROMPTS, max_new_tokens=NEW, k=K, ignore_eos=True)
    fine = T.TextGenerator(gen.target, gen.drafter, gen.tokenizer, compiler_options=FAST, rounds_per_step=1)
    stream = fine.stream(PROMPTS, max_new_tokens=NEW, k=K, ignore_eos=True)
    engine = stream._gen._engine
    step, calls = engine.step, []

    def flaky(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step(*a, **kw)
    engine.step = flaky
    seen = ["", "", ""]
    with pytest.raises(T.TextGenerationInterrupted) as e:
        for d in stream:
            seen[d.index] += d.text
    assert isinstance(e.value, KeyboardInterrupt)
    for part, whole, s in zip(e.value.outputs, full, seen):
        assert part.finish_reason == "interrupted"
        assert 1 <= len(part.token_ids) < NEW and whole.token_ids[:len(part.token_ids)] == part.token_ids
        assert part.text.startswith(s) and whole.text.startswith(part.text)


def test_bad_input(gen):
    g = gen.generate
    with pytest.raises(ValueError, match=r"k must be an integer >= 1 .* got 0"):
        g("a", max_new_tokens=4, k=0)
    with pytest.raises(ValueError, match="drafting='fast'"):
        g("a", max_new_tokens=4, drafting="fast")
    plain = T.TextGenerator(gen.target, None, gen.tokenizer, compiler_options=FAST)
    with pytest.raises(ValueError, match="drafting='parallel' needs a drafter"):
        plain.generate("a", max_new_tokens=4, drafting="parallel")
    with pytest.raises(ValueError, match=r"prompts\[1\]: messages\[0\] has no 'role'"):
        g(["a", [{"content": "x"}]], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"prompt: messages\[0\] \(role 'user'\) has no 'content'"):
        g([{"role": "user"}], max_new_tokens=4)
    with pytest.raises(TypeError, match="prompts: a string, a chat"):
        g(None, max_new_tokens=4)
    with pytest.raises(TypeError, match=r"empty"):
        g([], max_new_tokens=4)
    with pytest.raises(ValueError, match="chat=True needs text or messages"):
        g([BOS, 5], chat=True, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"stop\[0\] is empty"):
        g("a", max_new_tokens=4, stop=[""])
    with pytest.raises(ValueError, match=r"stop_token_ids: 320 outside the target's vocabulary \[0, 320\)"):
        g("a", max_new_tokens=4, stop_token_ids=[320])
    with pytest.raises(ValueError, match="max_new_tokens=0 must be >= 1"):
        g("a", max_new_tokens=0)
    with pytest.raises(ValueError, match=r"top_p=1.5 must be <= 1"):
        g("a", max_new_tokens=4, top_p=1.5)
    with pytest.raises(TypeError, match="target must be a pjax Target"):
        T.TextGenerator("/models/x", gen.drafter, gen.tokenizer)
    with pytest.raises(TypeError, match="tokenizer must be a pjax.text.Tokenizer"):
        T.TextGenerator(gen.target, gen.drafter, "tok")
    with pytest.raises(T.TokenizerError, match="no such directory"):
        T.load("/no/such/model")
    cfg = ModelConfig("llama", 300, 32, 64, 4, (LayerSpec(8, 2, RopeSpec(theta=1e4)),), rms_norm_eps=1e-5)
    small = pjax.init_target(cfg, jax.random.key(0), jnp.float32)
    with pytest.warns(UserWarning, match="the tokenizer has 320 tokens but the target's vocabulary is 300"):
        T.TextGenerator(small, None, gen.tokenizer)
