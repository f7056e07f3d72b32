"""One-off converter: synthetic records of the first format (one flat JSON per run, learned
matrices as a torch pickle) to the runner's records (full config as identity, safetensors).

    python -m urpe.experiments.synthetic.migrate results/synthetic [more folders ...]

The old records name most settings (task, variant, vocabulary, length, steps, batch, lr,
warm-up, layers, width, heads, held-out size); the rest were the quick preset's and are
checked rather than assumed: the feed-forward width is the one whose model has the parameter
count the record states, and a record no candidate fits is left as it is and named. Precision
was 32-true (every one of these runs was on a CPU). The old runs drew their training batches
from a per-process stream, so their configs carry `data.stream = "per-process/0"`: `--resume`
never takes them for runs of the current stream, and a report mixing both shows them apart.

The matrices file is read with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch

from ...files import CorruptFileError, atomic_write, atomic_write_json, read_json
from ..runner import RECORD_FORMAT, RunSpec
from .experiment import run_config, run_name
from .presets import PRESETS

OLD_STREAM = "per-process/0"
# The preset fields an old record states (the rest were the quick preset's).
RECORDED = "seq_len steps batch_size lr warmup num_layers dim num_heads eval_sequences".split()


def _param_count(config: dict) -> int:
    from ...training.models import EncoderTokenClassifier

    model = EncoderTokenClassifier.from_model_config(config["model"])
    return sum(p.numel() for p in model.parameters())


def convert(old: dict) -> tuple[RunSpec, dict]:
    """The new (spec, record) of an old record; ValueError if a setting cannot be recovered."""
    base = PRESETS["quick"]
    for ffn_dim in dict.fromkeys((base.ffn_dim, 4 * old["dim"])):
        preset = replace(base, ffn_dim=ffn_dim, **{name: old[name] for name in RECORDED})
        config = run_config(
            old["task"],
            old["variant"],
            old["vocab_size"],
            old["seed"],
            preset,
            "32-true",
            stream=OLD_STREAM,
        )
        if _param_count(config) == old["params"]:
            break
    else:
        raise ValueError(f"no feed-forward width gives the recorded {old['params']} parameters")
    spec = RunSpec(
        run_name(old["task"], old["variant"], old["vocab_size"], old["seed"], preset),
        config,
        old["steps"],
    )
    record = {
        "format": RECORD_FORMAT,
        "id": spec.id,
        "name": spec.name,
        "config": config,
        "result": {k: old[k] for k in ("accuracy", "loss", "chance", "params")},
        "execution": {"torch_threads": old.get("threads"), "accelerator": "cpu"},
        "seconds": old["seconds"],
        "migrated_from": f"{old['run']}.json (urpe-record/1)",
    }
    return spec, record


def migrate(directory: Path) -> tuple[int, list[str]]:
    """Convert every old record in directory/records; returns (converted, problems)."""
    from safetensors.torch import save_file

    records = directory / "records"
    converted, problems = 0, []
    for path in sorted(records.glob("*.json")):
        try:
            old = read_json(path)
        except CorruptFileError as error:
            problems.append(str(error))
            continue
        if not isinstance(old, dict) or "format" in old:
            continue  # already new
        try:
            spec, record = convert(old)
        except (KeyError, ValueError) as error:
            problems.append(f"{path}: not converted ({error})")
            continue
        matrices_path = path.with_suffix(".pt")
        if matrices_path.exists():
            matrices = torch.load(matrices_path, map_location="cpu", weights_only=True)
            tensors = {k: v.contiguous() for k, v in matrices.items() if v is not None}
            if tensors:
                target = records / f"{spec.id}.safetensors"
                atomic_write(target, lambda p, t=tensors: save_file(t, str(p)))
        atomic_write_json(records / f"{spec.id}.json", record)
        path.unlink()
        matrices_path.unlink(missing_ok=True)
        converted += 1
    return converted, problems


def main(argv: list[str] | None = None) -> int:
    folders = [Path(a) for a in (sys.argv[1:] if argv is None else argv)]
    if not folders:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    failed = 0
    for folder in folders:
        converted, problems = migrate(folder)
        print(f"{folder}: {converted} records converted")
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        failed += len(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
