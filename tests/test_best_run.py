"""A sweep folder given to `predict` / `evaluate` / `generate`: its best run by validation result
among runs of the same data; runs on different data (an edited file trained again into the same
--out with --resume, other targets or tokenizers) are listed and one must be named."""

import pytest

from urpe.cli import main
from urpe.cli_types import UsageError
from urpe.experiments.records import LOCATIONS, RecordStore, RunResult, RunSpec
from urpe.experiments.trained import best_run


def graph_config(digest: str, target: str = "logP", seed: int = 0) -> dict:
    """A graph run on the user's file `mols.csv` with the content `digest`, as planned."""
    return {
        "experiment": "graph",
        "dataset": f"csv:sha256-{digest[:12]}",
        "target": target,
        "variant": "graphormer-urpe",
        "seed": seed,
        "data": {
            "sizes": None,
            "split_seed": 0,
            "features": "zinc",
            "file": {"sha256": digest * 4, "smiles_column": "smiles", "split_column": None},
        },
        LOCATIONS: {"dataset": "/data/mols.csv"},
    }


def finish(out, name: str, config: dict, **result) -> str:
    """A finished run's record and checkpoint folder, as the runner leaves them."""
    spec = RunSpec(name, config)
    RecordStore(out).write(spec, RunResult(result), {}, 1.0)
    (out / "runs" / spec.id / "checkpoints").mkdir(parents=True)
    return spec.id


def test_runs_of_the_same_data_compete_and_the_best_is_named(tmp_path):
    worse = finish(tmp_path, "seed0", graph_config("a" * 16, seed=0), val_mae=0.5)
    better = finish(tmp_path, "seed1", graph_config("a" * 16, seed=1), val_mae=0.3)
    run_dir, note = best_run(tmp_path, "graph")
    assert run_dir == tmp_path / "runs" / better and worse != better
    assert note == f"using run {better} (val_mae 0.3, the best of 2 on mols.csv, logP)"


def test_an_edited_file_trained_again_into_the_same_out_is_not_ranked_against_the_old(
    tmp_path, capsys
):
    """The old model's lower validation MAE used to win silently over the new data's run."""
    old = finish(tmp_path, "old", graph_config("a" * 16), val_mae=0.2)
    new = finish(tmp_path, "new", graph_config("b" * 16), val_mae=0.4)
    with pytest.raises(UsageError) as refusal:
        best_run(tmp_path, "graph")
    message = str(refusal.value)
    assert "holds runs on 2 different data" in message and "name one run folder" in message
    for run_id, digest, value in ((old, "a" * 12, "0.2"), (new, "b" * 12, "0.4")):
        assert f"{tmp_path / 'runs' / run_id} (mols.csv ({digest}), logP, finished " in message
        assert f"val_mae {value})" in message
    code = main(["predict", str(tmp_path), "CCO"])
    err = capsys.readouterr().err
    assert code == 2 and "argument RUN: " in err and err.count("\n") == 1


def test_other_targets_of_one_file_are_other_data(tmp_path):
    finish(tmp_path, "logp", graph_config("a" * 16, target="logP"), val_mae=0.2)
    finish(tmp_path, "heavy", graph_config("a" * 16, target="heavy"), val_mae=0.1)
    with pytest.raises(UsageError) as refusal:
        best_run(tmp_path, "graph")
    assert "(mols.csv, heavy, finished" in str(refusal.value)
    assert "(mols.csv, logP, finished" in str(refusal.value)


@pytest.mark.parametrize(
    "metric, shown", [("bpc", "val bpc 5.221"), ("perplexity", "val perplexity 37.3")]
)
def test_a_language_models_result_is_named_in_its_reports_unit(tmp_path, metric, shown):
    """The reports give bits per character (or perplexity); the line naming the best run said
    "val_loss 3.619" (nats) for the same run."""
    config = {"experiment": "lm", "dataset": "text:a", "tokenizer": "char", "seed": 0}
    run = finish(tmp_path, "lm", config, val_loss=3.619, metric=metric)
    _, note = best_run(tmp_path, "lm")
    assert note == f"using run {run} ({shown}, the best of 1 on text:a, char)"


def test_evaluating_a_graph_model_says_evaluate(molecule_model, tmp_path, capsys):
    table = tmp_path / "m.csv"
    table.write_text("smiles,heavy\nCCO,3\nc1ccccc1,6\n")
    assert main(["evaluate", str(molecule_model), str(table)]) == 0
    progress = capsys.readouterr().err.splitlines()
    assert progress and all(line.startswith("evaluate: ") for line in progress), progress
