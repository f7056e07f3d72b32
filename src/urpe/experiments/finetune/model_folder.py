"""The model folder a fine-tune starts from: checked, fingerprinted, loaded, and wrapped so that
urpe's causal-LM objective and evaluations (`urpe.training.lm`) can drive it.

A folder is anything `save_pretrained` wrote: config.json plus weights (safetensors or
pytorch_model.bin, single or sharded). Nothing is ever downloaded (`local_files_only`). Its
identity in a run's config is a SHA-256 over the name and bytes of every regular file at its top
level (weights, config, tokenizer files), so a changed model is a new run even at the same path.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

WEIGHT_SUFFIXES = (".safetensors", ".bin")


class ModelFolderError(ValueError):
    """A folder that cannot be fine-tuned; the message is one line naming the folder."""


def folder_digest(path: Path) -> str:
    """SHA-256 over (name, size, bytes) of every top-level regular file, in name order."""
    digest = hashlib.sha256()
    for file in sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith(".")):
        digest.update(f"{file.name}\0{file.stat().st_size}\0".encode())
        with open(file, "rb") as handle:
            while block := handle.read(1 << 22):
                digest.update(block)
    return digest.hexdigest()


def read_config(path: Path):
    """The folder's transformers config, checked to name a causal LM; ModelFolderError if not."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not path.exists():
        raise ModelFolderError(f"{path}: no such folder")
    if not path.is_dir():
        raise ModelFolderError(f"{path} is not a folder: give a folder written by save_pretrained")
    if not (path / "config.json").is_file():
        raise ModelFolderError(
            f"{path} has no config.json: give a folder written by "
            "save_pretrained (config.json and weights)"
        )
    if not any(p.suffix in WEIGHT_SUFFIXES for p in path.iterdir() if p.is_file()):
        raise ModelFolderError(
            f"{path} has config.json but no weights (*.safetensors or pytorch_model.bin)"
        )
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelFolderError(
            f"{path}/config.json cannot be read by transformers: {first}"
        ) from None
    if type(config) not in AutoModelForCausalLM._model_mapping:
        raise ModelFolderError(
            f"{path} holds a {type(config).__name__} model, which has no causal-LM class in "
            "transformers (AutoModelForCausalLM)"
        )
    if getattr(config, "urpe", None) is not None:
        raise ModelFolderError(
            f"{path} already carries URPE gates (config.json has 'urpe'); "
            "give the folder of the model without them"
        )
    return config


