"""`urpe generate CHECKPOINT --prompt TEXT`: stream text from a trained language model.

CHECKPOINT is a run folder of `urpe reproduce lm` (`OUT/runs/<id>`), its `checkpoints/` folder
or one `step-N` checkpoint. The model is rebuilt from config.json and model.safetensors (no
pickle); the tokenizer is read from `tokenizer/tokenizer.json` in the checkpoint, its
`checkpoints/` folder or the run folder (or from --tokenizer). Tokens are printed as they are
drawn, decoding through the KV cache and, for memory models, the segment memory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ...cli_types import UsageError, non_negative_int, positive_float, positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", type=Path, metavar="CHECKPOINT",
                        help="a run folder (runs/<id>), its checkpoints/ folder, or a step-N "
                             "checkpoint directory")  # fmt: skip
    parser.add_argument("--prompt", default="\n",
                        help="text to continue (default: a newline)")  # fmt: skip
    parser.add_argument("--max-new-tokens", type=non_negative_int, default=200,
                        help="tokens to generate (default: %(default)s)")  # fmt: skip
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="softmax temperature; 0 = greedy (default: %(default)s)",
    )
    parser.add_argument("--top-k", type=positive_int, default=None,
                        help="sample among the K most likely tokens only")  # fmt: skip
    parser.add_argument("--top-p", type=positive_float, default=None,
                        help="nucleus sampling: the smallest set of tokens with mass >= P "
                             "(0 < P <= 1)")  # fmt: skip
    parser.add_argument("--seed", type=non_negative_int, default=0,
                        help="random seed of the sampler (default: %(default)s)")  # fmt: skip
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="tokenizer.json or its folder (default: found beside the "
                             "checkpoint)")  # fmt: skip
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="recompute every step without the KV cache (slow; same text)",
    )


def find_tokenizer(checkpoint: Path) -> Path | None:
    """tokenizer/ in the checkpoint directory, its parent (checkpoints/) or the run folder."""
    for folder in (checkpoint, checkpoint.parent, checkpoint.parent.parent):
        if (folder / "tokenizer" / "tokenizer.json").is_file():
            return folder / "tokenizer"
    return None


def _load(args: argparse.Namespace):
    from ...data.text import DatasetError, load_tokenizer
    from ...models.lm import LanguageModel
    from ...training.checkpoint import CheckpointError, load_model, resolve_checkpoint

    try:
        directory = resolve_checkpoint(args.checkpoint)
        model = load_model(directory)
    except (FileNotFoundError, CheckpointError, ValueError) as error:
        raise UsageError("CHECKPOINT", str(error)) from None
    if not isinstance(model, LanguageModel):
        raise UsageError("CHECKPOINT", f"{directory} holds a {type(model).__name__}, not a "
                                       "language model")  # fmt: skip
    source = args.tokenizer or find_tokenizer(directory)
    if source is None:
        raise UsageError("--tokenizer", f"no tokenizer/tokenizer.json beside {directory}; "
                                        "give --tokenizer")  # fmt: skip
    try:
        tokenizer = load_tokenizer(source)
    except DatasetError as error:
        raise UsageError("--tokenizer", str(error)) from None
    if tokenizer.vocab_size != model.vocab_size:
        raise UsageError("--tokenizer", f"{source}: {tokenizer.vocab_size} tokens, but the model "
                                        f"has a vocabulary of {model.vocab_size}")  # fmt: skip
    return model, tokenizer


def _stable(text: str) -> str:
    """The part of a decoded text that more tokens cannot change (a byte tokenizer decodes an
    unfinished UTF-8 character as U+FFFD until its last byte arrives)."""
    return text.rstrip("\ufffd")


def run(args: argparse.Namespace) -> int:
    import torch

    if not args.temperature >= 0 or args.temperature == float("inf"):
        raise UsageError("--temperature", f"must be a finite number >= 0, got {args.temperature}")
    if args.top_p is not None and args.top_p > 1:
        raise UsageError("--top-p", f"must lie in (0, 1], got {args.top_p}")
    if not args.prompt:
        raise UsageError("--prompt", "the prompt is empty; give at least one character")
    model, tokenizer = _load(args)
    try:
        prompt = tokenizer.encode(args.prompt)
    except ValueError as error:
        raise UsageError("--prompt", str(error)) from None
    if prompt.numel() == 0:
        raise UsageError("--prompt", "the prompt encodes to no tokens")
    if args.top_k is not None and args.top_k > model.vocab_size:
        raise UsageError("--top-k", f"{args.top_k} exceeds the vocabulary ({model.vocab_size})")
    generator = torch.Generator().manual_seed(args.seed)
    out = sys.stdout
    out.write(args.prompt)
    out.flush()
    ids: list[int] = []
    shown = ""
    for token in model.generate(prompt[None, :], args.max_new_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, generator=generator,
                                use_cache=not args.no_cache):  # fmt: skip
        ids.append(int(token[0]))
        text = _stable(tokenizer.decode(ids))
        if text.startswith(shown) and len(text) > len(shown):
            out.write(text[len(shown) :])
            out.flush()
            shown = text
    final = tokenizer.decode(ids)
    if final.startswith(shown):
        out.write(final[len(shown) :])
    out.write("\n")
    out.flush()
    return 0
