"""Where the queries and keys of a transformers attention call sit (`urpe.hf.positions`): with a
static KV cache the new queries sit inside a longer key buffer, at a start that is a tensor
under torch.compile; the gate stays a Toeplitz term over its shifted table (no (Lq, Lk) index),
and generation equals the dynamic cache's."""

from __future__ import annotations

import pytest
import torch

import urpe.hf
from tests.hf_families import VOCAB, families
from urpe.kernels import Toeplitz
from urpe.kernels.cpp import unavailable
from urpe.kernels.cpp.ops import GUARDED

OPAQUE = f"urpe.{GUARDED}.default"


def gated_llama(dtype: torch.dtype) -> torch.nn.Module:
    """The tiny Llama with URPE gates moved away from their init (ones), so they matter."""
    model = urpe.hf.add_urpe(families()["llama"].build("sdpa", dtype)).eval()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in urpe.hf.gate_parameters(model):
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return model


def generate(model, ids: torch.Tensor, cache: str):
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=5,
        do_sample=False,
        pad_token_id=0,
        cache_implementation=cache,
        output_scores=True,
        return_dict_in_generate=True,
    )


def test_a_static_cache_keeps_the_gate_toeplitz_and_generates_as_a_dynamic_one():
    model = gated_llama(torch.float64)
    terms = []
    for module in model.modules():
        if isinstance(module, urpe.ToeplitzGate):
            module.register_forward_hook(lambda m, args, out: terms.append(out))
    ids = torch.randint(2, VOCAB, (2, 6), generator=torch.Generator().manual_seed(4))
    static = generate(model, ids, "static")
    assert terms and all(type(t) is Toeplitz for t in terms)
    dynamic = generate(model, ids, "dynamic")
    assert torch.equal(static.sequences, dynamic.sequences)
    for a, b in zip(static.scores, dynamic.scores, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.skipif(unavailable() is not None, reason="no C++ kernel")
def test_compiled_static_cache_gives_the_opaque_op_a_toeplitz_gate():
    """transformers' fast path (a static cache, decoding steps compiled whole, as
    the model benchmark's hf_compiled): the queries' start is a tensor, never read on the host;
    each layer's one opaque op takes the gate as a Toeplitz table, with no (Lq, Lk) index built
    in the graph, and generation equals eager."""
    from transformers import CompileConfig

    model = gated_llama(torch.float32)
    ids = torch.randint(2, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    eager = generate(model, ids, "static")
    graphs = []

    def recording(graph, example_inputs):  # (a function: transformers deep-copies the config)
        graphs.append(graph)
        return torch._dynamo.lookup_backend("aot_eager")(graph, example_inputs)

    torch._dynamo.reset()
    config = CompileConfig(backend=recording, fullgraph=True, dynamic=False, mode=None)
    config._compile_all_devices = True  # transformers compiles on GPUs only otherwise
    model.generation_config.compile_config = config
    compiled = generate(model, ids, "static")
    assert graphs
    assert torch.equal(compiled.sequences, eager.sequences)
    for a, b in zip(compiled.scores, eager.scores, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    calls = [n for g in graphs for n in g.graph.nodes if str(n.target) == OPAQUE]
    assert len(calls) == 2 * len(graphs)  # two layers per compiled forward
    for call in calls:
        # gate_kind: a Toeplitz table; no index
        assert call.args[12] == "toeplitz" and call.args[6] is None
