"""`urpe evaluate long-context MODEL`: the long-context tasks and perplexity against length, on
any trained causal language model.

MODEL is a urpe run folder (`OUT/runs/<id>`), a checkpoint, or a folder written by
`urpe.save_model` (a language model with its tokenizer: `urpe reproduce lm`, `urpe reproduce
long-context`, `urpe finetune`); or a Hugging Face folder (`save_pretrained`: config.json,
weights and its tokenizer files), with or without URPE gates. Nothing is downloaded.

The tasks are written with the model's own tokenizer, so their lengths are exact in its tokens;
a tokenizer that cannot write every task word (a character model without some letter) runs no
task and says why. Lengths default to 1x, 2x, 4x, 8x the model's training length (urpe: its
segment length; Hugging Face: max_position_embeddings or n_positions); a length past a table of
learned absolute positions (GPT-2's, urpe's ape) is reported as n/a, never run. Perplexity is
measured on the validation split of each --corpora (shakespeare, enwiki-mini, text:PATH or a file
path) read with the model's tokenizer, in consecutive chunks of each length.

Prints the table (or results.json with --json); with --out, writes results.json, results.md and
the figures there.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...cli_types import (
    UsageError,
    describe,
    name_list,
    non_negative_int,
    positive_int,
    positive_int_list,
)
from .presets import DEPTH_TASKS, TASKS, depth_list
from .report import PERPLEXITY

PROG = "urpe evaluate long-context"
DEFAULT_FACTORS = (1, 2, 4, 8)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
MODEL_HELP = "a urpe run folder or checkpoint, or a Hugging Face model folder"
LENGTHS_HELP = (
    "context lengths in tokens, comma-separated (default: --factors x the training length)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    describe(parser, __doc__)
    parser.add_argument("model", type=Path, metavar="MODEL", help=MODEL_HELP)
    parser.add_argument(
        "--tasks",
        type=name_list,
        default=TASKS,
        help=f"comma-separated from {','.join(TASKS)}, or none (default: all)",
    )
    lengths = parser.add_argument_group("lengths")
    lengths.add_argument(
        "--lengths",
        type=positive_int_list,
        default=None,
        help=LENGTHS_HELP,
    )
    lengths.add_argument(
        "--factors",
        type=positive_int_list,
        default=DEFAULT_FACTORS,
        help="multiples of the training length (default: 1,2,4,8)",
    )
    lengths.add_argument(
        "--train-length",
        type=positive_int,
        default=None,
        help="the length --factors multiply (default: the model's training length)",
    )
    parser.add_argument(
        "--depths",
        type=depth_list,
        default=DEFAULT_DEPTHS,
        help=f"needle depths in [0, 1] for {', '.join(DEPTH_TASKS)} (default: 0,0.25,0.5,0.75,1)",
    )
    parser.add_argument(
        "--samples",
        type=positive_int,
        default=32,
        help="samples per task, length and depth (default: %(default)s)",
    )
    parser.add_argument(
        "--seed",
        type=non_negative_int,
        default=0,
        help="seed of the samples (default: %(default)s, as `urpe reproduce long-context`)",
    )
    parser.add_argument(
        "--corpora",
        type=name_list,
        default=(),
        help="perplexity against length on these corpora, comma-separated: shakespeare, "
        "enwiki-mini, text:PATH or a file path (default: none)",
    )
    parser.add_argument(
        "--eval-tokens",
        type=non_negative_int,
        default=16384,
        help="validation tokens scored at each length (0: the whole split; default: %(default)s)",
    )
    parser.add_argument(
        "--device",
        default="auto",
        help="where the model runs: cpu, cuda, cuda:1, ... (default: auto, a GPU if there is one)",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="write results.json, results.md and figures here"
    )
    parser.add_argument("--json", action="store_true", help="print results.json instead")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


@dataclass
class LoadedModel:
    """What is evaluated: the module with urpe's LM interface, its tokenizer and its name."""

    module: Any
    encode: Any  # a task's text -> ids (no end-of-line token; ValueError for unknown words)
    encode_text: Any  # a corpus's text (or bytes) -> ids, as its training read text
    byte_level: bool  # the tokenizer reads bytes (read corpora as bytes)
    training_length: int | None
    name: str