def context_limit(config) -> int | None:
    """The longest input the model's position scheme was built for, if the config names one."""
    for name in ("n_positions", "max_position_embeddings"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


@contextmanager
def _transformers_quiet():
    """No warnings of transformers' own while a model is built only to be inspected (BERT's
    "add is_decoder=True" would reach the user beside the one-line error)."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def bidirectional(model: nn.Module) -> bool:
    """True for an encoder loaded as a causal LM: a config with is_decoder=False that its layers
    read (BERT, RoBERTa, ELECTRA, ... then build BertLMHeadModel & co. with full attention).
    GPT-NeoX and others carry is_decoder=False in their configs too but never read it: causal."""
    text = model.config.get_text_config()
    if getattr(text, "is_decoder", None) is not False:
        return False
    return any(getattr(m, "is_decoder", None) is False for m in model.modules())


def check_model(config, gated: bool, path: Path | None = None) -> None:
    """ModelFolderError when the folder's causal-LM class would see the tokens it predicts;
    with `gated`, UnsupportedModelError (naming the class and why) when add_urpe cannot gate it.
    The model is built on the meta device, so no memory is spent on its weights."""
    from transformers import AutoModelForCausalLM

    from ...hf.discovery import select_layers

    with torch.device("meta"), _transformers_quiet():
        model = AutoModelForCausalLM.from_config(config)
    if bidirectional(model):
        where = f"{path} holds" if path is not None else "this is"
        raise ModelFolderError(
            f"{where} a {type(config).__name__} encoder (is_decoder=False): as "
            f"{type(model).__name__} it would attend to the tokens it predicts; give a causal LM "
            "folder (a decoder trained left to right: GPT-2, Llama, ...)"
        )
    if gated:
        select_layers(model, None)


def position_table_limit(model: nn.Module) -> int | None:
    """The longest context a model with a table of absolute positions beside its token
    embeddings can run (GPT-2's wpe, OPT's embed_positions, BERT's position_embeddings, Marian's
    sinusoids: one row per position); None for schemes that take any length (RoPE, ALiBi, T5)."""
    weight = model.get_input_embeddings().weight
    tables = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    # Where token embeddings sit (BART's decoder shares the model's): positions sit beside them.
    beside = {n.rpartition(".")[0] for n, m in tables if m.weight is weight}
    for name, module in tables:
        where, _, last = name.rpartition(".")
        if where in beside and module.weight is not weight and ("pos" in last or last == "wpe"):
            return context_limit(model.config.get_text_config()) or module.num_embeddings
    return None


def load_model(path: str | Path, urpe_options: dict | None) -> nn.Module:
    """The folder's causal LM in float32 on "sdpa" attention, with `add_urpe(**urpe_options)`
    applied unless that is None."""
    from transformers import AutoModelForCausalLM

    import urpe.hf

    model = AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, dtype=torch.float32, attn_implementation="sdpa"
    )
    if urpe_options is not None:
        model = urpe.hf.add_urpe(model, **urpe_options)
    return model


class HuggingFaceLM(nn.Module):
    """A transformers causal LM behind urpe's language-model interface
    (`model(tokens, memory, use_memory) -> (logits, memory)`, no memory), so `CausalLM`,
    `urpe.training.lm.evaluate` and urpe's checkpoints work with it unchanged.

    pack: feed a (B, L) batch as one row of B * L tokens made by transformers'
    `DataCollatorWithFlattening` (position ids restarting at 0 with every window); urpe.hf keeps
    each window to itself, so the logits are those of B separate rows."""

    memory_length = 0

    def __init__(self, model: nn.Module, segment_length: int, pack: bool = False):
        super().__init__()
        self.model, self.segment_length, self.pack = model, segment_length, pack

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    def forward(self, tokens: Tensor, memory=None, use_memory: bool = False):
        if not self.pack or tokens.shape[0] == 1:
            return self.model(input_ids=tokens).logits, None  # (B, L, V)
        from transformers import DataCollatorWithFlattening

        from ...hf.attention import base_of

        rows = DataCollatorWithFlattening(return_tensors="pt")(
            [{"input_ids": row} for row in tokens]
        )
        packed = {k: rows[k].to(tokens.device) for k in ("input_ids", "position_ids")}  # (1, B L)
        if base_of(self.model.config._attn_implementation) is None:
            # Without urpe.hf only transformers' own mask keeps the windows apart, and it reads
            # restarting position ids only when the model makes no cache.
            packed["use_cache"] = False
        logits = self.model(**packed).logits  # (1, B L, V)
        return logits.reshape(*tokens.shape, -1), None  # (B, L, V)

    def model_config(self) -> dict[str, Any]:
        """The transformers config (with its `urpe` entry) as JSON: a checkpoint rebuilds the
        architecture from it, with no reference to the folder it came from."""
        return {
            "hf_config": json.loads(self.model.config.to_json_string(use_diff=False)),
            "segment_length": self.segment_length,
            "pack": self.pack,
        }

    @classmethod
    def from_model_config(cls, config: dict[str, Any]) -> HuggingFaceLM:
        from transformers import AutoConfig, AutoModelForCausalLM

        from ...hf.discovery import select_layers
        from ...hf.options import UrpeOptions
        from ...hf.patch import attach

        entry = dict(config["hf_config"])
        hf_config = AutoConfig.for_model(entry.pop("model_type"), **entry)
        gates = getattr(hf_config, "urpe", None)
        hf_config.urpe = None
        model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")
        if gates is not None:
            options = UrpeOptions.from_dict(gates)
            attach(model, options, select_layers(model, options.layers)[0])
        return cls(model, config["segment_length"], config.get("pack", False))
