"""The variants of the synthetic experiment: a name -> the `TransformerConfig` fields it sets.

Every variant starts from no position information at all; only the fields listed change. The
names are part of the command-line interface.

`breaks_row_sum` records the theory each variant tests (paper, Su 2022): True when the variant can
tell identical tokens apart (absolute encodings, URPE's gate, a value-side term, a normalisation
without a softmax denominator, marker tokens), False when it only edits pre-softmax logits and so
must stay at chance on the probe.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ...models import TransformerConfig


@dataclass(frozen=True)
class Variant:
    name: str
    description: str
    changes: dict[str, Any] = field(default_factory=dict)
    breaks_row_sum: bool = False


def _variants(*items: Variant) -> dict[str, Variant]:
    return {v.name: v for v in items}


VARIANTS: dict[str, Variant] = _variants(
    Variant("nope", "no position information", {}),
    Variant("ape", "learned absolute embeddings", {"absolute": "learned"}, True),
    Variant("sinusoidal", "sinusoidal absolute embeddings", {"absolute": "sinusoidal"}, True),
    Variant("rpe", "per-offset Toeplitz bias B (the paper's RPE)", {"position": "rpe"}),
    Variant("t5", "T5 bucketed bias", {"position": "t5"}),
    Variant("alibi", "ALiBi linear bias", {"position": "alibi"}),
    Variant("rope", "rotary embeddings", {"position": "rope"}),
    Variant("kerple", "KERPLE (log kernel)", {"position": "kerple-log"}),
    Variant("fire", "FIRE functional bias", {"position": "fire"}),
    Variant("shaw", "Shaw et al. relative keys and values", {"position": "shaw"}, True),
    Variant("txl", "Transformer-XL relative attention", {"position": "txl"}),
    Variant(
        "urpe",
        "rpe bias B + Toeplitz gate C = 1 (the paper's URPE)",
        {"position": "rpe", "gate": "toeplitz"},
        True,
    ),
    Variant(
        "urpe-per-layer",
        "urpe with its own B and C in every layer (the paper shares one pair)",
        {"position": "rpe", "gate": "toeplitz", "share_position": False},
        True,
    ),
    Variant(
        "urpe-gate-normal",
        "urpe with C drawn from N(0, 0.02^2) instead of ones (issue 12: the gate's initialisation)",
        {"position": "rpe", "gate": {"name": "toeplitz", "init": "normal"}},
        True,
    ),
    Variant(
        "urpe-raw-embed",
        "urpe without the LayerNorm on the token embeddings (issue 12): tokens start small, so "
        "every token's value starts as the shared projection bias",
        {"position": "rpe", "gate": "toeplitz", "embedding_norm": False},
        True,
    ),
    Variant(
        "urpe-t5",
        "T5 bucketed B and bucketed C",
        {"position": "t5", "gate": "t5"},
        True,
    ),
    Variant(
        "exp",
        "rpe bias, exp(s) without denominator",
        {"position": "rpe", "normalization": "exp"},
        True,
    ),  # noqa: E501
    Variant(
        "l2", "rpe bias, l2-normalised exp(s)", {"position": "rpe", "normalization": "l2"}, True
    ),  # noqa: E501
    Variant(
        "relu2", "rpe bias, relu(s)^2 / n", {"position": "rpe", "normalization": "relu2"}, True
    ),  # noqa: E501
    Variant(
        "anchors",
        "rpe bias + learned [CLS]/[SEP] markers",
        {"position": "rpe", "markers": True},
        True,
    ),  # noqa: E501
)


def parse_variants(text: str) -> list[str]:
    """ "a,b,c" or "all" -> names, checked."""
    names = list(VARIANTS) if text.strip() == "all" else [n.strip() for n in text.split(",")]
    names = [n for n in names if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        raise ValueError(
            f"unknown variant {', '.join(unknown) or '(none given)'}; choose from "
            f"{', '.join(VARIANTS)} or 'all'"
        )
    return names


def variant_config(name: str, base: TransformerConfig) -> TransformerConfig:
    """`base` (which must carry no position information) with the variant's fields set."""
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
    return replace(base, **VARIANTS[name].changes)
