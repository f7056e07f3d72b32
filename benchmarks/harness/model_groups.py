"""What the model benchmark measures: its groups, each built once and timed under every
condition, with the baseline its rows are compared with."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from . import attention_calls, generation, hf_llama, whole_steps


@dataclass(frozen=True)
class Group:
    """`build(sizes, progress)` returns an object whose `measure(repeats, progress)` gives the
    records of one condition; `unit` is how the report shows a time ("us" or "ms")."""

    title: str
    baseline: str
    build: Callable
    unit: str = "ms"


def groups(compile_backend: str = "inductor") -> dict[str, Group]:
    """Every group, in run and report order."""
    return {
        "calls": Group(
            "One decoding call (us per call, + us over SDPA)",
            "sdpa",
            attention_calls.decode_calls,
            unit="us",
        ),
        "short": Group(
            "Short rows (ms per call, ratio to SDPA)", "sdpa", attention_calls.short_calls
        ),
        "bf16": Group(
            "bfloat16 forward, long rows (ms per call, ratio to SDPA)",
            "sdpa",
            attention_calls.bf16_calls,
        ),
        "decoder": Group(
            "The library's decoder: greedy generation with its KV cache (ms, ratio "
            "to the same model without the gate)",
            generation.BASELINE,
            generation.decoder_generation,
        ),
        "hf_generate": Group(
            "Hugging Face Llama: greedy generate, eager (ms, ratio to the model without add_urpe)",
            hf_llama.BASELINE,
            hf_llama.hf_generation,
        ),
        "hf_compiled": Group(
            "Hugging Face Llama: generate with a static cache under "
            "torch.compile (ms, ratio to the model without add_urpe)",
            hf_llama.BASELINE,
            partial(hf_llama.hf_compiled_generation, compile_backend=compile_backend),
        ),
        "hf_train": Group(
            "Hugging Face Llama: one training step (ms, ratio to the model without add_urpe)",
            hf_llama.BASELINE,
            hf_llama.hf_training,
        ),
        "end_to_end": Group(
            "the attention report's end-to-end step (ms, ratio to no-PE SDPA)",
            "nope_sdpa",
            whole_steps.end_to_end_steps,
        ),
        "lm_speed": Group(
            "The LM experiment's step time, every URPE variant against its base (ms, ratio)",
            "base",
            whole_steps.lm_steps,
        ),
    }


GROUP_NAMES = tuple(groups())
