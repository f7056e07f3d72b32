"""Graphormer on packed rows (graphs side by side, each attending only to itself) gives every
graph the prediction and the gradients of the padded batch (one row per graph), in float64, with
a URPE gate away from ones, for both readouts; and the packing itself places graphs first-fit."""

from __future__ import annotations

import pytest
import torch
from torch_geometric.data import Batch

from urpe.graph import GraphormerConfig
from urpe.graph.packing import pack_layout

from .test_graph_model import model, molecules, randomise


def pair(readout: str, **changes):
    """(padded, packed): the same random weights and gates, float64."""
    padded = randomise(model(urpe=True, readout=readout, **changes))
    with torch.no_grad():
        for table in padded.gate_tables():
            table.uniform_(0.2, 1.8)
    packed = model(urpe=True, readout=readout, pack=True, **changes)
    packed.load_state_dict(padded.state_dict())
    return padded, packed


def gradients(net, batch) -> dict[str, torch.Tensor]:
    net.zero_grad(set_to_none=True)
    prediction = net(batch)
    (prediction * torch.linspace(-1, 2, len(prediction), dtype=prediction.dtype)).sum().backward()
    return {n: p.grad for n, p in net.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("readout", ["graph-token", "mean"])
def test_packed_rows_give_the_padded_predictions_and_gradients(readout, backend):
    padded, packed = pair(readout, backend=backend)
    batch = Batch.from_data_list(molecules())
    expected, got = padded(batch), packed(batch)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    expected_grads, got_grads = gradients(padded, batch), gradients(packed, batch)
    assert set(got_grads) == set(expected_grads)
    assert any("gate" in n for n in got_grads)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-9, atol=1e-10, msg=name)


def test_packed_rows_hold_fewer_places_than_padding():
    """The molecules of the test batch fit in fewer places packed than padded."""
    lengths = torch.tensor([m.num_nodes + 1 for m in molecules()])
    layout = pack_layout(lengths)
    rows, width = layout.graph.shape
    assert width == int(lengths.max())
    assert rows * width < len(lengths) * int(lengths.max())
    assert rows * width >= int(lengths.sum())


def test_first_fit_places_each_graph_in_one_run():
    lengths = torch.tensor([4, 3, 2, 4, 1])
    layout = pack_layout(lengths)
    # Rows of 4: [g0], [g1 g4], [g2 tail tail], [g3]: g4 goes back to the first row with room.
    assert layout.row.tolist() == [0, 1, 2, 3, 1]
    assert layout.start.tolist() == [0, 0, 0, 0, 3]
    assert layout.graph.tolist() == [[0, 0, 0, 0], [1, 1, 1, 4], [2, 2, 7, 7], [3, 3, 3, 3]]
    assert layout.local.tolist() == [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 0, 0], [0, 1, 2, 3]]
    wide = pack_layout(lengths, row_length=14)  # everything in one row, no tail
    assert wide.graph.tolist() == [[0, 0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 3, 4]]
    assert pack_layout(lengths, row_length=3).graph.shape == (4, 4)  # rows fit the largest


def test_longer_rows_and_one_row_give_the_padded_predictions():
    padded, _ = pair("mean")
    batch = Batch.from_data_list(molecules())
    for length in (40, 10**6):
        packed = model(urpe=True, readout="mean", pack=True, pack_length=length)
        packed.load_state_dict(padded.state_dict())
        torch.testing.assert_close(packed(batch), padded(batch), rtol=1e-10, atol=1e-10)


def test_a_batch_that_packing_leaves_in_as_many_rows_runs_padded(monkeypatch):
    """Two molecules of one size: rows of that size hold one each, so packing is skipped."""
    import urpe.graph.model as graph_model

    padded, packed = pair("graph-token")
    batch = Batch.from_data_list(molecules(["c1ccc2ccccc2c1", "c1ccc2ccccc2c1"]))
    monkeypatch.setattr(graph_model, "pack_inputs", lambda *args: pytest.fail("packed"))
    torch.testing.assert_close(packed(batch), padded(batch), rtol=0, atol=0)


def test_pack_is_left_out_of_unpacked_configs():
    """Unpacked configs keep the form they had, so existing runs keep their identity."""
    assert not {"pack", "pack_length"} & set(GraphormerConfig().to_dict())
    config = GraphormerConfig(pack=True, pack_length=64)
    assert GraphormerConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="pack_length needs pack=True"):
        GraphormerConfig(pack_length=64)
