"""urpe.hf on packed batches (transformers' DataCollatorWithFlattening: documents concatenated in
one row, position ids restarting at 0 per document): tiny Llama and Qwen2 models with perturbed
URPE gates give every document the loss and the gradients it gets in an ordinary padded batch,
whether the collator marks the documents by position ids or by flash-attention's cu_seq_lens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DataCollatorWithFlattening

import urpe.hf
from tests.hf_families import VOCAB, families
from urpe.hf import packing as hf_packing
from urpe.hf.packing import document_ids_of

FAMILIES = families()
LENGTHS = (5, 9, 3, 7)  # documents of different lengths


def documents() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(2, VOCAB, (n,), generator=g) for n in LENGTHS]


def gated_model(name: str, implementation: str = "sdpa", **options):
    family = FAMILIES[name]
    model = urpe.hf.add_urpe(family.build(implementation, torch.float64), **options)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # gates away from 1, so that a wrong offset would change the result
        for p in urpe.hf.gate_parameters(model):
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return model.train()  # dropout is 0 in these configs


def document_losses(logits: torch.Tensor, docs: list[torch.Tensor]) -> torch.Tensor:
    """(documents,) mean next-token cross-entropy of each document; logits (n_d, V) per doc."""
    losses = [F.cross_entropy(lg[:-1], d[1:]) for lg, d in zip(logits, docs, strict=True)]
    return torch.stack(losses)


def padded_losses(model, docs: list[torch.Tensor]) -> torch.Tensor:
    length = max(len(d) for d in docs)
    ids = torch.stack([F.pad(d, (0, length - len(d))) for d in docs])  # (B, L), right padding
    mask = torch.stack([torch.arange(length) < len(d) for d in docs]).long()
    logits = model(input_ids=ids, attention_mask=mask).logits  # (B, L, V)
    return document_losses([lg[: len(d)] for lg, d in zip(logits, docs, strict=True)], docs)


def packed_losses(model, docs: list[torch.Tensor], **collator) -> torch.Tensor:
    batch = DataCollatorWithFlattening(**collator)([{"input_ids": d.tolist()} for d in docs])
    batch.pop("labels")
    logits = model(**batch).logits[0]  # (T, V)
    return document_losses(logits.split([len(d) for d in docs]), docs)


def gradients(model, losses: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    (losses * torch.arange(1.0, len(losses) + 1, dtype=losses.dtype)).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


COLLATORS = {
    "position-ids": {},
    "cu-seq-lens": {"return_position_ids": False, "return_flash_attn_kwargs": True},
    "both": {"return_flash_attn_kwargs": True},
}


@pytest.mark.parametrize("collator", list(COLLATORS))
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_packed_documents_match_padded_losses_and_gradients(name, collator):
    model = gated_model(name)
    docs = documents()
    expected = padded_losses(model, docs)
    expected_grads = gradients(model, expected)
    got = packed_losses(model, docs, **COLLATORS[collator])
    got_grads = gradients(model, got)
    # Without position ids RoPE sees each document at other absolute positions: the same
    # relative rotations, but its angles are computed in float32 (errors ~1e-8 relative).
    tolerance = 1e-6 if collator == "cu-seq-lens" else 1e-9
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
    assert set(got_grads) == set(expected_grads)
    assert any("urpe" in n for n in got_grads)
    for n, grad in expected_grads.items():
        torch.testing.assert_close(got_grads[n], grad, rtol=tolerance, atol=tolerance, msg=n)


def test_bucketed_gates_pack_too():
    """Every gate urpe.hf offers reads offsets only (shift-invariant): T5-style buckets too."""
    model = gated_model("llama", gate={"name": "t5", "num_buckets": 8})
    docs = documents()
    torch.testing.assert_close(
        packed_losses(model, docs), padded_losses(model, docs), rtol=1e-10, atol=1e-10
    )


def test_eager_base_packs_too():
    model = gated_model("llama", "eager").float()
    docs = documents()
    torch.testing.assert_close(
        packed_losses(model, docs), padded_losses(model, docs), rtol=1e-5, atol=1e-5
    )


def test_packed_batches_reach_urpe_attention_as_document_ids(monkeypatch):
    """The documents travel as `document_ids` (O(L) beside q, k, v), with no dense mask."""
    from urpe.kernels import AttentionCalls

    seen = []
    original = AttentionCalls.__call__  # (each patched module calls its own prepared calls)

    def spy(self, *args, **kwargs):
        seen.append((kwargs.get("document_ids"), kwargs.get("attn_mask"), kwargs["is_causal"]))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(AttentionCalls, "__call__", spy)
    packed_losses(gated_model("qwen2"), documents())
    expected = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    assert seen
    for ids, mask, causal in seen:
        assert mask is None and causal
        torch.testing.assert_close(ids, expected[None])


def test_document_ids_from_positions_and_cu_seq_lens():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1]])
    expected = torch.tensor([[0, 0, 0, 1, 1, 2, 3, 3]])
    torch.testing.assert_close(document_ids_of({"position_ids": positions}, 8, 8), expected)
    cu = torch.tensor([0, 3, 5, 6, 8], dtype=torch.int32)
    kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu}
    torch.testing.assert_close(document_ids_of(kwargs, 8, 8), expected)
    # One document per row (an ordinary batch, or generation): nothing to pass.
    assert document_ids_of({"position_ids": torch.arange(8)[None]}, 8, 8) is None
    assert document_ids_of({"position_ids": torch.arange(3, 8)[None]}, 5, 5) is None
    assert document_ids_of({}, 8, 8) is None
    # Padding, not packing: generate's left padding (position 1, then the text from 0), and
    # position ids counted from a mask with right padding; the mask handles both.
    left = torch.tensor([[1, 1, 1, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 7]])
    right = torch.tensor([[0, 1, 2, 3, 4, 1, 1, 1]])
    assert document_ids_of({"position_ids": left}, 8, 8) is None
    assert document_ids_of({"position_ids": right}, 8, 8) is None
    # A row packed from position 2 on (DataCollatorWithFlattening's position_ids_start).
    shifted = {"position_ids": positions + 2}
    torch.testing.assert_close(document_ids_of(shifted, 8, 8), expected)
    assert document_ids_of({"position_ids": positions.expand(3, 1, 8)}, 8, 8) is None  # mrope


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_reused_positions_buffer_is_read_again_in_every_pass(mode, monkeypatch):
    """A caller that rewrites one position_ids buffer in place between batches (also under
    torch.inference_mode, whose tensors count no versions) gets each batch's own documents;
    within one pass the documents are read once, not once per layer."""
    model = gated_model("llama").eval()
    docs = documents()
    batch = DataCollatorWithFlattening()([{"input_ids": d.tolist()} for d in docs])
    ids, packed = batch["input_ids"], batch["position_ids"]
    reads = []
    original = hf_packing._from_position_ids
    monkeypatch.setattr(hf_packing, "_from_position_ids", lambda p: reads.append(1) or original(p))
    with mode():
        want_packed = model(ids, position_ids=packed.clone()).logits
        want_plain = model(ids, position_ids=torch.arange(ids.shape[1])[None]).logits
        buffer = torch.arange(ids.shape[1])[None]
        for positions, want in [(packed, want_packed), (buffer.clone(), want_plain)] * 2:
            buffer.copy_(positions)
            torch.testing.assert_close(model(ids, position_ids=buffer).logits, want)
    assert len(reads) == 6  # one per pass, not one per layer (2 layers)


def test_cu_seq_lens_that_do_not_cover_the_row_are_one_error():
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seq_lens_k ends at 5"):
        document_ids_of({"cu_seq_lens_k": cu}, 8, 8)


def test_the_reads_pass_is_the_base_model_where_it_holds_every_gated_layer():
    from torch import nn

    from urpe.hf.patch import pass_module

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))

    class WithHead(nn.Module):
        base_model_prefix = "stack"

        def __init__(self):
            super().__init__()
            self.stack, self.head = Stack(), nn.Linear(2, 2)

        @property
        def base_model(self):
            return self.stack

    model = WithHead()
    layers = list(model.stack.layers)
    assert pass_module(model, layers) is model.stack
    assert pass_module(model, [*layers, model.head]) is model  # a gated module outside it
    assert pass_module(model.stack, layers) is model.stack  # (no base_model: the module itself)
    llama = gated_model("llama")
    assert all(
        any(getattr(h, "__self__", None).__class__.__name__ == "DocumentReads" for h in hooks)
        for hooks in (
            llama.model._forward_pre_hooks.values(),
            llama.model._forward_hooks.values(),
        )
    )
    assert not llama._forward_pre_hooks and not llama._forward_hooks
