import pytest
import torch

from urpe.training import GeneratedBatches, GeneratedDataModule, OptimConfig
from urpe.training.optim import warmup_polynomial_decay


def test_schedule_warms_up_then_decays_linearly():
    c = OptimConfig(lr=1.0, warmup_steps=4, total_steps=12)
    lrs = [warmup_polynomial_decay(t, c) for t in range(14)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == 1.0 and lrs[8] == pytest.approx(0.5) and lrs[12:] == [0.0, 0.0]


def test_schedule_power_and_end_lr():
    c = OptimConfig(lr=1.0, warmup_steps=0, total_steps=10, end_lr=0.1, power=2.0)
    assert warmup_polynomial_decay(5, c) == pytest.approx(0.1 + 0.9 * 0.25)


def _sample(batch_size, generator):
    return torch.randint(5, (batch_size, 3), generator=generator), torch.zeros(batch_size, 3)


def test_stream_is_seeded_and_held_out_differs():
    a = [x for x, _ in GeneratedBatches(_sample, 4, seed=7, num_batches=3)]
    b = [x for x, _ in GeneratedBatches(_sample, 4, seed=7, num_batches=3)]
    c = [x for x, _ in GeneratedBatches(_sample, 4, seed=8, num_batches=3)]
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))
    held_out = GeneratedDataModule(_sample, 4, seed=7, eval_batches=3).held_out().tensors[0]
    assert not torch.equal(held_out[:4], a[0])
