"""pjax.text's tokenizer against transformers' own tokenizer loaded from the same Hugging Face directory: ids and text
round trips, chat templates (string and ids), EOS ids, the legacy special-tokens file, and the errors of a broken
directory. Then the incremental text of one output: whole characters only, stop strings, held-back deltas."""
import json
import random
import shutil

import pytest
import transformers as tf

import pjax.text as T
from pjax.text.detokenize import OutputText, check_stop_strings
from tests.text_utils import BOS, CHAT, CHAT_TEMPLATE, END, EOS, V, write_tokenizer

TEXTS = ["The quick brown fox", "  leading and trailing spaces  ", "Héllo wörld 你好，世界 🙂🚀 naïve café",
         "def add(a, b):\n    return a + b\n", "tabs\tand\r\nnewlines\n\n", "<|start|>user\nspecial in text<|end|>",
         "", "x", "12 * 7 = 84?!"]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def pair(tok_dir):
    return T.load_tokenizer(tok_dir), tf.AutoTokenizer.from_pretrained(tok_dir)


def test_encode_decode_match_transformers(pair):
    tok, ref = pair
    assert tok.vocab_size == len(ref) == V
    assert (tok.bos_token, tok.eos_token) == (ref.bos_token, ref.eos_token)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref(text).input_ids and ids[0] == BOS
        assert tok.encode(text, add_special_tokens=False) == ref(text, add_special_tokens=False).input_ids
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
        assert tok.decode(ids) == text.replace("<|start|>", "").replace("<|end|>", "")  # round trip
    rng = random.Random(0)
    for _ in range(50):  # any id sequence, partial UTF-8 and special tokens included
        ids = [rng.randrange(V) for _ in range(rng.randrange(1, 20))]
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("layout", ["jinja_file", "tokenizer_config"])
def test_chat_template_matches_transformers(tmp_path, layout):
    path = write_tokenizer(tmp_path, template_in_config=layout == "tokenizer_config")
    assert (path / "chat_template.jinja").exists() == (layout == "jinja_file")
    tok, ref = T.load_tokenizer(path), tf.AutoTokenizer.from_pretrained(path)
    assert tok.has_chat_template
    tools = [{"type": "function", "function": {"name": "température", "parameters": {"type": "object"}}}]
    chats = [CHAT, CHAT[1:2], [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                               {"role": "user", "content": "again"}]]
    for chat in chats:
        for gen_prompt in (True, False):
            for kw in ({}, {"tools": tools}):
                want = ref.apply_chat_template(chat, add_generation_prompt=gen_prompt, tokenize=False, **kw)
                got = tok.apply_chat_template(chat, add_generation_prompt=gen_prompt, tokenize=False, **kw)
                assert got == want
                want_ids = ref.apply_chat_template(chat, add_generation_prompt=gen_prompt, tokenize=True,
                                                   return_dict=False, **kw)
                assert tok.apply_chat_template(chat, add_generation_prompt=gen_prompt, **kw) == want_ids
    s = tok.apply_chat_template(CHAT, tokenize=False)
    assert s.startswith("<|bos|><|start|>system\n") and s.endswith("<|start|>assistant\n")  # trim / lstrip blocks
    assert '"Be brief — très brief."' in s  # tojson keeps non-ASCII characters
    assert tok.apply_chat_template(CHAT, tools=tools, tokenize=False).count("température") == 1


