"""`Positions.from_document_ids`: positions restart with every packed document.

Checked through the attention module and the models with a dense block-diagonal mask (the
meaning of document ids, written out), so only the positions are under test here: each packed
document must give exactly what it gives alone, in float64, for every registered sequence
encoding (with and without a gate) and every absolute encoding.
"""

import pytest
import torch

import urpe
from urpe.encodings import ABSOLUTE_REGISTRY, GATE_REGISTRY, POSITION_REGISTRY, EncodingSettings

from .test_positions import randomized

F64 = dict(dtype=torch.float64)
H, D, E = 2, 4, 8
LENGTHS = (3, 5, 1, 4)  # one packed row of four documents, 13 tokens
# max_length 4: FIRE's threshold (4) is below the later positions, so they matter.
SETTINGS = EncodingSettings(
    num_heads=H,
    head_dim=D,
    dim=E,
    max_length=4,
    causal=True,
    options={"num_buckets": 8, "bucket_max_distance": 16},
)
SEQUENCE_ENCODINGS = [n for n, r in POSITION_REGISTRY.items() if not r.uses_relation]
SEQUENCE_GATES = [None, *(n for n, r in GATE_REGISTRY.items() if not r.uses_relation)]


def document_ids(lengths=LENGTHS) -> torch.Tensor:
    """(1, L): 0 for the first document's tokens, 1 for the second's, ..."""
    return torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])[None]


def block_mask(ids: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """(B, 1, L, L) bool, True = may attend: the same document (and not ahead, if causal)."""
    same = ids[:, :, None] == ids[:, None, :]
    if causal:
        same = same & torch.ones_like(same[0]).tril()
    return same[:, None]


def spans(lengths=LENGTHS):
    start = 0
    for n in lengths:
        yield start, start + n
        start += n


def test_positions_restart_at_every_document():
    ids = torch.tensor([[7, 7, 7, 2, 2, 9], [1, 1, 1, 1, 1, 1]])
    positions = urpe.Positions.from_document_ids(ids)
    assert positions.key.tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]
    assert positions.query.tolist() == positions.key.tolist()
    assert positions.is_aligned and positions.query_start is None and positions.batch == 2
    # Offsets stay the row's own: inside a document they equal the restarted ones.
    offsets = positions.offsets()[0]
    restarted = positions.key[0][None, :] - positions.query[0][:, None]
    same = ids[0][:, None] == ids[0][None, :]
    assert torch.equal(offsets[same], restarted[same])
    cached = urpe.Positions.from_document_ids(ids, query_length=2)  # two new tokens over a cache
    assert cached.query.tolist() == [[1, 0], [4, 5]] and cached.key_length == 6


def test_document_ids_must_be_integer_rows():
    with pytest.raises(TypeError, match="document_ids must be an integer tensor"):
        urpe.Positions.from_document_ids(torch.zeros(4))
    with pytest.raises(ValueError, match="query_length must be in"):
        urpe.Positions.from_document_ids(torch.zeros(4).long(), query_length=5)


@pytest.mark.parametrize("gate", SEQUENCE_GATES)
@pytest.mark.parametrize("name", SEQUENCE_ENCODINGS)
def test_each_packed_document_equals_it_alone(name, gate):
    position = POSITION_REGISTRY[name].build(SETTINGS)
    gate_module = GATE_REGISTRY[gate].build(SETTINGS) if gate else None
    mha = randomized(
        urpe.MultiheadAttention(E, H, position=position, gate=gate_module, backend="reference")
    ).eval()
    rows = (LENGTHS, (6, 7))  # two packed rows, documents at different places
    ids = torch.cat([document_ids(lengths) for lengths in rows])  # (2, 13)
    x = torch.randn(2, ids.shape[1], E, **F64)
    packed = mha(x, positions=urpe.Positions.from_document_ids(ids), attn_mask=block_mask(ids))
    for row, lengths in enumerate(rows):
        for start, end in spans(lengths):
            alone = mha(x[row : row + 1, start:end], is_causal=True)
            torch.testing.assert_close(
                packed[row : row + 1, start:end], alone, rtol=1e-10, atol=1e-10
            )


@pytest.mark.parametrize("absolute", list(ABSOLUTE_REGISTRY))
def test_absolute_encodings_restart_per_document(absolute):
    config = urpe.TransformerConfig(
        vocab_size=11, max_len=8, num_layers=1, dim=E, num_heads=H, absolute=absolute
    )
    model = randomized(urpe.TransformerDecoder(config)).eval()
    ids = document_ids()
    tokens = torch.randint(0, 11, ids.shape)
    packed = model(
        tokens, positions=urpe.Positions.from_document_ids(ids), attn_mask=block_mask(ids)
    )
    for start, end in spans():
        torch.testing.assert_close(
            packed[:, start:end], model(tokens[:, start:end]), rtol=1e-10, atol=1e-10
        )
