"""A run killed right after a checkpoint at a validation step, then resumed, records the same
learning curve as a run never interrupted (the checkpoint is written after that validation)."""

import lightning  # noqa: F401  (the train extra)
import pytest
import torch

from urpe.models import TransformerConfig
from urpe.models.lm import LanguageModel
from urpe.training.lm import CausalLM, SegmentStream, held_out_segments


class Killed(Exception):
    """Stands for SIGKILL: the process ends between two updates, nothing more is written."""


def _fit_until(objective, data, run_dir, kill_at):
    """12 updates, validation and a checkpoint every 4, killed at update `kill_at` (or never)."""
    from urpe.training import TrainConfig, fit

    settings = TrainConfig(
        max_steps=12,
        val_every=4,
        checkpoint_every=4,
        accelerator="cpu",
        devices=1,
        seed=0,
        log_every=1,
    )

    def on_step(step):
        if step == kill_at:
            raise Killed

    fit(objective, data, settings, run_dir, resume=True, on_step=on_step)


def _fit(run_dir, tokens, kill_at=None):
    import lightning as L

    from urpe.training import StepDataModule, quiet_lightning
    from urpe.training.optim import OptimConfig

    quiet_lightning()
    L.seed_everything(0, verbose=False)
    config = TransformerConfig(vocab_size=11, num_layers=1, dim=16, num_heads=2, ffn_dim=32)
    model = LanguageModel(config, 8)
    objective = CausalLM(model, OptimConfig(lr=1e-2, total_steps=12))
    data = StepDataModule(
        SegmentStream(tokens[:-200], 4, 8),
        held_out_segments(tokens[-200:], 4, 8),
        eval_batch_size=None,
    )
    _fit_until(objective, data, run_dir, kill_at)
    return model, objective


def test_kill_after_a_validation_checkpoint_then_resume_keeps_the_curve(tmp_path):
    torch.set_num_threads(1)
    tokens = torch.randint(0, 11, (2000,), generator=torch.Generator().manual_seed(0))
    straight, whole = _fit(tmp_path / "a", tokens)
    assert [step for step, _ in whole.curve["val"]] == [4, 8, 12]
    with pytest.raises(Killed):
        _fit(tmp_path / "b", tokens, kill_at=5)  # checkpoint at 4 written, step 5 under way
    resumed, part = _fit(tmp_path / "b", tokens)
    assert part.curve["val"] == whole.curve["val"]
    assert part.curve["train"] == whole.curve["train"]
    for (name, a), b in zip(
        straight.state_dict().items(), resumed.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


def _fit_graph(run_dir, kill_at=None):
    import lightning as L
    from torch_geometric.loader import DataLoader

    from urpe.data.molecules import FEATURIZATIONS, smiles_to_graph
    from urpe.experiments.graph.experiment import _Collate, read_curve
    from urpe.graph import Graphormer, GraphormerConfig, ShortestPaths
    from urpe.training import IndexedStream, StepDataModule, quiet_lightning
    from urpe.training.optim import OptimConfig
    from urpe.training.regression import GraphRegression

    from .graph_reference import SMILES

    quiet_lightning()
    graphs = []
    for smiles in SMILES * 3:
        data, mol = smiles_to_graph(smiles)
        data.y = torch.tensor([float(mol.GetNumAtoms())])
        graphs.append(ShortestPaths()(data))
    L.seed_everything(0, verbose=False)
    spec = FEATURIZATIONS["zinc"]
    model = Graphormer(
        GraphormerConfig(num_layers=1, dim=16, ffn_dim=16, num_heads=2),
        node_cardinalities=spec.node_cardinalities,
        edge_cardinalities=spec.edge_cardinalities,
    )
    objective = GraphRegression(model, OptimConfig(lr=1e-2, total_steps=12))
    train, val = graphs[:18], graphs[18:]
    data = StepDataModule(
        IndexedStream(len(train), 4, 0, _Collate(train)),
        val,
        eval_batch_size=8,
        collate=_Collate(val),
    )
    _fit_until(objective, data, run_dir, kill_at)
    assert DataLoader  # the loader the experiment evaluates with
    return read_curve(run_dir)


def test_graph_curve_read_from_the_log_survives_a_kill_and_resume(tmp_path):
    torch.set_num_threads(1)
    whole = _fit_graph(tmp_path / "a")
    assert [step for step, _ in whole] == [3, 7, 11, 12]  # in-fit validations, then the final
    with pytest.raises(Killed):
        _fit_graph(tmp_path / "b", kill_at=5)
    assert _fit_graph(tmp_path / "b") == whole
