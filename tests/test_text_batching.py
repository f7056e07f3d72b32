"""Batching: Transformer-XL continuity of rows across segments, exact resume, rank sharding,
and evaluation iterators that score every target exactly once."""

import itertools

import pytest
import torch

from urpe.data.text import IGNORE_INDEX, ContiguousBatches, SlidingWindows

SHAPES = [(1, 1), (1, 7), (3, 4), (4, 5), (7, 3), (16, 1)]


def _stream(n: int, seed: int = 0) -> torch.Tensor:
    # Random ids (not arange), so a misplaced index shows up as a wrong value.
    return torch.randint(0, 50, (n,), generator=torch.Generator().manual_seed(seed))


def _scored(segment):
    """(stream index of each scored target, its value) from a segment."""
    length = segment.inputs.shape[1]
    where = segment.targets != IGNORE_INDEX
    index = (segment.offsets[:, None] + torch.arange(length))[where]
    return index, segment.targets[where]


@pytest.mark.parametrize(("batch_size", "length"), SHAPES)
def test_rows_continue_across_segments(batch_size, length):
    tokens = _stream(211)
    batches = ContiguousBatches(tokens, batch_size, length)
    row = (len(tokens) - 1) // batch_size  # pairs per row, tail dropped
    assert len(batches) == row // length
    segments = list(batches)
    inputs = torch.cat([s.inputs for s in segments], dim=1)  # (B, T L)
    targets = torch.cat([s.targets for s in segments], dim=1)
    for b in range(batch_size):
        start = b * row
        expected = tokens[start : start + len(batches) * length]
        assert torch.equal(inputs[b], expected)  # row b is one contiguous piece of the stream
        assert torch.equal(targets[b], tokens[start + 1 : start + 1 + len(batches) * length])
    for previous, current in itertools.pairwise(segments):
        assert torch.equal(previous.targets[:, -1], current.inputs[:, 0])
        assert not current.reset_memory
    assert segments[0].reset_memory
    assert all(s.inputs.dtype == s.targets.dtype == torch.long for s in segments)
    assert all(s.num_scored == batch_size * length for s in segments)


def test_resume_from_any_position_across_epochs():
    batches = ContiguousBatches(_stream(300), 4, 6)
    epoch = len(batches)
    uninterrupted = list(batches.iterate(0, 3 * epoch + 2))
    for start in (0, 1, epoch - 1, epoch, epoch + 5, 3 * epoch + 1):
        resumed = list(batches.iterate(start, 3 * epoch + 2))
        assert [s.position for s in resumed] == list(range(start, 3 * epoch + 2))
        for a, b in zip(resumed, uninterrupted[start:], strict=True):
            assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
            assert a.reset_memory == b.reset_memory
    # Every epoch repeats the same order and starts without memory.
    assert torch.equal(uninterrupted[epoch].inputs, uninterrupted[0].inputs)
    assert [s.position for s in uninterrupted if s.reset_memory] == [0, epoch, 2 * epoch, 3 * epoch]
    endless = batches.iterate(start=7)
    assert next(endless).position == 7 and next(endless).position == 8


def test_ranks_split_the_global_batch():
    tokens = _stream(500)
    whole = ContiguousBatches(tokens, 6, 5)
    parts = [ContiguousBatches(tokens, 6, 5, rank=r, world_size=3) for r in range(3)]
    for position in (0, 3, len(whole) + 1):
        joined = torch.cat([p[position].inputs for p in parts])
        assert torch.equal(joined, whole[position].inputs)
        assert torch.equal(torch.cat([p[position].targets for p in parts]), whole[position].targets)


@pytest.mark.parametrize("n", [2, 3, 17, 100, 101])
@pytest.mark.parametrize(("batch_size", "length"), SHAPES)
def test_segment_evaluation_scores_every_target_once(n, batch_size, length):
    tokens = _stream(n, seed=n)
    batches = ContiguousBatches(tokens, batch_size, length, cover_all=True)
    seen = []
    for segment in batches:
        assert segment.inputs.shape == segment.targets.shape == (batch_size, length)
        index, values = _scored(segment)
        assert torch.equal(values, tokens[index + 1])
        seen += index.tolist()
    assert sorted(seen) == list(range(n - 1))
    assert batches.tokens_per_epoch == n - 1


