"""End to end: one optimizer step (forward, backward, Adam) of small encoders built from
`urpe.models`, URPE and RPE on "auto" against no positions on SDPA, and x-transformers' T5
relative bias where it is installed.

The sizes are stated here, not borrowed from an experiment's presets: "quick" is the synthetic
quick preset's model (3 layers, dim 64, 4 heads, FFN 256, length 24, batch 64), "long" the same
depth at length 1024, and "paper" the synthetic tasks' paper model (3 layers, 768 wide, 12 heads,
FFN 3072, length 128, batch 128), timed on a GPU under bfloat16 autocast.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from urpe.bench.clocks import interleaved_medians
from urpe.kernels import Toeplitz, select_backend
from urpe.models import TransformerConfig, TransformerEncoder


@dataclass(frozen=True)
class Size:
    size: str
    batch: int
    length: int
    dim: int
    heads: int
    ffn: int
    layers: int


SIZES = {
    "quick": Size("quick", batch=64, length=24, dim=64, heads=4, ffn=256, layers=3),
    "long": Size("long", batch=2, length=1024, dim=128, heads=8, ffn=512, layers=3),
    "paper": Size("paper", batch=128, length=128, dim=768, heads=12, ffn=3072, layers=3),
}
DEVICE_SIZES = {"cpu": ("quick", "long"), "cuda": ("paper",)}
# name -> (position, gate, attention backend)
VARIANTS = {
    "urpe_auto": ("rpe", "toeplitz", "auto"),
    "rpe_auto": ("rpe", None, "auto"),
    "nope_sdpa": ("none", None, "sdpa"),
}
BASELINE = "nope_sdpa"
VOCAB = 10


def build_model(size: Size, variant: str) -> torch.nn.Module:
    position, gate, backend = VARIANTS[variant]
    config = TransformerConfig(
        vocab_size=VOCAB,
        max_len=size.length,
        num_layers=size.layers,
        dim=size.dim,
        num_heads=size.heads,
        ffn_dim=size.ffn,
        position=position,
        gate=gate,
        attention_backend=backend,
    )
    return TransformerEncoder(config)


def xtransformers_t5(size: Size) -> torch.nn.Module:
    """x-transformers' encoder with T5's relative bias (ImportError when not installed)."""
    from x_transformers import Encoder, TransformerWrapper

    layers = Encoder(dim=size.dim, depth=size.layers, heads=size.heads, rel_pos_bias=True)
    return TransformerWrapper(
        num_tokens=VOCAB,
        max_seq_len=size.length,
        use_abs_pos_emb=False,
        return_only_embed=True,
        attn_layers=layers,
    )


def train_step(model: torch.nn.Module, tokens: torch.Tensor, autocast: bool) -> Callable[[], None]:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=autocast):
            hidden = model(tokens)  # (B, L, dim)
        hidden.float().square().mean().backward()
        optimizer.step()

    return step


def picked_backend(variant: str, size: Size, device: str) -> str:
    """The kernel "auto" takes for this variant's attention calls."""
    position, gate, backend = VARIANTS[variant]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    probe = torch.empty(
        size.batch, size.heads, size.length, size.dim // size.heads, device=device, dtype=dtype
    )  # (B, H, L, D)
    table = Toeplitz(torch.ones(size.heads, 2 * size.length - 1, device=device))
    terms = dict(bias=table if position == "rpe" else None, gate=table if gate else None)
    return select_backend(backend, probe, probe, probe, **terms).name


def end_to_end(
    device: str, repeats: int, warmup: int, progress, sizes: list[Size] | None = None
) -> list[dict]:
    """Median time of one training step per model and size (default: the device's sizes),
    steps interleaved, with the ratio to no positions on SDPA."""
    records = []
    for size in sizes or [SIZES[name] for name in DEVICE_SIZES[device]]:
        models = {variant: build_model(size, variant) for variant in VARIANTS}
        backends = {variant: picked_backend(variant, size, device) for variant in VARIANTS}
        try:
            models["xtransformers_t5"] = xtransformers_t5(size)
        except ImportError:
            records.append(dict(name="xtransformers_t5", size=size.size, skipped="not installed"))
        tokens = torch.randint(0, VOCAB, (size.batch, size.length), generator=torch.Generator())
        tokens = tokens.to(device)
        steps = {
            name: train_step(model.to(device), tokens, device == "cuda")
            for name, model in models.items()
        }
        for step in steps.values():
            for _ in range(max(1, warmup)):
                step()
        medians = interleaved_medians(steps, repeats, device)
        for name, ms in medians.items():
            record = dict(name=name, **asdict(size), time_ms=ms)
            record["ratio_to_nope_sdpa"] = ms / medians[BASELINE]
            if name in backends:
                record["backend"] = backends[name]
            records.append(record)
        progress(f"  end-to-end {size.size}: done")
        del models, steps
    return records