def test_template_kwargs_and_errors(tmp_path):
    extra = CHAT_TEMPLATE.replace("<|start|>assistant\n{% endif %}",
                                  "<|start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
                                  "(no thinking)\n{% endif %}{% endif %}")
    extra = extra.replace("{{- bos_token }}", "{{- bos_token }}{{ think_token }}{{ image_token }}")
    path = write_tokenizer(tmp_path / "a", template=extra)
    cfg = json.loads((path / "tokenizer_config.json").read_text())  # a model's own named tokens are variables too
    cfg.update(think_token="<|end|>", add_bos_token=False, extra_special_tokens={"image_token": "<|pad|>"})
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok, ref = T.load_tokenizer(path), tf.AutoTokenizer.from_pretrained(path)
    want = ref.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert tok.apply_chat_template(CHAT, tokenize=False, enable_thinking=False) == want
    assert want.startswith("<|bos|><|end|><|pad|>") and want.endswith("(no thinking)\n")
    assert tok.render(CHAT, chat_template_kwargs={"enable_thinking": False}) == tok.encode(want,
                                                                                         add_special_tokens=False)
    with pytest.raises(T.TemplateError, match="unknown role: tool"):  # the template's raise_exception
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    broken = write_tokenizer(tmp_path / "b", template="{% for m in messages %}{{ m['content'] }")
    with pytest.raises(T.TemplateError, match="syntax error"):
        T.load_tokenizer(broken).apply_chat_template(CHAT)


def test_render(pair):
    tok, ref = pair
    assert tok.render("The quick brown") == ref("The quick brown").input_ids
    one = [{"role": "user", "content": "The quick brown"}]
    assert tok.render("The quick brown", chat=True) == tok.apply_chat_template(one) == ref.apply_chat_template(
        one, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tok.render(CHAT) == tok.render(CHAT, chat=True) == tok.apply_chat_template(CHAT)
    with pytest.raises(ValueError, match="chat=False"):
        tok.render(CHAT, chat=False)
    with pytest.raises(ValueError, match=r"messages\[1\] has no 'role'"):
        tok.render([{"role": "user", "content": "a"}, {"content": "b"}])
    with pytest.raises(ValueError, match=r"messages\[0\] \(role 'user'\) has no 'content'"):
        tok.render([{"role": "user"}])
    with pytest.raises(TypeError, match=r"messages\[1\] must be a dict"):
        tok.render([{"role": "user", "content": "a"}, "b"])
    with pytest.raises(TypeError, match=r"messages\[0\]\['content'\] must be a string"):
        tok.render([{"role": "user", "content": 3}])
    with pytest.raises(TypeError, match="a prompt is a string or a list"):
        tok.render(17)
    with pytest.raises(TypeError, match="empty"):
        tok.render([])


def _copy(src, dst, **json_files):
    shutil.copytree(src, dst)
    for name, data in json_files.items():
        p = dst / f"{name}.json"
        if data is None:
            p.unlink(missing_ok=True)
        else:
            p.write_text(data if isinstance(data, str) else json.dumps(data))
    return dst


def test_eos_ids(tok_dir, tmp_path):
    assert T.load_tokenizer(tok_dir).eos_token_ids == (EOS,)  # no generation config, no config.json: the tokenizer's
    gen = _copy(tok_dir, tmp_path / "gen", generation_config={"eos_token_id": [EOS, END], "bos_token_id": BOS})
    assert T.load_tokenizer(gen).eos_token_ids == (EOS, END)
    one = _copy(tok_dir, tmp_path / "one", generation_config={"eos_token_id": END})
    assert T.load_tokenizer(one).eos_token_ids == (END, EOS)
    cfg = _copy(tok_dir, tmp_path / "cfg", config={"model_type": "llama", "eos_token_id": END})
    assert T.load_tokenizer(cfg).eos_token_ids == (END, EOS)  # config.json when there is no generation config
    both = _copy(cfg, tmp_path / "both", generation_config={"eos_token_id": None})
    assert T.load_tokenizer(both).eos_token_ids == (EOS,)  # the generation config decides
    bad = _copy(tok_dir, tmp_path / "bad", generation_config={"eos_token_id": "</s>"})
    with pytest.raises(T.TokenizerError, match=r"generation_config.json: eos_token_id must be a token id"):
        T.load_tokenizer(bad)


def test_legacy_special_tokens_map(tok_dir, tmp_path):
    """special_tokens_map.json overrides the config's tokens when the config has no added_tokens_decoder (as in
    transformers)."""
    legacy = _copy(tok_dir, tmp_path / "legacy", special_tokens_map={"eos_token": {"content": "<|end|>"}})
    tok, ref = T.load_tokenizer(legacy), tf.AutoTokenizer.from_pretrained(legacy)
    assert tok.eos_token == ref.eos_token == "<|end|>" and tok.eos_token_ids == (END,)
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"] = {str(i): {"content": s, "special": True, "lstrip": False, "rstrip": False,
                                            "normalized": False, "single_word": False}
                                   for i, s in enumerate(["<|bos|>", "<|eos|>", "<|pad|>"])}
    modern = _copy(legacy, tmp_path / "modern", tokenizer_config=cfg)
    tok, ref = T.load_tokenizer(modern), tf.AutoTokenizer.from_pretrained(modern)
    assert tok.eos_token == ref.eos_token == "<|eos|>"