def _is_hugging_face(path: Path) -> bool:
    config = path / "config.json"
    if not path.is_dir() or not config.is_file():
        return False
    try:
        return "model_type" in json.loads(config.read_text())
    except (OSError, ValueError):
        return False


def _hugging_face(path: Path) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..finetune.data import tokenizer_source
    from ..finetune.model_folder import HuggingFaceLM, bidirectional, context_limit

    source = tokenizer_source(path)
    if source is None:
        raise UsageError("MODEL", f"{path} holds no tokenizer (tokenizer.json, vocab.json, ...)")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        if getattr(config, "urpe", None) is not None:
            import urpe.hf

            model = urpe.hf.from_pretrained(path, AutoModelForCausalLM, local_files_only=True)
        else:
            model = AutoModelForCausalLM.from_pretrained(
                path, local_files_only=True, dtype="float32", attn_implementation="sdpa"
            )
    except (OSError, ValueError, KeyError) as error:
        raise UsageError("MODEL", f"{path}: {str(error).strip().splitlines()[0]}") from None
    if bidirectional(model):
        raise UsageError("MODEL", f"{path} holds an encoder (is_decoder=False), not a causal LM")
    limit = context_limit(model.config.get_text_config())
    if source == "urpe":
        from ...data.text import load_tokenizer

        tokenizer = load_tokenizer(path)
        return LoadedModel(
            HuggingFaceLM(model.float().eval(), limit or 0),
            _urpe_encoder(tokenizer),
            _corpus_encoder(tokenizer),
            tokenizer.kind == "byte",
            limit,
            path.name,
        )
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UsageError("MODEL", f"the tokenizer in {path} cannot be loaded: {first}") from None

    def encode(text: str) -> list[int]:
        return list(hf(text, add_special_tokens=False, verbose=False)["input_ids"])

    return LoadedModel(
        HuggingFaceLM(model.float().eval(), limit or 0), encode, encode, False, limit, path.name
    )


def _urpe_encoder(tokenizer):
    from .experiment import text_encoder

    return text_encoder(tokenizer)


def _corpus_encoder(tokenizer):
    """A urpe tokenizer's encode for a corpus; ValueError when over half the ids are <unk> (a
    word vocabulary of another text: its perplexity would measure nothing)."""

    def encode(text) -> list[int]:
        ids = tokenizer.encode(text)
        unknown = getattr(tokenizer, "UNK", None)
        if unknown is not None and ids.numel():
            share = float((ids == tokenizer.backend.token_to_id(unknown)).float().mean())
            if share > 0.5:
                raise ValueError(f"{share:.0%} of its words are not in the model's vocabulary")
        return ids.tolist()

    return encode


def _urpe(path: Path) -> LoadedModel:
    from ...training.bundles import TextModel
    from ..trained import find_trained

    trained = find_trained(path, None, lambda line: print(f"{PROG}: {line}", file=sys.stderr))
    if not isinstance(trained.model, TextModel):
        raise UsageError("MODEL", f"{trained.checkpoint} is not a language model with a tokenizer")
    bundle = trained.model
    run = trained.run
    name = run.get("variant") or path.name
    return LoadedModel(
        bundle.model.eval(),
        _urpe_encoder(bundle.tokenizer),
        _corpus_encoder(bundle.tokenizer),
        bundle.tokenizer.kind == "byte",
        getattr(bundle.model, "segment_length", None),
        name,
    )