def test_segment_evaluation_keeps_rows_contiguous_for_memory():
    tokens = _stream(103)
    segments = list(ContiguousBatches(tokens, 2, 10, cover_all=True))  # rows of 51 pairs
    assert [s.offsets.tolist() for s in segments] == [[10 * t, 51 + 10 * t] for t in range(6)]
    last = segments[-1]  # columns 50..59 of a 51-long row: one real pair, nine padded
    assert (last.targets[:, 1:] == IGNORE_INDEX).all() and (last.inputs[:, 1:] == 0).all()


@pytest.mark.parametrize("n", [2, 9, 10, 11, 64, 97])
@pytest.mark.parametrize(
    ("context", "stride", "batch_size"), [(8, 3, 2), (8, 8, 3), (8, 1, 5), (1, 1, 4), (64, None, 1)]
)
def test_sliding_windows_score_every_target_once_with_context(n, context, stride, batch_size):
    tokens = _stream(n, seed=n)
    windows = SlidingWindows(tokens, context, stride, batch_size)
    stride = windows.stride
    seen = []
    for number, segment in enumerate(windows):
        assert segment.reset_memory and segment.inputs.shape[1] == min(context, n - 1)
        assert segment.inputs.shape[0] <= batch_size
        index, values = _scored(segment)
        assert torch.equal(values, tokens[index + 1])
        assert torch.equal(
            segment.inputs, tokens[segment.offsets[:, None] + torch.arange(segment.inputs.shape[1])]
        )
        if number:  # every target after the first window sees at least C - stride tokens
            columns = (segment.targets != IGNORE_INDEX).nonzero()[:, 1]
            assert (columns >= context - stride).all()
            assert (segment.targets != IGNORE_INDEX).sum(dim=1).max() <= stride
        seen += index.tolist()
    assert sorted(seen) == list(range(n - 1))


def test_sliding_windows_default_stride_is_half_the_context():
    windows = SlidingWindows(_stream(1000), 128)
    assert windows.stride == 64 and windows.num_windows == 1 + -(-(999 - 128) // 64)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ContiguousBatches(torch.arange(1), 1, 1), "at least 2 tokens"),
        (lambda: ContiguousBatches(torch.rand(10), 1, 1), "1-D integer"),
        (lambda: ContiguousBatches(torch.arange(10).view(2, 5), 1, 1), "1-D integer"),
        (lambda: ContiguousBatches(torch.arange(10), 0, 1), "batch_size"),
        (lambda: ContiguousBatches(torch.arange(10), 2, 8), "do not fill one segment"),
        (lambda: ContiguousBatches(torch.arange(100), 5, 2, world_size=2), "not divisible"),
        (lambda: ContiguousBatches(torch.arange(100), 4, 2, rank=2, world_size=2), "rank"),
        (lambda: SlidingWindows(torch.arange(10), 4, stride=5), "exceeds"),
        (lambda: SlidingWindows(torch.arange(10), 0), "context_length"),
        (lambda: ContiguousBatches(torch.arange(10), 1, 2).iterate(-1).__next__(), "start"),
    ],
)
def test_bad_arguments(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_index_errors():
    batches = ContiguousBatches(torch.arange(10), 1, 2)
    with pytest.raises(IndexError):
        batches[-1]
    windows = SlidingWindows(torch.arange(10), 4)
    with pytest.raises(IndexError):
        windows[len(windows)]


def test_segments_travel_through_a_dataloader_and_lightning():
    from lightning.fabric.utilities.apply_func import move_data_to_device
    from torch.utils.data import DataLoader

    batches = ContiguousBatches(_stream(200), 2, 5)
    loaded = list(DataLoader(batches, batch_size=None))  # map-style: one Segment per item
    assert len(loaded) == len(batches)
    assert all(torch.equal(a.inputs, b.inputs) for a, b in zip(loaded, batches, strict=True))
    moved = move_data_to_device(batches[3], torch.device("cpu"))
    assert moved.position == 3 and torch.equal(moved.targets, batches[3].targets)
    assert batches[3].to("cpu").reset_memory == batches[3].reset_memory
