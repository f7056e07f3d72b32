"""Trained models that carry their input encoding: text in, text out; SMILES in, numbers out.

`load_model` returns one of these when the checkpoint says how raw inputs become the model's:

    lm = load_model("runs/lm/runs/<id>")           # TextModel: the LanguageModel + its tokenizer
    lm.generate("ROMEO:", max_new_tokens=50)       # -> the continuation, a str
    lm.generate(ids)                               # ids (P,) or a list -> str; (B, P) -> B strs
    lm.score(open("other.txt").read())             # -> {"loss", "tokens", "bpc" or "perplexity"}

    gm = load_model("runs/graph/runs/<id>")        # MoleculeModel: Graphormer + featurisation
    gm.predict(["CCO", "c1ccccc1"])                # -> [float, float] in the target's units

A bundle's `.model` is the `nn.Module`; calling the bundle calls the module, and any other
attribute is the module's (`bundle.parameters()`, `bundle.config`), so code written for the bare
module keeps working. `save_model(bundle, path)` writes it back with its encoding.

What a checkpoint says about its inputs: config.json's "inputs" (written by `save_model`), else
the training run's own config ("run"): a graph run names its featurisation and target, an LM
run its metric, and its tokenizer sits in the run folder (two levels above `step-N`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

PREDICT_BATCH = 256

# A prompt: text, or token ids as a (P,) or (B, P) tensor, a list, or a list of lists.
Prompt = str | torch.Tensor | Sequence[int] | Sequence[Sequence[int]]


class _Bundle:
    """Passes calls and unknown attributes on to `self.model`."""

    model: nn.Module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name == "model":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.model, name)

    def to(self, *args: Any, **kwargs: Any) -> _Bundle:
        self.model.to(*args, **kwargs)
        return self

    def eval(self) -> _Bundle:
        self.model.eval()
        return self

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def checkpoint_inputs(self) -> dict[str, Any]:
        raise NotImplementedError

    def save(self, path: str | Path, run: dict[str, Any] | None = None) -> Path:
        """`save_model(self, path)`: the module, its encoding (and tokenizer)."""
        from .checkpoint import save_model

        return save_model(self, path, run=run)


class TextModel(_Bundle):
    """A `LanguageModel` with its tokenizer; `metric` ("bpc" or "perplexity") is how its
    losses are reported (bits per token for character or byte tokens)."""

    def __init__(self, model: nn.Module, tokenizer: Any, metric: str | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.metric = metric or ("bpc" if tokenizer.kind in ("char", "byte") else "perplexity")

    def checkpoint_inputs(self) -> dict[str, Any]:
        return {"kind": "text", "metric": self.metric}

    def encode_prompt(self, prompt: str) -> torch.Tensor:
        """The prompt as ids (P,); ValueError when it is empty or encodes to nothing."""
        if not prompt:
            raise ValueError("the prompt is empty; give at least one character")
        ids = self.tokenizer.encode_prompt(prompt)
        if ids.numel() == 0:
            raise ValueError("the prompt encodes to no tokens")
        return ids

    def prompt_ids(self, prompt: Prompt) -> tuple[torch.Tensor, bool]:
        """The prompt as ids (B, P), and whether it was given as a batch. Text is encoded
        (B = 1); ids come as a (P,) or (B, P) integer tensor, a list of ints, or a list of
        equally long lists (or 1-D tensors) of ints. ValueError naming what is wrong otherwise."""
        if isinstance(prompt, str):
            return self.encode_prompt(prompt)[None, :], False
        if not isinstance(prompt, torch.Tensor):
            rows = [row.tolist() if isinstance(row, torch.Tensor) else row for row in prompt]
            if rows and all(isinstance(row, str) for row in rows):
                raise ValueError("give one text at a time (a batch of prompts is given as ids)")
            if (
                rows
                and all(isinstance(row, Sequence) for row in rows)
                and len(set(map(len, rows))) > 1
            ):
                raise ValueError("the prompts of a batch must have the same length (no padding)")
            try:
                prompt = torch.tensor(rows) if rows else torch.zeros(0, dtype=torch.long)
            except (TypeError, ValueError, RuntimeError) as error:
                raise ValueError(f"prompt ids must be integers ({error})") from None
        if prompt.dim() not in (1, 2):
            raise ValueError(f"prompt ids must be (P,) or (B, P), got {tuple(prompt.shape)}")
        if prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool:
            raise ValueError(f"prompt ids must be an integer tensor, got {prompt.dtype}")
        if prompt.numel() == 0:
            raise ValueError(f"the prompt holds no tokens (shape {tuple(prompt.shape)})")
        vocab = self.model.vocab_size
        if int(prompt.min()) < 0 or int(prompt.max()) >= vocab:
            raise ValueError(f"token ids must lie in [0, {vocab})")
        batched = prompt.dim() == 2
        return (prompt if batched else prompt[None, :]).long(), batched

    def _draw(
        self,
        ids: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 0.8,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
        use_cache: bool = True,
    ) -> Iterator[torch.Tensor]:
        """Stream the next token of every row of ids (B, P), each step (B,)."""
        ids = ids.to(self.device)
        generator = torch.Generator(device=ids.device).manual_seed(seed)
        yield from self.model.generate(ids, max_new_tokens, temperature=temperature, top_k=top_k,
                                       top_p=top_p, generator=generator,
                                       use_cache=use_cache)  # fmt: skip

    def tokens(self, prompt: Prompt, max_new_tokens: int = 200, **sampling: Any) -> Iterator[int]:
        """Stream the ids of a continuation of one prompt, text or ids (see `prompt_ids` and
        `LanguageModel.generate`)."""
        ids, _ = self.prompt_ids(prompt)
        if ids.shape[0] != 1:
            raise ValueError(f"tokens() streams one prompt, got {ids.shape[0]}; generate() "
                             "continues a batch")  # fmt: skip
        for token in self._draw(ids, max_new_tokens, **sampling):
            yield int(token[0])

    def generate(self, prompt: Prompt, max_new_tokens: int = 200, **sampling: Any) -> Any:
        """The continuation of `prompt` as text (`join(prompt, continuation)` shows both).
        `prompt`: text, or ids (see `prompt_ids`); a batch (B, P) gives a list of B texts, its
        rows drawn together from one random stream (so with temperature > 0 a row's text may
        differ from that row generated alone). Keywords: temperature (0 = greedy), top_k,
        top_p, seed, use_cache."""
        ids, batched = self.prompt_ids(prompt)
        steps = list(self._draw(ids, max_new_tokens, **sampling))  # each (B,)
        drawn = torch.stack(steps, dim=1).tolist() if steps else [[] for _ in range(len(ids))]
        texts = [self.tokenizer.decode(row) for row in drawn]
        return texts if batched else texts[0]

    def join(self, prompt: str, continuation: str) -> str:
        return self.tokenizer.join(prompt, continuation)

    def score(
        self,
        text: str | bytes,
        *,
        context: int | None = None,
        mode: str = "sliding",
        batch_size: int = 8,
        progress: bool = False,
    ) -> dict[str, float]:
        """Mean next-token loss of `text` as `urpe reproduce lm` reports it: every target
        scored once, in windows of `context` tokens (default: the training segment length)
        advancing by half of it ("sliding"), or in consecutive chunks ("chunks"), or chunks
        with the trained memory carried across ("memory"). A byte-level model also takes
        bytes (a file in any encoding, as it trained). Returns {"loss" (nats per token),
        "tokens", <metric>}."""
        from .lm import evaluate, report_metric

        if mode not in ("sliding", "chunks", "memory"):
            raise ValueError(f"mode must be sliding, chunks or memory, got {mode!r}")
        ids = self.tokenizer.encode(text)
        if ids.numel() < 2:
            raise ValueError("the text has fewer than 2 tokens: nothing to score")
        context = context or self.model.segment_length
        result = evaluate(
            self.model,
            ids,
            context,
            mode="chunks" if mode == "memory" else mode,
            use_memory=mode == "memory",
            batch_size=batch_size,
            progress=progress,
        )
        return {**result, self.metric: report_metric(result["loss"], self.metric)}


class MoleculeModel(_Bundle):
    """A Graphormer trained on molecules, with the featurisation it was trained on and its
    target's name and unit ("" where the data names none, as a user's file). Its normalisation
    (target mean and sd of the training set) is in the weights (`target_shift`,
    `target_scale`), so predictions come in the target's units."""

    def __init__(
        self,
        model: nn.Module,
        features: str,
        target: str,
        unit: str = "",
        max_distance: int | None = None,
    ):
        self.model, self.features, self.target = model, features, target
        self.unit, self.max_distance = unit, max_distance

    def checkpoint_inputs(self) -> dict[str, Any]:
        return {
            "kind": "molecules",
            "features": self.features,
            "target": self.target,
            "unit": self.unit,
            "max_distance": self.max_distance,
        }

    @property
    def quantity(self) -> str:
        """The target with its unit where one is known: "gap (eV)", "logP"."""
        return f"{self.target} ({self.unit})" if self.unit else self.target

    @property
    def normalization(self) -> dict[str, float]:
        return {"mean": float(self.model.target_shift), "std": float(self.model.target_scale)}

    def graphs(self, smiles: Sequence[str]) -> list[Any]:
        """Each SMILES as the model's input graph, None where RDKit cannot read it."""
        from rdkit import rdBase

        from ..data.molecules.featurize import smiles_to_graph
        from ..graph.paths import ShortestPaths

        transform = ShortestPaths(max_distance=self.max_distance)
        out = []
        with rdBase.BlockLogs():
            for text in smiles:
                parsed = smiles_to_graph(text, self.features) if text else None
                out.append(None if parsed is None else transform(parsed[0]))
        return out

    @torch.no_grad()
    def predict(
        self, smiles: str | Sequence[str], batch_size: int = PREDICT_BATCH, progress: bool = False
    ) -> list[float | None]:
        """Predicted target per SMILES, in the target's units; None for a SMILES RDKit cannot
        read."""
        from torch_geometric.data import Batch

        from ..progress import progress_bar

        if isinstance(smiles, str):
            smiles = [smiles]
        graphs = self.graphs(smiles)
        valid = [i for i, g in enumerate(graphs) if g is not None]
        out: list[float | None] = [None] * len(graphs)
        was_training = self.model.training
        self.model.eval()
        device = self.device
        for start in progress_bar(
            range(0, len(valid), batch_size), desc="predict", unit="batch", enabled=progress
        ):
            chosen = valid[start : start + batch_size]
            batch = Batch.from_data_list([graphs[i] for i in chosen]).to(device)
            for i, value in zip(chosen, self.model(batch).float().cpu().tolist(), strict=True):
                out[i] = value
        self.model.train(was_training)
        return out


