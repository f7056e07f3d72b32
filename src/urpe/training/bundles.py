"""Trained models that carry their input encoding: text in, text out; SMILES in, numbers out.

`load_model` returns one of these when the checkpoint says how raw inputs become the model's:

    lm = load_model("runs/lm/runs/<id>")           # TextModel: the LanguageModel + its tokenizer
    lm.generate("ROMEO:", max_new_tokens=50)       # -> the continuation, a str
    lm.generate(ids)                               # ids (P,) or a list -> str; (B, P) -> B strs
    lm.score(open("other.txt").read())             # -> {"loss", "tokens", "bpc" or "perplexity"}

    gm = load_model("runs/graph/runs/<id>")        # MoleculeModel: Graphormer + featurisation
    gm.predict(["CCO", "c1ccccc1"])                # -> [float, float] in the target's units

A bundle's `.model` is the `nn.Module` and its `.inputs` the encoding (`urpe.training.inputs`:
`TextInputs`, `MoleculeInputs`); calling the bundle calls the module, and any other attribute is
the module's (`bundle.parameters()`, `bundle.config`), so code written for the bare module keeps
working. `save_model(bundle, path)` writes it back with its encoding.

Which bundle a checkpoint becomes is what its config.json records under "inputs" (written by
every training run and by `save_model`; older checkpoints' are read by `inputs.input_record`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .checkpoint import load_module, read_checkpoint_config, resolve_checkpoint, save_model
from .inputs import InputEncoding, MoleculeInputs, TextInputs, read_inputs

PREDICT_BATCH = 256

# A prompt: text, or token ids as a (P,) or (B, P) tensor, a list, or a list of lists.
Prompt = str | torch.Tensor | Sequence[int] | Sequence[Sequence[int]]


class _Bundle:
    """Passes calls and unknown attributes on to `self.model`."""

    model: nn.Module
    inputs: InputEncoding  # how raw data becomes the model's input

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

    def save(self, path: str | Path, run: dict[str, Any] | None = None) -> Path:
        """`save_model(self, path)`: the module, its encoding (and tokenizer)."""
        return save_model(self, path, run=run)


class TextModel(_Bundle):
    """A `LanguageModel` with its tokenizer; `metric` ("bpc" or "perplexity") is how its
    losses are reported (bits per token for character or byte tokens)."""

    def __init__(self, model: nn.Module, tokenizer: Any, metric: str | None = None):
        self.model, self.inputs = model, TextInputs(tokenizer, metric)

    @property
    def tokenizer(self) -> Any:
        return self.inputs.tokenizer

    @property
    def metric(self) -> str:
        return self.inputs.metric

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
        equally long lists (or 1-D tensors) of ints. TypeError for anything else (a number,
        None); ValueError naming what is wrong with ids."""
        if isinstance(prompt, str):
            return self.encode_prompt(prompt)[None, :], False
        if not isinstance(prompt, torch.Tensor | Sequence):
            raise TypeError(
                "a prompt is text (a str) or token ids: a (P,) or (B, P) integer tensor, a list "
                f"of ints, or a list of equally long lists of ints; got {type(prompt).__name__}"
            )
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
        yield from self.model.generate(
            ids,
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            generator=generator,
            use_cache=use_cache,
        )

    def tokens(self, prompt: Prompt, max_new_tokens: int = 200, **sampling: Any) -> Iterator[int]:
        """Stream the ids of a continuation of one prompt, text or ids (see `prompt_ids` and
        `LanguageModel.generate`)."""
        ids, _ = self.prompt_ids(prompt)
        if ids.shape[0] != 1:
            raise ValueError(
                f"tokens() streams one prompt, got {ids.shape[0]}; generate() continues a batch"
            )
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
        from .lm_scoring import evaluate, report_metric

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
    """A Graphormer trained on molecules, with the featuriser its training data was made with
    (`urpe.data.molecules.MoleculeFeaturizer`: SMILES -> graph -> shortest paths) and its
    target's name and unit ("" where the data names none, as a user's file). Its normalisation
    (target mean and sd of the training set) is in the weights (`target_shift`,
    `target_scale`), so predictions come in the target's units."""

    def __init__(self, model: nn.Module, featurizer: Any, target: str, unit: str = ""):
        self.model, self.inputs = model, MoleculeInputs(featurizer, target, unit)

    @property
    def featurizer(self) -> Any:
        return self.inputs.featurizer

    @property
    def target(self) -> str:
        return self.inputs.target

    @property
    def unit(self) -> str:
        return self.inputs.unit

    @property
    def features(self) -> str:
        """The featurisation's name ("zinc", "rdkit")."""
        return self.featurizer.features

    @property
    def quantity(self) -> str:
        """The target with its unit where one is known: "gap (eV)", "logP"."""
        return f"{self.target} ({self.unit})" if self.unit else self.target

    @property
    def normalization(self) -> dict[str, float]:
        return {"mean": float(self.model.target_shift), "std": float(self.model.target_scale)}

    def graphs(self, smiles: Sequence[str]) -> list[Any]:
        """Each SMILES as the model's input graph, None where RDKit cannot read it."""
        return self.featurizer.graphs(smiles)

    @torch.no_grad()
    def predict(
        self,
        smiles: str | Sequence[str],
        batch_size: int = PREDICT_BATCH,
        progress: bool = False,
        label: str = "predict",
    ) -> list[float | None]:
        """Predicted target per SMILES, in the target's units; None for a SMILES RDKit cannot
        read. `label` names the progress bar (`urpe evaluate` shows "evaluate")."""
        from ..graph import collate_graphs
        from ..progress import progress_bar

        if isinstance(smiles, str):
            smiles = [smiles]
        graphs = self.featurizer.tensors(smiles)  # no PyTorch Geometric: seconds of start-up
        valid = [i for i, g in enumerate(graphs) if g is not None]
        out: list[float | None] = [None] * len(graphs)
        was_training = self.model.training
        self.model.eval()
        device = self.device
        for start in progress_bar(
            range(0, len(valid), batch_size), desc=label, unit="batch", enabled=progress
        ):
            chosen = valid[start : start + batch_size]
            batch = collate_graphs([graphs[i] for i in chosen]).to(device)
            for i, value in zip(chosen, self.model(batch).float().cpu().tolist(), strict=True):
                out[i] = value
        self.model.train(was_training)
        return out


