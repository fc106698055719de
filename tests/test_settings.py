"""The one settings object: EngineConfig's defaults are every client's, its CLI flags are defined once (the same flag,
type and help in `pjax generate`, `pjax bench` and `pjax serve`), and the drafting strategy resolves K from the head."""
import pytest

from pjax.bench.cli import SETTINGS_FLAGS
from pjax.bench.cli import build_parser as bench_parser
from pjax.decode import Drafting, EngineConfig
from pjax.decode.drafting import resolve
from pjax.decode.settings import FLAGS, config_from_flags, configure
from pjax.serve.cli import build_parser as serve_parser
from pjax.text.cli import build_parser as text_parser


def _actions(parser):
    return {a.dest: a for a in parser._actions}


def test_flags_are_the_same_everywhere():
    base = ["--target", "t", "--out", "o"]
    parsers = {"generate": (text_parser(), ["--target", "t", "--prompt", "p"], tuple(FLAGS)),
               "bench": (bench_parser(), base, SETTINGS_FLAGS), "serve": (serve_parser(), ["--target", "t"], tuple(FLAGS))}
    seen = {}
    for name, (parser, required, fields) in parsers.items():
        actions = _actions(parser)
        for field in fields:
            if field not in actions:
                continue
            a = actions[field]
            assert a.option_strings == [FLAGS[field][0]] and a.default is None
            seen.setdefault(field, set()).add((a.help, a.choices and tuple(a.choices), a.metavar))
        # no flag given: the EngineConfig defaults
        assert config_from_flags(parser.parse_args(required), fields) == EngineConfig()
    assert all(len(forms) == 1 for forms in seen.values()), seen
    assert {"drafting", "num_speculative_tokens", "rounds_per_step", "prefill", "implementation"} <= set(seen)


def test_flags_give_the_config():
    args = serve_parser().parse_args(["--target", "t", "--k", "5", "--rounds-per-step", "16", "--prefill", "padded"])
    assert config_from_flags(args, max_len=64) == EngineConfig(num_speculative_tokens=5, rounds_per_step=16,
                                                               prefill="padded", max_len=64)
    args = serve_parser().parse_args(["--target", "t", "--tree-budget", "auto"])
    assert config_from_flags(args) == EngineConfig(tree_budget="auto")
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--target", "t", "--drafting", "tree"])


def test_configure_names_unknown_settings():
    assert configure(EngineConfig(max_slots=4), prefill="packed") == EngineConfig(max_slots=4, prefill="packed")
    with pytest.raises(TypeError, match="unknown setting.*chunk_seconds: expected EngineConfig fields"):
        configure(chunk_seconds=1.0)


def test_drafting_strategy():
    assert Drafting.parse("parallel") is Drafting.PARALLEL == "parallel" and str(Drafting.NONE) == "none"
    assert not Drafting.NONE.speculative and Drafting.PARALLEL.one_pass and not Drafting.SEQUENTIAL.one_pass
    with pytest.raises(ValueError, match=r"drafting='tree': expected one of \('parallel', 'sequential', 'none'\)"):
        Drafting.parse("tree")
    assert resolve(None) == (Drafting.NONE, 0)
    with pytest.raises(ValueError, match="needs a drafter"):
        resolve(None, "parallel")