def test_broken_directories(tok_dir, tmp_path):
    with pytest.raises(T.TokenizerError, match=r"no-such-dir: no such directory"):
        T.load_tokenizer(tmp_path / "no-such-dir")
    (tmp_path / "empty").mkdir()
    with pytest.raises(T.TokenizerError, match=r"empty: no tokenizer.json \(looked for tokenizer.json, "
                                               r"tokenizer_config.json"):
        T.load_tokenizer(tmp_path / "empty")
    (tmp_path / "slow").mkdir()
    (tmp_path / "slow" / "tokenizer.model").write_bytes(b"\0")
    with pytest.raises(T.TokenizerError, match="only a slow sentencepiece tokenizer"):
        T.load_tokenizer(tmp_path / "slow")
    bad_json = _copy(tok_dir, tmp_path / "bad_json", tokenizer_config="{not json")
    with pytest.raises(T.TokenizerError, match=r"bad_json/tokenizer_config.json: not valid JSON"):
        T.load_tokenizer(bad_json)
    garbage = _copy(tok_dir, tmp_path / "garbage", tokenizer='{"model": 3}')
    with pytest.raises(T.TokenizerError, match=r"garbage/tokenizer.json: cannot be read by the tokenizers"):
        T.load_tokenizer(garbage)
    bad_token = _copy(tok_dir, tmp_path / "bad_token", tokenizer_config={"eos_token": 5})
    with pytest.raises(T.TokenizerError, match=r"tokenizer_config.json: eos_token: expected a token string"):
        T.load_tokenizer(bad_token)
    plain = write_tokenizer(tmp_path / "plain", template=None)
    tok = T.load_tokenizer(plain)
    assert not tok.has_chat_template and tok.render("abc") == tok.encode("abc")
    with pytest.raises(T.TokenizerError, match=r"plain: no chat template \(looked for chat_template.jinja"):
        tok.render("abc", chat=True)


# ------------------------------------------------------------------------------------------ incremental text

def _run(tok, prompt, ids, chunks, **kw):
    """Feed `ids` in chunks of the given sizes; returns (deltas, OutputText)."""
    out, deltas, i = OutputText(tok, prompt, **kw), [], 0
    for n in chunks:
        for t in ids[i:i + n]:
            if out.add(t):
                break
        i += n
        deltas.append(out.take(final=out.stop_string is not None or i >= len(ids)))
        if out.stop_string is not None:
            break
    return deltas, out


def _chunkings(n, rng):
    yield [n]
    yield [1] * n
    for _ in range(5):
        sizes, left = [], n
        while left > 0:
            sizes.append(min(left, rng.randrange(1, 5)))
            left -= sizes[-1]
        yield sizes


def test_incremental_text_whole_characters(pair):
    tok, _ = pair
    rng = random.Random(1)
    prompt = tok.encode("Héllo ")
    for text in TEXTS[:5]:
        ids = tok.encode(text, add_special_tokens=False)
        for chunks in _chunkings(len(ids), rng):
            deltas, out = _run(tok, prompt, ids, chunks)
            assert "".join(deltas) == out.text == text  # whole characters: no U+FFFD on the way
            assert all("\ufffd" not in d for d in deltas)
    ids = tok.encode("你好", add_special_tokens=False)
    out = OutputText(tok, prompt)
    for t in ids[:-1]:
        out.add(t)
    assert out.text == "你"  # the second character is still incomplete: held by the decode stream
    assert tok.decode(out.token_ids) == "你\ufffd"


