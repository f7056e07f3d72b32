"""Whole training steps measured by code that has its own loop, rebuilt under each condition
of the model benchmark:

    end_to_end   the attention report's end-to-end rows (`end_to_end`): one optimizer step
                 of small encoders, URPE on "auto" against no positions on SDPA
    lm_speed     the LM experiment's step time of every URPE variant against its base
                 (`urpe.experiments.lm.speed`: the two models of a pair step in alternation)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .end_to_end import end_to_end
from .model_sizes import Sizes


@dataclass(frozen=True)
class EndToEnd:
    sizes: Sizes
    about: str = (
        "One optimizer step (forward, backward, Adam) of an encoder from urpe.models: "
        "URPE and RPE on 'auto' against no positions on SDPA."
    )

    def measure(self, repeats: int, progress: Callable[[str], None]) -> list[dict]:
        records = []
        for r in end_to_end("cpu", repeats, 1, progress, sizes=list(self.sizes.steps)):
            size = next(s for s in self.sizes.steps if s.size == r["size"])
            shape = (
                f"B={size.batch}, L={size.length}, width {size.dim}, {size.heads} heads, "
                f"{size.layers} layers"
            )
            record = dict(case=size.size, shape=shape, name=r["name"], mode="train")
            for field in ("time_ms", "skipped", "backend"):
                if field in r:
                    record[field] = r[field]
            records.append(record)
        return records


def lm_pairs() -> list[tuple[str, str]]:
    """(base, URPE variant) for every URPE variant of the LM experiment's speed check."""
    from urpe.experiments.lm.speed import PAIRS

    return [tuple(pair.split(":")) for pair in PAIRS.split(",")]


@dataclass(frozen=True)
class LanguageModelSteps:
    sizes: Sizes

    @property
    def about(self) -> str:
        return (
            "`urpe.experiments.lm.speed`: the LM quick preset's model and batch, forward, "
            "backward, Adam; the two models of a pair step in alternation, median of "
            f"{self.sizes.lm_steps} steps after {self.sizes.lm_warmup}."
        )

    def measure(self, repeats: int, progress: Callable[[str], None]) -> list[dict]:
        from urpe.experiments.lm.speed import measure

        rows = measure(lm_pairs(), self.sizes.lm_steps, warmup=self.sizes.lm_warmup)
        return [
            dict(
                case=r["urpe"],
                shape=f"{r['base']} vs {r['urpe']}",
                name=name,
                variant=r[name],
                mode="train",
                time_ms=r[f"{name}_ms"],
            )
            for r in rows
            for name in ("base", "urpe")
        ]


def end_to_end_steps(sizes: Sizes, progress) -> EndToEnd:
    return EndToEnd(sizes)


def lm_steps(sizes: Sizes, progress) -> LanguageModelSteps:
    return LanguageModelSteps(sizes)
