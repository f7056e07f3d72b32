"""The library's decoder on packed rows (`document_ids`): each document's logits equal that
document run alone, for every registered encoding that runs on tokens, with and without a gate,
in one forward pass and through a KV cache fed in chunks that cut across documents."""

import pytest
import torch

import urpe
from urpe.encodings import GATE_REGISTRY, POSITION_REGISTRY

from .test_packed_positions import document_ids, spans
from .test_positions import randomized
from .tiny import tiny_config

TOKEN_ENCODINGS = [n for n, r in POSITION_REGISTRY.items() if not r.uses_relation]
TOKEN_GATES = [None, *(n for n, r in GATE_REGISTRY.items() if not r.uses_relation)]
CHUNKS = ((0, 4), (4, 5), (5, 13))  # a KV cache fed 4, 1 and 8 tokens

pytestmark = pytest.mark.usefixtures("one_thread")


def packed_row():
    ids = document_ids()  # (1, 13)
    return ids, torch.randint(0, 11, ids.shape)


def decoder(position, gate, **changes):
    torch.manual_seed(0)
    config = tiny_config(
        num_layers=2, dim=8, ffn_dim=None, max_len=8, position=position, gate=gate, **changes
    )
    return randomized(urpe.TransformerDecoder(config)).eval()  # tables away from their init


@pytest.mark.parametrize("gate", TOKEN_GATES)
@pytest.mark.parametrize("position", TOKEN_ENCODINGS)
def test_packed_logits_equal_each_document_alone(position, gate):
    model = decoder(position, gate)
    ids, tokens = packed_row()
    packed = model(tokens, document_ids=ids)
    for start, end in spans():
        torch.testing.assert_close(
            packed[:, start:end], model(tokens[:, start:end]), rtol=1e-10, atol=1e-10
        )
    cache = model.new_cache()
    chunked = [model(tokens[:, s:e], cache=cache, document_ids=ids[:, s:e]) for s, e in CHUNKS]
    torch.testing.assert_close(torch.cat(chunked, 1), packed, rtol=1e-10, atol=1e-10)


def test_packed_rows_of_a_batch_are_independent():
    model = decoder("rope", "toeplitz", absolute="learned")
    ids, tokens = packed_row()
    other = torch.tensor([[0] * 6 + [1] * 7])
    batch = model(torch.cat([tokens, tokens]), document_ids=torch.cat([ids, other]))
    torch.testing.assert_close(batch[:1], model(tokens, document_ids=ids))
    torch.testing.assert_close(batch[1:, 6:], model(tokens[:, 6:]))


def test_document_ids_misuse_is_one_line():
    model = decoder("rpe", None)
    ids, tokens = packed_row()
    with pytest.raises(ValueError, match="shaped like tokens"):
        model(tokens, document_ids=ids[:, :5])
    cache = model.new_cache()
    model(tokens[:, :4], cache=cache)
    with pytest.raises(ValueError, match="without document ids"):
        model(tokens[:, 4:], cache=cache, document_ids=ids[:, 4:])
    with pytest.raises(ValueError, match="memory"):
        model(tokens, document_ids=ids, memory=[torch.zeros(1, 2, 8).double()] * 2)
    mixer = decoder("rpe", None, mixers={0: "conv"})
    with pytest.raises(NotImplementedError, match="does not take document_ids"):
        mixer(tokens, document_ids=ids)


def test_attention_module_takes_document_ids_per_call():
    torch.manual_seed(0)
    mha = urpe.MultiheadAttention(8, 2, position=urpe.RotaryEncoding(4)).double()
    ids, _ = packed_row()
    x = torch.randn(1, ids.shape[1], 8, dtype=torch.float64)
    positions = urpe.Positions.from_document_ids(ids)
    out = mha(x, document_ids=ids, positions=positions, is_causal=True)
    for start, end in spans():
        torch.testing.assert_close(out[:, start:end], mha(x[:, start:end], is_causal=True))


@pytest.mark.parametrize("position", ["fire", "fox"])
def test_packed_encoder_rows_equal_each_document_alone(position):
    torch.manual_seed(0)
    config = tiny_config(
        num_layers=2,
        dim=8,
        ffn_dim=None,
        max_len=8,
        position=position,
        gate="toeplitz",
        absolute="learned",
    )
    model = randomized(urpe.TransformerEncoder(config)).eval()
    ids, tokens = packed_row()
    packed = model(tokens, document_ids=ids)  # bidirectional: documents on both sides hidden
    for start, end in spans():
        torch.testing.assert_close(packed[:, start:end], model(tokens[:, start:end]))
