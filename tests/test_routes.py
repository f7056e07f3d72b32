"""One visible route from a call to the C++ kernel's ops: traced at run time, each mode (calls
without gradients, first and later; forward and backward; decoding with a growing cache; a
patched Hugging Face model) reaches each op by one Python route (issue 38)."""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch

import urpe
from urpe.kernels.cpp import unavailable

from .cpp_calls import wrap_cpp_calls

pytestmark = pytest.mark.skipif(unavailable() is not None, reason="no C++ kernel")

PACKAGE = Path(urpe.__file__).parent
ATTENTION_OPS = ("forward", "forward_if_finite", "forward_checked_with_stat", "backward")
# calls without gradients in plain eager mode: the checked forward, without the dispatcher
NO_GRAD = "forward_if_finite entry"
# calls with gradients in plain eager mode: the checked forward that keeps the statistic
WITH_GRAD = ("forward_checked_with_stat", "backward")


@pytest.fixture
def routes(monkeypatch):
    """function -> the distinct routes (urpe's frames, outermost first) that reached it; a
    function is named by the op ("forward_if_finite") or, called through the library's Python
    entry without the dispatcher, "forward_if_finite entry"."""
    seen: dict[str, set[tuple]] = {}

    def recording(name: str, via: str, function):
        if name not in ATTENTION_OPS:
            return function
        key = name if via == "op" else f"{name} {via}"

        def recorded(*arguments):
            frames = traceback.extract_stack()[:-1]
            route = tuple(
                (Path(f.filename).relative_to(PACKAGE).as_posix(), f.name)
                for f in frames
                if Path(f.filename).is_relative_to(PACKAGE)
            )
            seen.setdefault(key, set()).add(route)
            return function(*arguments)

        return recorded

    urpe.kernels.dispatch.CALLS.clear()
    wrap_cpp_calls(monkeypatch, recording)
    return seen


def _config(**changes) -> urpe.TransformerConfig:
    settings = dict(
        vocab_size=30, num_layers=3, dim=32, num_heads=4, max_len=64, position="rpe",
        gate="toeplitz", dropout=0.0,
    )  # fmt: skip
    return urpe.TransformerConfig(**{**settings, **changes})


def _one_route_each(routes: dict, names: tuple[str, ...]) -> None:
    assert set(routes) == set(names), routes.keys()
    for name in names:
        assert len(routes[name]) == 1, f"{name}: {len(routes[name])} routes\n" + "\n".join(
            " > ".join(f"{file}:{fn}" for file, fn in route) for route in routes[name]
        )


def test_calls_without_gradients_take_one_route_first_and_later(routes):
    model = urpe.TransformerEncoder(_config()).eval()
    with torch.no_grad():
        for length in (40, 40, 40):  # the first pass prepares, the others reuse
            model(torch.randint(0, 30, (2, length)))
    _one_route_each(routes, (NO_GRAD,))


def test_a_training_step_takes_one_route_forward_and_one_backward(routes):
    model = urpe.TransformerEncoder(_config()).train()
    for _ in range(2):
        model(torch.randint(0, 30, (2, 40))).sum().backward()
    _one_route_each(routes, WITH_GRAD)


@pytest.mark.parametrize("position", ["rpe", "fox"])
def test_decoding_with_a_growing_cache_takes_one_route(routes, position):
    model = urpe.TransformerDecoder(_config(position=position)).eval()
    tokens = torch.randint(0, 30, (1, 20))
    cache = model.new_cache()
    with torch.no_grad():
        model(tokens[:, :8], cache=cache)  # the prompt
        for step in range(8, 20):  # one token a step
            model(tokens[:, step : step + 1], cache=cache)
    _one_route_each(routes, (NO_GRAD,))


def test_a_patched_hugging_face_model_takes_one_route(routes):
    """Prompt and decoding steps of a gated Llama (each patched module keeps its own prepared
    calls): one route to the checked op; a training step: one forward, one backward."""
    pytest.importorskip("transformers")
    from tests.test_hf_positions import VOCAB, gated_llama

    model = gated_llama(torch.float32).eval()
    ids = torch.randint(3, VOCAB, (1, 8))
    with torch.no_grad():
        model.generate(ids, max_new_tokens=6, do_sample=False)
    _one_route_each(routes, (NO_GRAD,))
    routes.clear()
    model.train()
    model(ids, labels=ids).loss.backward()
    _one_route_each(routes, WITH_GRAD)