def load(path: Path) -> LoadedModel:
    """The model MODEL names (UsageError if none)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise UsageError("MODEL", f"{path}: no such file or folder")
    return _hugging_face(path) if _is_hugging_face(path) else _urpe(path)


def corpus_tokens(spec: str, loaded: LoadedModel, count: int):
    """The head of the validation split of corpus `spec`, encoded with the model's tokenizer
    (`count` + 1 tokens; 0: all). UsageError naming --corpora when it cannot be read."""
    import torch

    from ...data.text import CORPORA, DatasetError, parse_spec

    try:
        name, where = parse_spec(spec)
        files = CORPORA[name].locate(where)
        _, valid, _ = CORPORA[name].read(files, loaded.byte_level, False)
    except DatasetError as error:
        raise UsageError("--corpora", str(error)) from None
    if count > 0:  # a token is at least one character or byte: read no more than needed
        valid = valid[: max(count + 1, 1) * 16]
    ids = torch.tensor(loaded.encode_text(valid), dtype=torch.long)
    return ids if count <= 0 else ids[: count + 1]


def corpus_label(spec: str) -> str:
    """How a table names a corpus: a file by its name, a packaged corpus by its own."""
    from ...data.text import CORPORA, parse_spec

    name, where = parse_spec(spec)
    return Path(where).name if where is not None and CORPORA[name].needs_path else name


def _device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as error:
        raise UsageError("--device", f"{name}: {str(error).splitlines()[0]}") from None
    return device


def measure(loaded: LoadedModel, args: argparse.Namespace) -> dict[str, Any]:
    """results.json's data for this one model."""
    from ...progress import progress_bar
    from ...tasks.long_context import TASKS as REGISTRY
    from .evaluation import Reader, accuracies, cells, perplexities, reading_limit

    tasks = [REGISTRY[t] for t in args.tasks if t != "none"]
    unknown = [t for t in args.tasks if t not in REGISTRY and t != "none"]
    if unknown:
        raise UsageError("--tasks", f"unknown task {unknown[0]}; choose from {', '.join(TASKS)}")
    base = args.train_length or loaded.training_length
    if args.lengths is None and base is None:
        raise UsageError("--lengths", "the model names no training length: give --lengths")
    lengths = list(args.lengths or [f * base for f in args.factors])
    loaded.module.to(_device(args.device))
    reader = Reader(loaded.module, loaded.encode, reading_limit(loaded.module))
    bar = progress_bar(
        total=cells(tasks, lengths, args.depths) + len(lengths) * len(args.corpora),
        desc="long-context",
        unit="cell",
        enabled=not args.no_progress,
    )
    table, notes = accuracies(
        reader, tasks, lengths, args.depths, args.samples, args.seed, lambda: bar.update(1)
    )
    results: dict[str, Any] = {
        "results": {task: {loaded.name: cells} for task, cells in table.items()},
        "metric": {task: "accuracy" for task in table},
        "chance": {task.name: task.chance for task in tasks if task.name in table},
        "training_length": {loaded.name: base},
        "seeds": {loaded.name: [args.seed]},
        "notes": {},
        "runs": [],
    }
    for spec in args.corpora:
        task = PERPLEXITY + corpus_label(spec)
        try:
            tokens = corpus_tokens(spec, loaded, args.eval_tokens)
        except ValueError as error:  # the model's tokenizer cannot read it
            notes[task] = f"the model's tokenizer cannot read {spec}: {error}"
            bar.update(len(lengths))
            continue
        values, more = perplexities(reader, tokens, lengths)
        bar.update(len(lengths))
        results["results"][task] = {loaded.name: values}
        results["metric"][task] = "perplexity"
        notes.update(more)
    bar.close()
    if notes:
        results["notes"][loaded.name] = notes
    return results


def run(args: argparse.Namespace) -> int:
    from .report import markdown, write_results

    started = time.perf_counter()
    loaded = load(args.model)
    if args.out is not None:
        from ...cli_types import check_writable_directory

        check_writable_directory(args.out)
    results = measure(loaded, args)
    if args.out is not None:
        from .plots import figures

        write_results(results, args.out, time.perf_counter() - started)
        written = figures(results, args.out, f"Long-context tasks: {loaded.name}")
        paths = [args.out / "results.json", args.out / "results.md", *written]
        print(f"{PROG}: wrote {', '.join(map(str, paths))}", file=sys.stderr)
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print(markdown(results, f"Long-context tasks: {loaded.name}"))
    return 0
