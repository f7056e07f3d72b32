"""Packed documents in the LM experiment (`urpe reproduce lm --pack`).

The claim checked: training on packed rows scores every target exactly as its document alone
(unpacked, one document per row, padded) would, token by token.
"""

import pytest
import torch
import torch.nn.functional as F

from urpe.data.text import IGNORE_INDEX
from urpe.data.text.documents import document_ends, packed_documents
from urpe.models.lm import LanguageModel
from urpe.training.lm import SegmentStream

from .tiny import tiny_config, tiny_flags

SEPARATOR = torch.tensor([1, 1])  # a "blank line": two newline tokens


def test_documents_end_at_each_separator():
    tokens = torch.tensor([5, 6, 1, 1, 7, 1, 1, 1, 8, 9])
    ends = document_ends(tokens, SEPARATOR)
    assert ends.nonzero().flatten().tolist() == [3, 6, 7]  # "1 1 1" ends two separators
    inputs_ends = ends[None, :9]
    targets = tokens[None, 1:]
    ids, scored = packed_documents(inputs_ends, targets)
    assert ids.tolist() == [[0, 0, 0, 0, 1, 1, 1, 2, 3]]
    assert (scored == IGNORE_INDEX).nonzero()[:, 1].tolist() == [3, 6, 7]


def stream(length=400, seed=0):
    """Random tokens 2..9 with a separator now and then: documents of 2 to ~30 tokens."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(2, 10, (length,), generator=g)
    breaks = torch.randint(0, length - 1, (length // 12,), generator=g)
    tokens[breaks], tokens[breaks + 1] = 1, 1
    return tokens


def pieces(ids_row):
    """(start, end) of each run of equal ids in one row."""
    change = torch.nonzero(ids_row[1:] != ids_row[:-1]).flatten() + 1
    bounds = [0, *change.tolist(), ids_row.numel()]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


@pytest.mark.parametrize(
    "position, gate", [("rope", None), ("fire", "toeplitz"), ("rpe", "toeplitz"), ("fox", None)]
)
def test_packed_loss_equals_each_document_alone(position, gate):
    torch.manual_seed(0)
    config = tiny_config(
        vocab_size=10, num_layers=2, ffn_dim=None, norm_first=True, position=position, gate=gate
    )
    model = LanguageModel(config, segment_length=24).double().eval()
    batch = SegmentStream(stream(), batch_size=3, segment_length=24, separator=SEPARATOR).batch(
        step=1, part=0, parts=1
    )
    inputs, targets, ids = batch["inputs"], batch["targets"], batch["document_ids"]
    assert ids.max() > 0 and (targets == IGNORE_INDEX).any()  # several documents per row
    logits, _ = model(inputs, document_ids=ids)
    packed = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")  # (B, L)

    # Unpacked: every document (piece of a row) alone in a row of its own, right-padded.
    documents = [(b, s, e) for b in range(inputs.shape[0]) for s, e in pieces(ids[b])]
    longest = max(e - s for _, s, e in documents)
    alone_inputs = torch.zeros(len(documents), longest, dtype=torch.long)
    alone_targets = torch.full_like(alone_inputs, IGNORE_INDEX)
    for row, (b, s, e) in enumerate(documents):
        alone_inputs[row, : e - s], alone_targets[row, : e - s] = inputs[b, s:e], targets[b, s:e]
    alone_logits, _ = model(alone_inputs)
    alone = F.cross_entropy(alone_logits.transpose(1, 2), alone_targets, reduction="none")
    for row, (b, s, e) in enumerate(documents):
        torch.testing.assert_close(packed[b, s:e], alone[row, : e - s], rtol=1e-10, atol=1e-10)
    scored = targets != IGNORE_INDEX
    crossing, _ = model(inputs)  # the same rows without document ids: attention crosses them
    crossing = F.cross_entropy(crossing.transpose(1, 2), targets, reduction="none")
    assert not torch.allclose(crossing[scored], packed[scored])
    mean_packed = packed[scored].mean()
    mean_alone = alone[alone_targets != IGNORE_INDEX].mean()
    torch.testing.assert_close(mean_packed, mean_alone, rtol=1e-12, atol=1e-12)


TINY = tiny_flags("lm", variants=None, steps=4, batch_size=2, eval_tokens=64, val_every=4)


def corpus_file(tmp_path):
    """Short paragraphs of words, separated by blank lines."""
    words = "the cat sat on a mat and saw two dogs".split()
    g = torch.Generator().manual_seed(0)
    paragraphs = [
        " ".join(words[i] for i in torch.randint(0, 10, (int(n),), generator=g))
        for n in torch.randint(2, 12, (120,), generator=g)
    ]
    path = tmp_path / "paragraphs.txt"
    path.write_text("\n\n".join(paragraphs) + "\n")
    return path


def test_pack_trains_packed_rows(tmp_path, monkeypatch):
    import json

    from urpe.cli import main

    monkeypatch.setenv("URPE_CACHE_DIR", str(tmp_path / "cache"))
    argv = [
        "reproduce",
        "lm",
        "--dataset",
        str(corpus_file(tmp_path)),
        *TINY,
        "--pack",
        "--variants",
        "rope,fox",
        "--out",
        str(tmp_path / "out"),
    ]
    assert main(argv) == 0
    records = [json.loads(p.read_text()) for p in (tmp_path / "out" / "records").glob("*.json")]
    assert sorted(r["config"]["variant"] for r in records) == ["fox", "rope"]
    for record in records:
        train = record["config"]["train"]
        assert train["stream"] == "packed-documents/1" and train["document_separator"] == "\n\n"
        assert "-packed-" in record["name"] and record["result"]["val_loss"] > 0
    report = (tmp_path / "out" / "results.md").read_text()
    assert "paragraphs.txt (packed) | fox |" in report


def test_pack_refuses_memory_and_explains_itself(tmp_path, capsys):
    from urpe.cli import main

    argv = [
        "reproduce",
        "lm",
        "--dataset",
        str(corpus_file(tmp_path)),
        *TINY,
        "--pack",
        "--variants",
        "rope,txl",
        "--out",
        str(tmp_path / "out"),
    ]
    assert main(argv) == 2
    assert "argument --pack" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["reproduce", "lm", "--help"])
    assert "blank line" in " ".join(capsys.readouterr().out.split())
