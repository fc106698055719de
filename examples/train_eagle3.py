"""Train an EAGLE-3 head in JAX (training-time test objective) with the P-EAGLE pipeline.

Same options as examples/train_peagle.py (run with --help); the objective defaults to eagle3 and the
tiny job reports the acceptance length of sequential (autoregressive) drafting.

    python examples/train_eagle3.py                  # tiny built-in job
    python examples/train_eagle3.py --target /models/Llama-3.1-8B-Instruct --data chats.jsonl \
        --ttt-steps 3 --draft-vocab-size 32000 --out heads/llama8b-eagle3
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train_peagle import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(objective="eagle3"))
