"""The model flags of `urpe reproduce` (--normalization, --position, --gate, --mixer, --backend)
take their choices from the registries: a name registered before the parser is built is usable
on the command line with no other edit, and a flag left out leaves every run's identity alone."""

import json
from dataclasses import replace

import pytest

from urpe.cli import _command, build_parser, main
from urpe.experiments.command import resolve
from urpe.kernels import NORMALIZATIONS, register_normalization, registered

from .tiny import tiny_flags

SYNTHETIC = ["reproduce", "synthetic", "--tasks", "probe", "--variants", "rpe,urpe"]
TINY = tiny_flags("synthetic", tasks=None, variants=None, steps=2, eval_sequences=8)


def _configs(argv: list[str]) -> list[dict]:
    """The transformer config of every run the command line plans."""
    args = build_parser(argv).parse_args(argv)
    experiment = _command(args.module).load()
    settings = resolve(experiment, args)
    return [s.config["model"]["transformer"] for s in experiment.plan(settings, "32-true")]


@pytest.fixture
def copied_softmax():
    """softmax under another name, registered for one test."""
    copy = replace(NORMALIZATIONS["softmax"], name="softmax-copy")
    with registered(register_normalization, copy):
        yield "softmax-copy"


def test_a_registered_normalization_is_a_command_line_choice(copied_softmax, capsys):
    argv = [*SYNTHETIC, "--normalization", copied_softmax]
    assert build_parser(argv).parse_args(argv).normalization == copied_softmax
    with pytest.raises(SystemExit) as exit_:  # a name nobody registered
        main([*SYNTHETIC, "--normalization", "softmax-unregistered"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --normalization: invalid choice: 'softmax-unregistered'" in err


def test_a_registered_normalization_trains_through_the_command_line(copied_softmax, tmp_path):
    out = tmp_path / "out"
    assert (
        main(
            [
                *SYNTHETIC,
                "--variants",
                "urpe",
                *TINY,
                "--normalization",
                copied_softmax,
                "--out",
                str(out),
            ]
        )
        == 0
    )
    (record,) = [json.loads(p.read_text()) for p in (out / "records").glob("*.json")]
    assert record["config"]["model"]["transformer"]["normalization"] == copied_softmax


def test_given_flags_set_every_runs_config_and_absent_ones_change_nothing():
    plain = _configs(SYNTHETIC)
    chosen = _configs(
        [
            *SYNTHETIC,
            "--normalization",
            "l2",
            "--position",
            "alibi",
            "--gate",
            "none",
            "--mixer",
            "conv",
            "--backend",
            "reference",
            "--layers",
            "2",
        ]
    )
    for config in chosen:
        assert (config["normalization"], config["position"], config["gate"]) == (
            "l2",
            "alibi",
            None,
        )
        assert config["mixers"] == {"0": "conv", "1": "conv"}
        assert config["attention_backend"] == "reference"
    assert [c["gate"] for c in plain] == [None, "toeplitz"]  # rpe has none, urpe its own
    assert all(c["normalization"] == "softmax" and c["mixers"] == {} for c in plain)
    # `--mixer attention` and the variants' own values give the configs of no flag at all.
    same = [*SYNTHETIC, "--mixer", "attention", "--normalization", "softmax", "--backend", "auto"]
    assert _configs(same) == plain


def test_the_lm_command_takes_the_same_flags():
    args = build_parser(["reproduce", "lm", "--gate", "toeplitz", "--position", "rope"])
    parsed = args.parse_args(["reproduce", "lm", "--gate", "toeplitz", "--position", "rope"])
    assert (parsed.gate, parsed.position) == ("toeplitz", "rope")


REFUSED = [
    ("--position", "relation"),
    ("--gate", "relation"),
    ("--backend", "no-such"),
    ("--mixer", "lstm"),
]


@pytest.mark.parametrize("flag, value", REFUSED)
def test_names_a_sequence_model_cannot_run_are_refused_in_one_line(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*SYNTHETIC, flag, value])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"argument {flag}: invalid choice: '{value}'" in err
    assert len(err.strip().splitlines()) == 1


def test_a_two_step_run_trains_with_the_chosen_normalization(tmp_path):
    out = tmp_path / "out"
    assert (
        main([*SYNTHETIC, "--variants", "rpe", *TINY, "--normalization", "l2", "--out", str(out)])
        == 0
    )
    (record,) = [json.loads(p.read_text()) for p in (out / "records").glob("*.json")]
    assert record["config"]["model"]["transformer"]["normalization"] == "l2"
    (config_file,) = out.glob("runs/*/checkpoints/step-*/config.json")
    assert '"normalization": "l2"' in config_file.read_text()


def test_the_graph_command_takes_the_backend():
    from urpe.experiments.graph.experiment import specs

    argv = ["reproduce", "graph", "--backend", "reference"]
    args = build_parser(argv).parse_args(argv)
    chosen = specs(resolve(_command(args.module).load(), args), "32-true")
    assert {s.config["model"]["graphormer"]["backend"] for s in chosen} == {"reference"}
    argv = ["reproduce", "graph"]
    args = build_parser(argv).parse_args(argv)
    plain = specs(resolve(_command(args.module).load(), args), "32-true")
    assert {s.config["model"]["graphormer"]["backend"] for s in plain} == {"auto"}


def test_a_chosen_gate_keeps_the_variants_gate_options_it_also_takes():
    """--gate replaces the variant's gate name; its init carries over, as the flat gate_init
    field did before gate specs (so a run's model is the one it always was)."""
    argv = ["reproduce", "synthetic", "--tasks", "probe", "--variants", "urpe-gate-normal,urpe"]
    assert [c["gate"] for c in _configs(argv)] == [
        {"name": "toeplitz", "init": "normal"},
        "toeplitz",
    ]
    chosen = _configs([*argv, "--gate", "t5", "--position", "t5"])
    assert [c["gate"] for c in chosen] == [{"name": "t5", "init": "normal"}, "t5"]
    assert [c["position"] for c in chosen] == ["t5", "t5"]
