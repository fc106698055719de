"""The README main job (examples/train_peagle.py) end to end, shortened: trains, exports a head that
pjax.load_drafter reads back, and speculative decoding reproduces plain greedy decoding."""
import importlib.util
from pathlib import Path
import pjax



def test_main_job_short(tmp_path):
    path = Path(__file__).resolve().parents[1] / "examples" / "train_peagle.py"
    spec = importlib.util.spec_from_file_location("train_peagle", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "head"
    report = mod.tiny_job(["--target-steps", "30", "--steps", "30", "--no-progress", "--out", str(out)])
    assert report["identical_to_plain"] is True
    assert 1.0 <= report["acceptance_length"] <= 5.0
    head = pjax.load_drafter(out)
    assert head.config.num_aux == 3 and head.config.mask_token_id is not None
