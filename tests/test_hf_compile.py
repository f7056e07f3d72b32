"""urpe.hf under torch.compile(fullgraph=True): a gated model's training forward (FoX forget gates
and a gate, on a packed batch, with the cache transformers makes in training) traces as one
graph, with the losses and gradients of the model run eagerly. Dynamo's "eager" backend keeps
the test fast: it checks the tracing, not inductor's code generation."""

from __future__ import annotations

import torch
from transformers import DataCollatorWithFlattening

from tests.test_hf_decay import fox_model
from tests.test_hf_packing import documents


def test_a_gated_training_forward_compiles_as_one_graph():
    model = fox_model("llama", dtype=torch.float32).train()
    batch = DataCollatorWithFlattening()([{"input_ids": d.tolist()} for d in documents()])
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    results = []
    for run in (compiled, model):
        model.zero_grad(set_to_none=True)
        loss = run(**batch).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if "urpe" in n}
        results.append((loss.detach(), grads))
    (loss, grads), (want_loss, want_grads) = results
    torch.testing.assert_close(loss, want_loss)
    assert grads.keys() == want_grads.keys() and len(grads) == 6  # 2 gates, 2 x 2 forget
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, msg=name)


def test_the_models_call_compiled_as_transformers_compiles_it_is_one_frame():
    """transformers compiles `model.__call__` (static-cache generation): add_urpe's hooks run
    inside that call's graph, not as frames of their own, each checking its guards per step."""
    from torch._dynamo.utils import counters

    model = fox_model("llama", dtype=torch.float32).eval()
    ids = documents()[0][None]
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model.__call__, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).logits, model(ids).logits)
    assert counters["frames"]["ok"] == 1
