"""What a trained synthetic model does inside: its attention weights and where it keeps position.

`python -m urpe.experiments.synthetic.inspect OUT/runs/<run id> ...` loads each run's final
checkpoint, runs held-out sequences of its task through it and prints (and with --json writes),
per layer:

- per head, the gated attention weights a_ij = softmax(q_i k_j / sqrt(d) + b(j-i)) c(j-i),
  averaged over the sequences: how sharp they are (the mean over queries of the largest weight;
  uniform attention gives 1/L), the range of the row sums sum_j a_ij (all 1 without a gate: the
  row-sum signal is how URPE's C writes position into the output), and for `etp` the mean weight
  that query k < L/2 puts on the key it must copy, 2k + 1;
- how well position can be read from the hidden states after the layer (`position_probe`), with
  random tokens and with each sequence's first token repeated (Su's probe input);
- for the first layer, per head, how much the value vectors of all tokens share
  (`value_agreement`): the only way URPE's gate writes position is the row sum r_i times the
  value vector all tokens have in common, so that is the strength of its position code.

With --curves PNG it only plots the runs' learning curves from their logs.

The weights come from the model's own attention call (the encoding's `attend`, any backend) with
the identity as values: A @ I = A, so no formula is re-derived here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

PROG = "python -m urpe.experiments.synthetic.inspect"


def _forward_with_hooks(model: torch.nn.Module, tokens: Tensor, handles: list) -> None:
    """One forward pass in eval mode for the hooks behind `handles` to see; removes them and
    gives the model its mode back, also when the pass fails."""
    was_training = model.training
    model.eval()
    try:
        model(tokens)
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)


@torch.no_grad()
def attention_weights(model: torch.nn.Module, tokens: Tensor) -> list[Tensor]:
    """tokens (B, L) -> per attention layer the weights (B, H, n, n) after the gate (n: L plus
    marker tokens), as the layer computed them. `model` is an `EncoderTokenClassifier` (or
    anything with `.encoder.layers[i].mixer`); layers whose mixer is not attention are skipped."""
    from ...nn import AttentionContext, MultiheadAttention

    captured: list[tuple[MultiheadAttention, Tensor, dict]] = []

    def hook(module, args, kwargs, output):
        captured.append((module, args[0], kwargs))

    _forward_with_hooks(
        model,
        tokens,
        [
            layer.mixer.register_forward_hook(hook, with_kwargs=True)
            for layer in model.encoder.layers
            if isinstance(layer.mixer, MultiheadAttention)
        ],
    )
    out = []
    for mixer, x, kwargs in captured:
        b, n, _ = x.shape
        context = kwargs.get("context") or AttentionContext()  # the model's, for this pass
        positions = context.positions_for(n, n, b, x.device)
        q = mixer.position.rotate(mixer._heads(mixer.q_proj(x)), positions.query)  # (B, H, n, hd)
        k = mixer.position.rotate(mixer._heads(mixer.k_proj(x)), positions.key)  # (B, H, n, hd)
        identity = torch.eye(n, dtype=x.dtype, device=x.device).expand(b, mixer.num_heads, n, n)
        gate = context.gate
        if gate is None and mixer.gate is not None:
            gate = mixer.gate(positions)
        extra = {
            k: getattr(context, k) for k in ("bias", "attn_mask") if getattr(context, k) is not None
        }
        weights = mixer.position.attend(
            q,
            k,
            identity,
            positions=positions,
            scale=mixer.head_dim**-0.5,
            gate=gate,
            key_padding_mask=context.key_padding_mask,
            normalization=mixer.normalization,
            backend=mixer.backend,
            **extra,
        )  # (B, H, n, n): row i is query i's weights over the keys
        out.append(weights)
    return out


@torch.no_grad()
def hidden_states(model: torch.nn.Module, tokens: Tensor) -> list[Tensor]:
    """tokens (B, L) -> the output (B, n, E) of every encoder layer, first to last."""
    states: list[Tensor] = []
    _forward_with_hooks(
        model,
        tokens,
        [
            layer.register_forward_hook(lambda m, a, o: states.append(o))
            for layer in model.encoder.layers
        ],
    )
    return states


def position_probe(states: Tensor, ridge: float = 1e-2) -> dict[str, float]:
    """How well position can be read from the states (B, n, E) by a linear map, fitted on the
    first half of the sequences and scored on the second half:

    - "r2": R^2 of a ridge regression onto the position index i (1: a linear read-out recovers i
      exactly; 0 or below: no linearly readable position). A monotone but curved scalar code
      scores below 1 without noise.
    - "exact": accuracy of a linear classifier over the n positions (linear discriminant
      analysis: class means, one shared within-position covariance, ridge-regularised); 1/n when
      the states carry no position, 1 when every position is told apart from every other,
      whether the code is one direction per position or a clean scalar. This is the precision
      a head must have to read key 2k + 1 and not its neighbours.
    """
    b, n, e = states.shape
    if b < 2:
        raise ValueError("the probe needs at least 2 sequences (one to fit, one to score)")
    x = states.double()
    fit, score = x[: b // 2], x[b // 2 :]
    index = torch.arange(n, dtype=torch.float64)
    # R^2 of the position index. (B/2 * n, E + 1): the constant column is the intercept.
    design = torch.cat([fit.reshape(-1, e), torch.ones(fit.shape[0] * n, 1).double()], dim=-1)
    gram = design.T @ design + ridge * design.shape[0] * torch.eye(e + 1, dtype=torch.float64)
    coef = torch.linalg.solve(gram, design.T @ index.repeat(fit.shape[0]))  # (E + 1,)
    predicted = score @ coef[:e] + coef[e]  # (B/2, n)
    r2 = 1.0 - (((predicted - index) ** 2).mean() / index.var(unbiased=False)).item()
    # Linear discriminant analysis over positions.
    means = fit.mean(0)  # (n, E): one mean state per position
    centred = (fit - means).reshape(-1, e)
    covariance = centred.T @ centred / centred.shape[0]  # (E, E) shared within positions
    scale = covariance.diagonal().mean().clamp_min(1e-12)
    covariance = covariance + ridge * scale * torch.eye(e, dtype=torch.float64)
    projected = torch.linalg.solve(covariance, means.T)  # (E, n): Sigma^-1 mu_i
    logits = score @ projected - 0.5 * (means * projected.T).sum(-1)  # (B/2, n, n)
    exact = (logits.argmax(-1) == torch.arange(n)).double().mean().item()
    return {"r2": round(r2, 3), "exact": round(exact, 3)}


@torch.no_grad()
def value_agreement(model: torch.nn.Module, tokens: Tensor, ridge: float = 1e-6) -> list[float]:
    """Per head of the first attention layer: m^T (S + ridge * tr(S)/d * I)^-1 m, where m is the
    mean value vector over the tokens' occurrences in `tokens` (B, L) and S their covariance.

    With gated, near-uniform attention the head's output at query i is about r_i m plus a
    token mixture of covariance ~S / L (r_i: the row sum of the gated weights). Along the best
    direction u the position part (u.m)^2 stands this many times above the token spread u^T S u,
    so this is the square of the best signal-to-noise ratio of the row-sum code before any
    training of later layers. It is very large when the centred values leave a direction free
    (at most V - 1 of them: small vocabularies), and small when the tokens' values fill the head
    and barely share a component.
    """
    from ...nn import MultiheadAttention

    first = next(
        layer.mixer for layer in model.encoder.layers if isinstance(layer.mixer, MultiheadAttention)
    )
    inputs: list[Tensor] = []
    hook = first.register_forward_hook(lambda m, a, o: inputs.append(a[0]))
    _forward_with_hooks(model, tokens, [hook])
    values = first._heads(first.v_proj(inputs[0])).double()  # (B, H, n, hd)
    values = values.transpose(0, 1).flatten(1, 2)  # (H, B * n, hd): one row per occurrence
    mean = values.mean(1, keepdim=True)  # (H, 1, hd)
    centred = values - mean
    covariance = centred.transpose(1, 2) @ centred / values.shape[1]  # (H, hd, hd)
    d = covariance.shape[-1]
    scale = covariance.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(1e-30)  # (H,)
    eye = torch.eye(d, dtype=torch.float64, device=values.device)
    regularised = covariance + ridge * scale[:, None, None] * eye
    solved = torch.linalg.solve(regularised, mean.transpose(1, 2))  # (H, hd, 1)
    agreement = (mean @ solved).flatten()  # (H,)
    return [float(f"{a:.3g}") for a in agreement.tolist()]


def summarise(weights: list[Tensor], task: str, length: int) -> list[dict[str, Any]]:
    """Per layer, per head: sharpness, row-sum range and (etp) the weight on key 2k + 1."""
    layers = []
    for index, w in enumerate(weights):
        mean = w.double().mean(0)  # (H, n, n)
        heads = []
        for h in range(mean.shape[0]):
            rows = mean[h].sum(-1)  # (n,)
            entry = {
                "max_weight": round(mean[h].max(-1).values.mean().item(), 3),
                "row_sum_min": round(rows.min().item(), 3),
                "row_sum_max": round(rows.max().item(), 3),
            }
            if task == "etp" and mean.shape[-1] == length:
                k = torch.arange(length // 2)
                entry["weight_on_2k+1"] = round(mean[h, k, 2 * k + 1].mean().item(), 3)
            heads.append(entry)
        layers.append({"layer": index, "heads": heads})
    return layers


def inspect_run(run_dir: Path, sequences: int = 256, seed: int = 12345) -> dict[str, Any]:
    """Load the checkpoint at `run_dir` (a run folder: its latest; or one `step-N` folder) and
    measure its attention, position probes and the shared value component."""
    from ...tasks import get_task
    from ...training.checkpoint import load_module, read_checkpoint_config, resolve_checkpoint

    directory = resolve_checkpoint(run_dir)
    config = read_checkpoint_config(directory)
    run = config.get("run") or {}
    model = load_module(directory, config=config)  # a synthetic model reads tensors: no bundle
    task, length, vocab = run["task"], run["seq_len"], run["vocab_size"]
    generator = torch.Generator().manual_seed(seed)
    tokens, targets = get_task(task)(sequences, length, vocab, generator)
    with torch.no_grad():
        accuracy = (model(tokens).argmax(-1) == targets).double().mean().item()
    # Uniform random tokens (the input of pi and etp, whatever the run's task; the probe task's
    # own input is one token repeated, which would make the value statistics degenerate).
    random = torch.randint(0, vocab, (sequences, length), generator=generator)  # (B, L)
    # Su's probe input: each sequence repeats its own first token. One token for all sequences
    # would make every sequence the same, so that float rounding differences between positions
    # (which RPE has, at 1e-7) would be told apart perfectly by the linear classifier.
    repeated = random[:, :1].expand_as(random).contiguous()  # (B, L)
    return {
        "run": run_dir.name,
        "task": task,
        "variant": run.get("variant"),
        "vocab_size": vocab,
        "seq_len": length,
        "accuracy": round(accuracy, 4),
        "position_probe_random": [position_probe(s) for s in hidden_states(model, random)],
        "position_probe_repeated": [position_probe(s) for s in hidden_states(model, repeated)],
        "value_agreement": value_agreement(model, random),
        "layers": summarise(attention_weights(model, tokens), task, length),
    }


def _print(result: dict[str, Any]) -> None:
    print(f"{result['run']}: accuracy {result['accuracy']:.3f}")
    for inputs in ("random", "repeated"):
        probes = result[f"position_probe_{inputs}"]
        print(
            f"  position after each layer ({inputs} tokens): R^2 "
            + " / ".join(f"{p['r2']:.2f}" for p in probes)
            + ", linear classifier "
            + " / ".join(f"{p['exact']:.2f}" for p in probes)
        )
    print(
        "  shared value component of the first layer's heads (signal/noise squared): "
        + ", ".join(f"{a:.3g}" for a in result["value_agreement"])
    )
    for layer in result["layers"]:
        for h, head in enumerate(layer["heads"]):
            extra = (
                f", weight on 2k+1 {head['weight_on_2k+1']:.2f}" if "weight_on_2k+1" in head else ""
            )
            print(
                f"  layer {layer['layer']} head {h}: max weight {head['max_weight']:.3f}, "
                f"row sums {head['row_sum_min']:.2f}..{head['row_sum_max']:.2f}{extra}"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="attention weights and position probes of trained synthetic runs "
        "(OUT/runs/<run id> folders of `urpe reproduce synthetic`)",
    )
    parser.add_argument(
        "runs",
        nargs="+",
        type=Path,
        help="run folders holding checkpoints/ (the latest is read), or "
        "checkpoint folders (checkpoints/step-N)",
    )
    parser.add_argument(
        "--sequences", type=int, default=256, help="held-out sequences per model (default: 256)"
    )
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    parser.add_argument(
        "--curves",
        type=Path,
        metavar="PNG",
        help="only plot the runs' learning curves (from their logs) to this file",
    )
    parser.add_argument("--title", default="", help="title of the --curves plot")
    parser.add_argument(
        "--labels",
        help="comma-separated legend labels of the --curves plot, one per run "
        "(default: the run names, which do not show width or learning rate)",
    )
    args = parser.parse_args(argv)
    from ...training.checkpoint import CheckpointError

    if args.curves is not None:
        from .plots import learning_curves_chart

        missing = [str(r) for r in args.runs if not (r / "logs" / "metrics.csv").is_file()]
        if missing:
            print(f"{PROG}: error: no logs/metrics.csv in {', '.join(missing)}", file=sys.stderr)
            return 2
        labels = None if args.labels is None else [x.strip() for x in args.labels.split(",")]
        if labels is not None and len(labels) != len(args.runs):
            print(
                f"{PROG}: error: --labels has {len(labels)} labels for {len(args.runs)} runs",
                file=sys.stderr,
            )
            return 2
        args.curves.parent.mkdir(parents=True, exist_ok=True)
        learning_curves_chart(args.runs, args.curves, args.title, labels)
        print(f"wrote {args.curves}")
        return 0
    if args.sequences < 2:
        print(f"{PROG}: error: --sequences must be >= 2", file=sys.stderr)
        return 2
    results = []
    for run_dir in args.runs:
        try:
            results.append(inspect_run(run_dir, args.sequences))
        except (KeyError, ValueError, OSError, CheckpointError) as error:
            print(f"{PROG}: error: {run_dir}: {error}", file=sys.stderr)
            return 2
        _print(results[-1])
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