def test_stop_strings_cut_exactly(pair):
    tok, _ = pair
    rng = random.Random(2)
    text = "alpha beta gamma; beta delta. Héllo 你好 world"
    ids = tok.encode(text, add_special_tokens=False)
    cases = [(["beta"], "alpha ", "alpha beta"), (["ta", "gamma"], "alpha be", "alpha beta"),
             (["gamma", " beta"], "alpha", "alpha beta"), (["你好"], "alpha beta gamma; beta delta. Héllo ",
                                                          "alpha beta gamma; beta delta. Héllo 你好"),
             (["; beta d"], "alpha beta gamma", "alpha beta gamma; beta d"), (["zzz"], text, text)]
    for stop, excluded, included in cases:
        for include, want in ((False, excluded), (True, included)):
            for chunks in _chunkings(len(ids), rng):
                deltas, out = _run(tok, [BOS], ids, chunks, stop=check_stop_strings(stop),
                                   include_stop_str_in_output=include)
                assert "".join(deltas) == out.text == want, (stop, include, chunks)
                if want != text:
                    assert out.stop_string in stop
                    # the ids end with the token that completed the stop string
                    assert tok.decode(out.token_ids[:-1]).find(out.stop_string) < 0
                    assert out.stop_string in tok.decode(out.token_ids)


def test_held_back_text_is_never_taken_back(pair):
    """Streaming holds back exactly the end of the text that could start the stop string ("b", "be", "bet") and
    nothing else; what was handed out is a prefix of the final text."""
    tok, _ = pair
    ids = tok.encode("abet betting alphabet beta", add_special_tokens=False)
    out, seen, held = OutputText(tok, [BOS], stop=("beta",)), [], []
    for t in ids:
        if out.add(t):
            break
        seen.append(out.take())
        held.append(out.text[len("".join(seen)):])
        assert held[-1] == max(("beta"[:n] for n in range(4) if out.text.endswith("beta"[:n])), key=len)
    seen.append(out.take(final=True))
    assert "".join(seen) == out.text == "abet betting alphabet " and out.stop_string == "beta"
    assert {"", "b", "bet"} == set(held)  # tokens here: "a" "b" "et" " b" "et" "t" ... "a"


def test_stop_token_text_left_out(pair):
    tok, _ = pair
    ids = tok.encode("ok then", add_special_tokens=False)
    for include in (False, True):
        out = OutputText(tok, [BOS], include_stop_str_in_output=include, skip_special_tokens=False)
        for t in ids:
            out.add(t)
        out.add(EOS, is_stop_token=True)
        assert out.token_ids == ids + [EOS]
        assert out.text == ("ok then<|eos|>" if include else "ok then")


def test_decode_stream_restarts_after_an_invalid_prefix(pair, monkeypatch):
    """tokenizers' DecodeStream fails with "Invalid prefix encountered" when a decoder rewrites earlier text: the
    output restarts its stream from the failing token and goes on."""
    import pjax.text.detokenize as D
    tok, _ = pair
    real, made = D.DecodeStream, []

    class Flaky:
        def __init__(self, **kw):
            self.inner, self.fail = real(**kw), not made
            made.append(self)

        def step(self, backend, token):
            if self.fail and token == ids[2]:
                raise Exception("Invalid prefix encountered while decoding")
            return self.inner.step(backend, token)
    monkeypatch.setattr(D, "DecodeStream", Flaky)
    ids = tok.encode("alpha beta gamma", add_special_tokens=False)
    out = OutputText(tok, [BOS])
    for t in ids:
        out.add(t)
    assert len(made) == 2 and out.text == "alpha beta gamma"


def test_stop_string_checks():
    assert check_stop_strings(None) == () and check_stop_strings("a") == ("a",)
    assert check_stop_strings(["a", "b", "a"]) == ("a", "b")
    with pytest.raises(ValueError, match=r"stop\[1\] is empty"):
        check_stop_strings(["a", ""])
    with pytest.raises(TypeError, match=r"stop\[0\] must be a string"):
        check_stop_strings([3])
    with pytest.raises(TypeError, match="stop must be a string or a list"):
        check_stop_strings(3)