def molecule_unit(dataset: str, target: str) -> str:
    """The unit a graph run's target is in; "" for a user's file (its own, unnamed)."""
    if dataset.partition(":")[0] in ("csv", "sdf"):
        return ""
    from ..data.molecules.datasets import _unit

    return _unit(dataset, target)


def bundle(model: nn.Module, directory: Path, config: dict[str, Any]) -> Any:
    """The model with its input encoding attached, when the checkpoint has one (see the module
    docstring); the bare model otherwise."""
    inputs = dict(config.get("inputs") or {})
    run = config.get("run") or {}
    kind = inputs.get("kind") or {"lm": "text", "graph": "molecules"}.get(run.get("experiment"))
    if kind == "text":
        from ..data.text.errors import DatasetError
        from ..data.text.tokenizers import load_tokenizer

        try:
            tokenizer = load_tokenizer(directory)
        except DatasetError:
            return model  # a tokenizer can still be given to TextModel by hand
        return TextModel(model, tokenizer, inputs.get("metric") or run.get("metric"))
    if kind == "molecules":
        features = inputs.get("features") or run.get("data", {}).get("features", "zinc")
        target = inputs.get("target") or run.get("target", "target")
        unit = inputs.get("unit") or molecule_unit(run.get("dataset", ""), target)
        return MoleculeModel(model, features, target, unit, inputs.get("max_distance"))
    return model
