"""Text in, text out: the target's Hugging Face tokenizer and chat template, stop strings, streaming text.

    gen = pjax.text.load("/models/Llama-3.1-8B-Instruct", "/models/Llama-3.1-8B-P-EAGLE")
    out = gen.generate([{"role": "user", "content": "Name three prime numbers."}], max_new_tokens=128)
    print(out.text, out.stats["mean_acceptance_length"])

Needs the `text` extra (`tokenizers`, `jinja2`): pip install 'pjax[text]'. `python -m pjax generate` is the command.
"""
from pjax.text.detokenize import OutputText
from pjax.text.generate import TextDelta, TextGenerationInterrupted, TextGenerator, TextOutput, TextStream, load
from pjax.text.template import TemplateError
from pjax.text.tokenizer import Tokenizer, TokenizerError, load_tokenizer

__all__ = ["OutputText", "TemplateError", "TextDelta", "TextGenerationInterrupted", "TextGenerator", "TextOutput",
           "TextStream", "Tokenizer", "TokenizerError", "load", "load_tokenizer"]
