"""`python -m pjax check` on CPU: the P-EAGLE head section (its float64 reference of the drafter forward agrees with
pjax's forward under every implementation), the exit status (1 when a row misses its bound, 2 on a bad --only), and
the targets section skipped, not failed, where transformers cannot be imported."""
import json
import sys

import pytest

import pjax.check.drafter
from pjax.cli import main


def test_drafter_section_passes_and_a_missed_bound_fails(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out" / "rows.json"  # a missing parent directory is created
    assert main(["check", "--quick", "--only", "drafter", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["impl"] for r in rows] == ["xla", "pallas", "auto"] and all(r["ok"] for r in rows)
    assert all(0 < r["rel_err"] <= 1e-5 for r in rows)  # float32 vs float64: real rounding, far below the bound
    assert "cache_attention" in rows[1]["ran"] and rows[0]["ran"] == "-"
    assert {r["section"] for r in rows} == {"drafter"}
    assert "3 passed, 0 failed" in capsys.readouterr().out
    monkeypatch.setattr(pjax.check.drafter, "PARITY_BOUND", 1e-12)
    assert main(["check", "--quick", "--only", "drafter"]) == 1
    assert "0 passed, 3 failed" in capsys.readouterr().out


@pytest.mark.parametrize("only", ["drafter,nonesuch", ""])
def test_bad_only_is_a_usage_error(only, capsys):
    with pytest.raises(SystemExit) as e:
        main(["check", "--quick", "--only", only])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --only: unknown section" in err and "kernels,targets,drafter" in err


def test_json_path_that_cannot_be_written_fails_before_the_run(tmp_path, capsys):
    assert main(["check", "--quick", "--only", "drafter", "--json", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: --json ") and "is a directory" in captured.err
    assert "passed" not in captured.out


def test_targets_section_is_skipped_without_transformers(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    assert main(["check", "--quick", "--only", "targets"]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("skipped")] == [
        "skipped: needs transformers and torch (pip install 'transformers>=5.17,<=5.19' torch; CPU torch is enough)"]
    assert "0 passed, 0 failed, skipped: targets" in out