def with_inputs(model: nn.Module, inputs: InputEncoding | None) -> Any:
    """The model in the bundle its encoding calls for; the model itself when it has none."""
    if isinstance(inputs, TextInputs):
        return TextModel(model, inputs.tokenizer, inputs.metric)
    if isinstance(inputs, MoleculeInputs):
        return MoleculeModel(model, inputs.featurizer, inputs.target, inputs.unit)
    return model


def load_model(
    path: str | Path, device: str | torch.device = "cpu", *, config: dict[str, Any] | None = None
) -> Any:
    """The trained model of a checkpoint, in eval mode: built from config.json, weights from
    model.safetensors (no pickle involved). `path`: see `checkpoint.resolve_checkpoint`; from a
    sweep folder of several runs it takes the one the commands take and says which in a warning.

    A model whose inputs need encoding comes as a bundle that carries it, as its config.json
    records: a language model with its tokenizer is a `TextModel` (`.generate("text")`,
    `.score(text)`), a Graphormer trained on molecules a `MoleculeModel` (`.predict(["CCO"])`,
    in the target's units); a bundle's `.model` is the module, and it passes calls and
    attributes on to it. Any other model comes as the module itself.

    `config`: the checkpoint's config.json as `read_checkpoint_config` returned it, where the
    caller has read it already (it is read once either way).

    >>> model = load_model("runs/synthetic/runs/pi-urpe-.../checkpoints")  # doctest: +SKIP
    """
    directory = resolve_checkpoint(path, say=_warn_of_choice)
    config = read_checkpoint_config(directory) if config is None else config
    module = load_module(directory, device, config=config)
    return with_inputs(module, read_inputs(config, directory))


def _warn_of_choice(note: str, runs: int) -> None:
    if runs > 1:
        warnings.warn(f"{note}; to load another, give its folder (runs/<id>)", stacklevel=4)
