"""Helpers to build tiny random Hugging Face checkpoints on CPU for parity tests."""
import numpy as np
import torch


def save_tiny(model_cls, config, path, seed=0, init_std=None):
    """Instantiate `model_cls(config)` with seeded random weights in float32, save_pretrained to path."""
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    if init_std is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.ndim >= 1 and "norm" not in name:
                    p.normal_(0, init_std)
    model.save_pretrained(path)
    return model


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(ids))).logits.float().numpy()


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
