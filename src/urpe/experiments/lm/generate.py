"""`urpe generate CHECKPOINT --prompt TEXT`: stream text from a trained language model.

CHECKPOINT is a sweep folder of `urpe reproduce lm` (OUT: its best run), a run folder
(`OUT/runs/<id>`), its `checkpoints/` folder, one `step-N` checkpoint, or a folder written by
`urpe.save_model`. The model is rebuilt from config.json and model.safetensors (no pickle); the
tokenizer is read from beside the checkpoint (or from --tokenizer). Prompt words a word-level
tokenizer does not know are named in one warning (they become <unk>), and the continuation is
joined to the prompt with the tokenizer's separator (a space between words). Tokens are printed
as they are drawn, decoding through the KV cache and, for memory models, the segment memory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ...cli_types import UsageError, non_negative_int, positive_float, positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint",
        type=Path,
        metavar="CHECKPOINT",
        help="a sweep folder (its best run), a run folder (runs/<id>), its "
        "checkpoints/ folder, or a checkpoint directory",
    )
    parser.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    parser.add_argument(
        "--max-new-tokens",
        type=non_negative_int,
        default=200,
        help="tokens to generate (default: %(default)s)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="softmax temperature; 0 = greedy (default: %(default)s)",
    )
    parser.add_argument(
        "--top-k",
        type=positive_int,
        default=None,
        help="sample among the K most likely tokens only",
    )
    parser.add_argument(
        "--top-p",
        type=positive_float,
        default=None,
        help="nucleus sampling: the smallest set of tokens with mass >= P (0 < P <= 1)",
    )
    parser.add_argument(
        "--seed",
        type=non_negative_int,
        default=0,
        help="random seed of the sampler (default: %(default)s)",
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="tokenizer.json or its folder (default: found beside the checkpoint)",
    )
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="recompute every step without the KV cache (slow; same text)",
    )


def _load(args: argparse.Namespace):
    from ...data.text import DatasetError, load_tokenizer
    from ...training.bundles import TextModel
    from ..trained import find_trained

    say = lambda line: print(f"urpe generate: {line}", file=sys.stderr)  # noqa: E731
    trained = find_trained(args.checkpoint, "lm", say, argument="CHECKPOINT")
    model = getattr(trained.model, "model", trained.model)
    if not hasattr(model, "segment_length"):
        raise UsageError(
            "CHECKPOINT",
            f"{trained.checkpoint} holds a {type(model).__name__}, not a language model",
        )
    if args.tokenizer is None and not isinstance(trained.model, TextModel):
        raise UsageError(
            "--tokenizer", f"no tokenizer.json beside {trained.checkpoint}; give --tokenizer"
        )
    if args.tokenizer is None:
        bundle = trained.model
    else:
        try:
            bundle = TextModel(model, load_tokenizer(args.tokenizer))
        except DatasetError as error:
            raise UsageError("--tokenizer", str(error)) from None
    if bundle.tokenizer.vocab_size != model.vocab_size:
        raise UsageError(
            "--tokenizer",
            f"{bundle.tokenizer.vocab_size} tokens, but the model "
            f"has a vocabulary of {model.vocab_size}",
        )
    return bundle


def _stable(text: str) -> str:
    """The part of a decoded text that more tokens cannot change (a byte tokenizer decodes an
    unfinished UTF-8 character as U+FFFD until its last byte arrives)."""
    return text.rstrip("\ufffd")


def run(args: argparse.Namespace) -> int:
    if not args.temperature >= 0 or args.temperature == float("inf"):
        raise UsageError("--temperature", f"must be a finite number >= 0, got {args.temperature}")
    if args.top_p is not None and args.top_p > 1:
        raise UsageError("--top-p", f"must lie in (0, 1], got {args.top_p}")
    if not args.prompt:
        raise UsageError("--prompt", "the prompt is empty; give at least one character")
    bundle = _load(args)
    model, tokenizer = bundle.model, bundle.tokenizer
    unknown = tokenizer.unknown(args.prompt)
    if unknown:
        shown = ", ".join(unknown[:10]) + (", ..." if len(unknown) > 10 else "")
        print(
            f"urpe generate: warning: {len(unknown)} prompt word(s) not in the vocabulary "
            f"become <unk>: {shown}",
            file=sys.stderr,
        )
    try:
        bundle.encode_prompt(args.prompt)
    except ValueError as error:
        raise UsageError("--prompt", str(error)) from None
    if args.top_k is not None and args.top_k > model.vocab_size:
        raise UsageError("--top-k", f"{args.top_k} exceeds the vocabulary ({model.vocab_size})")
    out = sys.stdout
    out.write(args.prompt)
    out.flush()
    ids: list[int] = []
    shown = ""
    for token in bundle.tokens(
        args.prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        use_cache=not args.no_cache,
    ):
        ids.append(token)
        text = _stable(tokenizer.join(args.prompt, tokenizer.decode(ids)))[len(args.prompt) :]
        if text.startswith(shown) and len(text) > len(shown):
            out.write(text[len(shown) :])
            out.flush()
            shown = text
    final = tokenizer.join(args.prompt, tokenizer.decode(ids))[len(args.prompt) :]
    if final.startswith(shown):
        out.write(final[len(shown) :])
    out.write("\n")
    out.flush()
    return 0
