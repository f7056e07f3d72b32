"""Step time of each URPE variant against its base, measured side by side in one process.

    python -m urpe.experiments.lm.speed [--steps 40] [--pairs rpe:urpe,txl:txl+urpe]

The sweep's own tokens/s come from runs that share the CPU with each other (and with whatever
else runs), so their ratios are noisy. Here both models of a pair train on the same batch in
alternation (forward, backward, Adam step), one torch thread, after a warm-up; the median of
each model's step times is compared, so slow phases of the machine hit both alike. Sizes are the
quick preset's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from ...models.lm import LanguageModel
from ..recipes import sized_transformer
from .presets import PRESETS
from .variants import parse_variant

PAIRS = "rpe:urpe,txl:txl+urpe,rope:rope+urpe,alibi:alibi+urpe,t5:t5+urpe"


def _model(variant: str, vocab: int) -> LanguageModel:
    p = PRESETS["quick"]
    v = parse_variant(variant)
    base = sized_transformer(p, vocab, norm_first=True, embedding_norm=False)
    return LanguageModel(v.config(base), p.segment_length, p.memory_length if v.memory else 0)


def measure(pairs: list[tuple[str, str]], steps: int, vocab: int = 76, warmup: int = 5) -> list:
    """[{base, urpe, base_ms, urpe_ms, ratio}] from alternating training steps."""
    p = PRESETS["quick"]
    tokens = torch.randint(
        0, vocab, (p.batch_size, p.segment_length + 1), generator=torch.Generator().manual_seed(0)
    )
    rows = []
    for names in pairs:
        models = [_model(n, vocab) for n in names]
        optimizers = [torch.optim.Adam(m.parameters(), 1e-3) for m in models]
        memories: list = [None, None]
        times: list[list[float]] = [[], []]
        for step in range(warmup + steps):
            for i, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
                start = time.perf_counter()
                logits, memories[i] = model(tokens[:, :-1], memories[i])
                loss = torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1), tokens[:, 1:].flatten()
                )
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                if step >= warmup:
                    times[i].append(time.perf_counter() - start)
        base, gated = (statistics.median(t) * 1e3 for t in times)
        rows.append(
            {
                "base": names[0],
                "urpe": names[1],
                "base_ms": base,
                "urpe_ms": gated,
                "ratio": gated / base,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m urpe.experiments.lm.speed", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--steps", type=int, default=40, help="timed steps per model")
    parser.add_argument("--pairs", default=PAIRS, help=f"base:gated,... (default {PAIRS})")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    pairs = [tuple(p.split(":")) for p in args.pairs.split(",")]
    rows = measure(pairs, args.steps)
    print("| base | URPE variant | base ms/step | URPE ms/step | ratio |\n|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['base']} | {r['urpe']} | {r['base_ms']:.1f} | {r['urpe_ms']:.1f} | "
            f"{r['ratio']:.2f}x |"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
