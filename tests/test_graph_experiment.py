"""`urpe reproduce graph` end to end on a few hundred real molecules (validation MAE goes down for
both models, the report and figures are written, --resume skips finished runs), the
graph-regression objective, and one-line errors for bad flags."""

import json

import pytest
import torch
from torch_geometric.data import Batch

from urpe.cli import main
from urpe.data.molecules import smiles_to_graph
from urpe.graph import ShortestPaths
from urpe.training.optim import OptimConfig
from urpe.training.regression import GraphRegression, graph_targets, mean_absolute_error

from .graph_reference import SMILES

TINY_RUN = [
    "--sizes",
    "300,100,100",
    "--steps",
    "60",
    "--batch-size",
    "32",
    "--lr",
    "2e-3",
    "--eval-every",
    "30",
    "--seeds",
    "0",
    "--jobs",
    "1",
    "--threads",
    "1",
    "--checkpoint-every",
    "0",
    "--no-progress",
]


def run_cli(argv):
    """main()'s exit status; argparse's own errors exit through SystemExit."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


@pytest.fixture(scope="module")
def graph_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("graph")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("URPE_CACHE_DIR", str(out / "cache"))
        code = main(["reproduce", "graph", *TINY_RUN, "--out", str(out / "run")])
    assert code == 0
    return out / "run"


@pytest.mark.slow
def test_both_models_lower_the_validation_mae_on_real_molecules(graph_run):
    results = json.loads((graph_run / "results.json").read_text())
    runs = {run["variant"]: run for run in results["runs"]}
    assert set(runs) == {"graphormer", "graphormer-urpe"}
    for run in runs.values():
        steps = [step for step, _ in run["curve"]]
        assert steps[0] == 0 and steps[-1] == 60
        initial, final = run["curve"][0][1], run["curve"][-1][1]
        assert final < 0.9 * initial, run["curve"]
        assert final == pytest.approx(run["val_mae"])
        assert run["sizes"] == [300, 100, 100]
    # The tiny model: 4 layers x 8 heads x (max_distance 20 + 4) relations.
    assert runs["graphormer-urpe"]["params"] - runs["graphormer"]["params"] == 4 * 8 * 24
    assert results["comparisons"][0]["extra_params"] == 768


@pytest.mark.slow  # (a trained run's fixture)
def test_report_and_figures_are_written(graph_run, capsys):
    for name in ("results.md", "curves.png", "gate.png"):
        assert (graph_run / name).stat().st_size > 0
    text = (graph_run / "results.md").read_text()
    assert "| moses-plogp | plogp (logP units) | 4/64/64/8 |" in text
    assert main(["reproduce", "graph", "--out", str(graph_run), "--report-only"]) == 0
    assert "graphormer-urpe" in capsys.readouterr().out


@pytest.mark.slow  # (a trained run's fixture)
def test_resume_skips_finished_runs(graph_run, capsys, monkeypatch):
    monkeypatch.setenv("URPE_CACHE_DIR", str(graph_run.parent / "cache"))
    before = sorted(p.name for p in (graph_run / "records").iterdir())
    assert main(["reproduce", "graph", *TINY_RUN, "--out", str(graph_run), "--resume"]) == 0
    assert "2 of 2 runs already recorded" in capsys.readouterr().err
    assert sorted(p.name for p in (graph_run / "records").iterdir()) == before


@pytest.mark.slow  # (a trained run's fixture)
def test_pack_trains_packed_rows_to_the_padded_result(graph_run, tmp_path, monkeypatch):
    """--pack (molecules side by side in packed rows) trains the same model: the same
    validation MAE after a few steps; unpacked runs keep their identity (no pack entry)."""
    monkeypatch.setenv("URPE_CACHE_DIR", str(graph_run.parent / "cache"))
    short = [*TINY_RUN, "--steps", "4", "--eval-every", "2", "--variants", "graphormer-urpe"]
    results = {}
    for flags in ([], ["--pack", "--pack-length", "64"]):
        out = tmp_path / ("-".join(flags) or "padded")
        assert main(["reproduce", "graph", *short, *flags, "--out", str(out)]) == 0
        (record,) = [json.loads(p.read_text()) for p in (out / "records").glob("*.json")]
        results[" ".join(flags)] = record
    padded = results[""]
    assert "pack" not in padded["config"]["model"]["graphormer"]
    packed = results["--pack --pack-length 64"]
    assert packed["config"]["model"]["graphormer"]["pack"] is True
    assert packed["config"]["model"]["graphormer"]["pack_length"] == 64
    assert "-packed-" in packed["id"]
    assert packed["result"]["val_mae"] == pytest.approx(padded["result"]["val_mae"], rel=1e-4)


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--dataset", "zinc"], "URPE_ZINC_DIR"),
        (["--dataset", "zinc", "--zinc-dir", "/nonexistent/zinc"], "not a folder"),
        (["--sizes", "10,10"], "three positive counts"),
        (["--variants", "graphormer,gin"], "unknown variant gin"),
        (["--steps", "10", "--warmup", "20"], "--warmup"),
        (["--dataset", "pcqm4m"], "invalid choice"),
        (["--pack-length", "64"], "give --pack too"),
    ],
)
def test_bad_flags_are_one_line_errors(flags, fragment, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("URPE_ZINC_DIR", raising=False)
    out = tmp_path / "out"
    code = run_cli(["reproduce", "graph", *flags, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and fragment in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()


def test_zinc_folder_without_the_files_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("URPE_CACHE_DIR", str(tmp_path / "cache"))
    empty = tmp_path / "zinc"
    empty.mkdir()
    code = main(
        [
            "reproduce",
            "graph",
            "--dataset",
            "zinc",
            "--zinc-dir",
            str(empty),
            "--out",
            str(tmp_path / "out"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "train.pickle" in err
    assert len(err.strip().splitlines()) == 1


class MeanOfNodes(torch.nn.Module):
    """A stand-in model: each graph's mean atom type times a weight."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, batch):
        from torch_geometric.utils import scatter

        return self.weight * scatter(batch.x[:, 0].float(), batch.batch, reduce="mean")


def test_graph_regression_loss_is_the_l1_loss_and_the_metric_the_mae():
    graphs = [ShortestPaths()(smiles_to_graph(s)[0]) for s in SMILES]
    for i, g in enumerate(graphs):
        g.y = torch.tensor([float(i)])
    batch = Batch.from_data_list(graphs)
    model = MeanOfNodes()
    objective = GraphRegression(model, OptimConfig())
    predictions = model(batch)
    expected = sum(abs(float(p) - i) for i, p in enumerate(predictions)) / len(graphs)
    loss = objective.training_step(batch, 0)
    assert float(loss) == pytest.approx(expected)
    halves = [Batch.from_data_list(graphs[:3]), Batch.from_data_list(graphs[3:])]
    assert mean_absolute_error(model, halves) == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match="no targets"):
        graph_targets(Batch.from_data_list([ShortestPaths()(smiles_to_graph("CC")[0])]))
