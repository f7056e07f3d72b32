"""Training pieces: the schedule, the (seed, step) data stream, exact resume in one process."""

import functools

import lightning as L
import pytest
import torch
from torch.utils.data import TensorDataset

from urpe.tasks import get_task
from urpe.training import (
    EncoderTokenClassifier,
    GeneratedStream,
    IndexedStream,
    OptimConfig,
    StepBatches,
    StepDataModule,
    TokenClassification,
    TrainConfig,
    fit,
    load_model,
    quiet_lightning,
)
from urpe.training.checkpoint import latest_checkpoint, load_weights
from urpe.training.optim import warmup_polynomial_decay

from .tiny import tiny_config


def test_schedule_warms_up_then_decays_linearly():
    c = OptimConfig(lr=1.0, warmup_steps=4, total_steps=12)
    lrs = [warmup_polynomial_decay(t, c) for t in range(14)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == 1.0 and lrs[8] == pytest.approx(0.5) and lrs[12:] == [0.0, 0.0]


def test_schedule_power_and_end_lr():
    c = OptimConfig(lr=1.0, warmup_steps=0, total_steps=10, end_lr=0.1, power=2.0)
    assert warmup_polynomial_decay(5, c) == pytest.approx(0.1 + 0.9 * 0.25)


def _sample(batch_size, generator):
    return torch.randint(50, (batch_size, 3), generator=generator), torch.zeros(batch_size, 3)


def _take(iterable, count):
    return [batch for batch, _ in zip(iterable, range(count), strict=False)]


def test_stream_is_a_function_of_seed_and_step():
    stream = GeneratedStream(_sample, 8, seed=7)
    full = _take(StepBatches(stream), 5)
    again = _take(StepBatches(GeneratedStream(_sample, 8, seed=7), start=3), 2)
    other = _take(StepBatches(GeneratedStream(_sample, 8, seed=8)), 5)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(full[3:], again, strict=True))
    assert not any(torch.equal(a[0], b[0]) for a, b in zip(full, other, strict=True))


def test_ranks_and_micro_batches_partition_each_global_batch():
    """2 ranks x 2 micro-batches: the four parts of step t are the global batch of step t."""
    stream = GeneratedStream(_sample, 8, seed=1)
    single = _take(StepBatches(stream), 3)
    parts = {
        r: _take(StepBatches(GeneratedStream(_sample, 8, seed=1), 0, r, 2, 2), 6) for r in range(2)
    }
    for step in range(3):
        pieces = [parts[r][2 * step + m][0] for m in range(2) for r in range(2)]
        assert torch.equal(torch.cat(pieces), single[step][0])
    with pytest.raises(ValueError, match="cannot be split"):
        StepBatches(stream, world_size=3)


def test_indexed_stream_visits_every_item_once_per_epoch():
    stream = IndexedStream(10, 4, seed=0, collate=lambda indices: indices)
    seen = torch.cat([stream.indices(step) for step in range(5)])  # 20 items = 2 epochs
    assert sorted(seen[:10].tolist()) == list(range(10))
    assert sorted(seen[10:].tolist()) == list(range(10))
    assert not torch.equal(seen[:10], seen[10:])


def _train(out, steps, dropout=0.1, checkpoint_every=5):
    quiet_lightning()
    L.seed_everything(0, verbose=False)
    config = tiny_config(
        vocab_size=5, ffn_dim=None, max_len=8, dropout=dropout, position="rpe", gate="toeplitz"
    )
    objective = TokenClassification(
        EncoderTokenClassifier(config, 8), 8, OptimConfig(lr=3e-3, warmup_steps=2, total_steps=20)
    )
    sample = functools.partial(get_task("pi"), length=8, vocab_size=5)
    held_out = TensorDataset(*sample(64, generator=torch.Generator().manual_seed(5)))
    data = StepDataModule(
        GeneratedStream(lambda b, g: sample(b, generator=g), 16, 0), held_out, eval_batch_size=32
    )
    train = TrainConfig(max_steps=steps, checkpoint_every=checkpoint_every, val_every=7, seed=0)
    return fit(objective, data, train, out, resume=True)


def test_resume_gives_the_same_weights_with_dropout(tmp_path):
    whole = _train(tmp_path / "whole", 20)
    _train(tmp_path / "parts", 12)  # stops after 12 updates (a checkpoint at 10 and 12)
    resumed = _train(tmp_path / "parts", 20)
    assert resumed == whole
    a = load_weights(latest_checkpoint(tmp_path / "whole" / "checkpoints") / "model.safetensors")
    b = load_weights(latest_checkpoint(tmp_path / "parts" / "checkpoints") / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # Only the newest checkpoint is kept.
    assert [d.name for d in (tmp_path / "whole" / "checkpoints").iterdir()] == ["step-00000020"]


def test_load_model_rebuilds_the_trained_model(tmp_path):
    _train(tmp_path, 6, dropout=0.0)
    model = load_model(tmp_path)
    weights = load_weights(tmp_path / "checkpoints" / "step-00000006" / "model.safetensors")
    assert isinstance(model, EncoderTokenClassifier) and not model.training
    state = model.state_dict()
    assert all(torch.equal(state[k], weights["model." + k]) for k in state)
    tokens = torch.randint(5, (2, 8))
    assert model(tokens).shape == (2, 8, 8)
