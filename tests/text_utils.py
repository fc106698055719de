"""Shared pieces of the text tests: a real byte-level BPE tokenizer trained by the `tokenizers` library and saved in
the Hugging Face layout by transformers (special tokens, a chat template), a tiny Llama target saved next to it, and
a random P-EAGLE head. transformers and torch are imported by the helpers that write with them."""
import functools
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

import pjax
from tests.engine_utils import make_drafter
from tests.hf_utils import randomize

V = 320  # tokenizer vocabulary = the model's
SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|start|>", "<|end|>"]  # ids 0..4
BOS, EOS, PAD, START, END = range(5)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 8,
    "Speculative decoding: a small drafter proposes tokens, the target verifies them in one pass.\n" * 4,
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n" * 4,
    "Héllo wörld! Ünïcödé çharacters, 你好，世界 🙂🚀 — café naïve.\n" * 4,
    "Name three prime numbers: 2, 3, 5, 7, 11, 13. What is 12 * 7? It is 84.\n" * 4,
]
# a template written the way real ones are: indented blocks (trim_blocks / lstrip_blocks matter), raise_exception,
# loop controls, tojson on non-ASCII content, {% generation %}, strftime_now, the special tokens as variables
CHAT_TEMPLATE = """{{- bos_token }}
{%- if tools is not none %}
<|start|>tools
{{ tools | tojson }}<|end|>
{%- endif %}
{% for message in messages %}
    {% if message['role'] not in ('system', 'user', 'assistant') %}
        {{ raise_exception('unknown role: ' ~ message['role']) }}
    {% endif %}
    {% if message['content'] is none %}
        {% continue %}
    {% endif %}
<|start|>{{ message['role'] }}
    {% if message['role'] == 'system' %}
year {{ strftime_now('%Y') }}; {{ message['content'] | tojson }}
    {% elif message['role'] == 'assistant' %}
{% generation %}{{ message['content'] | trim }}{{ eos_token }}{% endgeneration %}
    {% else %}
{{ message['content'] | trim }}
    {% endif %}
<|end|>
{% endfor %}
{% if add_generation_prompt %}
<|start|>assistant
{% endif %}"""
CHAT = [{"role": "system", "content": "Be brief — très brief."},
        {"role": "user", "content": "  Name three prime numbers.  "},
        {"role": "assistant", "content": "2, 3, 5."},
        {"role": "user", "content": "And 你好?"}]


def train_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=V, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B",
                                                       special_tokens=[("<|bos|>", BOS)])
    assert tok.get_vocab_size() == V and [tok.token_to_id(s) for s in SPECIALS] == list(range(5))
    return tok


def write_tokenizer(path, *, template=CHAT_TEMPLATE, template_in_config=False):
    """The Hugging Face layout written by transformers (tokenizer.json, tokenizer_config.json, chat_template.jinja);
    template_in_config: the template as tokenizer_config.json's "chat_template" instead (the older layout)."""
    import transformers as tf

    path = Path(path)
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(), bos_token="<|bos|>", eos_token="<|eos|>",
                                      pad_token="<|pad|>")
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(path)
    if template is not None and template_in_config:
        (path / "chat_template.jinja").unlink()
        cfg = json.loads((path / "tokenizer_config.json").read_text())
        cfg["chat_template"] = template
        (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


@functools.lru_cache(maxsize=None)
def build(root: Path):
    """A tiny random Llama (vocabulary V, EOS ids [EOS, END] in generation_config.json) with the tokenizer in one
    directory, and a random P-EAGLE head saved in the speculators format. Returns (target_dir, head_dir)."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=BOS, eos_token_id=[EOS, END], pad_token_id=PAD)
    model = randomize(tf.LlamaForCausalLM(cfg).float().eval(), std=0.2)
    target_dir = root / "target"
    model.save_pretrained(target_dir)
    write_tokenizer(target_dir)
    gen = json.loads((target_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [EOS, END]
    target = pjax.load_target(target_dir, dtype="float32")
    head_dir = root / "head"
    pjax.save_drafter(make_drafter(target), head_dir, dtype="float32")
    return target_dir, head_dir
