"""Greedy generation with the library's own decoder (`urpe.models.LanguageModel` and its KV
cache), for the model benchmark: the same model with URPE's gate ("urpe"), without it ("rpe":
the Toeplitz bias alone, the baseline) and without positions ("nope"), at each batch size.

The models share their weights (one seed) but for the bias and gate tables; the window holds
prompt and continuation, so generation never rolls to a new segment.
"""

from __future__ import annotations

import torch

from urpe.models import LanguageModel, TransformerConfig

from .model_sizes import DecoderSize, Sizes
from .timed import Timed

# name -> the config fields that make the variant
VARIANTS = {
    "urpe": dict(position="rpe", gate="toeplitz"),
    "rpe": dict(position="rpe"),
    "nope": dict(position="none"),
}
BASELINE = "rpe"


def language_model(size: DecoderSize, variant: str, window: int, seed: int = 0) -> LanguageModel:
    """A pre-LN causal decoder of `size`, in eval mode, with the variant's position terms."""
    config = TransformerConfig(
        vocab_size=size.vocab,
        num_layers=size.layers,
        dim=size.dim,
        num_heads=size.heads,
        ffn_dim=size.ffn,
        norm_first=True,
        **VARIANTS[variant],
    )
    torch.manual_seed(seed)
    return LanguageModel(config, segment_length=window).eval()


def prompts(sizes: Sizes, vocab: int) -> dict[int, torch.Tensor]:
    """A random prompt (B, P) per batch size."""
    gen = torch.Generator().manual_seed(0)
    return {b: torch.randint(0, vocab, (b, sizes.prompt), generator=gen) for b in sizes.batches}


def _greedy(model: LanguageModel, prompt: torch.Tensor, new_tokens: int):
    def generate() -> None:
        for _ in model.generate(prompt, new_tokens, temperature=0):
            pass

    return generate


def decoder_generation(sizes: Sizes, progress) -> Timed:
    window = sizes.prompt + sizes.new_tokens
    models = {name: language_model(sizes.decoder, name, window) for name in VARIANTS}
    d = sizes.decoder
    about = (
        f"{sizes.new_tokens} tokens after a {sizes.prompt}-token prompt, greedy; "
        f"LanguageModel, pre-LN, {d.layers} layers, width {d.dim}, {d.heads} heads, FFN "
        f"{d.ffn}, vocab {d.vocab}; urpe: Toeplitz bias and gate, rpe: the bias alone, "
        "nope: no positions."
    )
    return per_batch(sizes, models, _greedy, about, progress)


def per_batch(
    sizes: Sizes, models: dict, greedy, about: str, progress, warmups: int = 1, note: str = ""
) -> Timed:
    """Greedy generation by each model (name -> model) at each batch size, a case per batch,
    warmed up; `greedy(model, prompt, new_tokens)` makes one generation's call."""
    timed = Timed(cases={}, shapes={}, about=about)
    for batch, prompt in prompts(sizes, sizes.decoder.vocab).items():
        case = f"batch {batch}"
        timed.cases[case] = {
            (name, "generate"): greedy(model, prompt, sizes.new_tokens)
            for name, model in models.items()
        }
        timed.shapes[case] = f"B={batch}"
        for (name, _), call in timed.cases[case].items():
            progress(f"  warm-up {case} {name}{note}")
            for _ in range(warmups):
                call()
    return timed
