"""The causal language-modelling objective, its data stream and its evaluations.

- `SegmentStream`: Transformer-XL's contiguous batching as a step stream (`data.py`): the
  global batch of step t is segment t of `ContiguousBatches(train, B, L)`, so a resumed run
  continues at exactly the segment it would have seen, and row b of step t + 1 continues row b of
  step t (part p of the batch always holds the same rows). With a separator, the same rows as
  packed documents (document ids per row).
- `CausalLM`: loss = mean cross-entropy (nats) over scored next-token targets; reports it as
  bits per token (`loss / ln 2`: bits per character for character or byte tokens) or as
  perplexity (`exp(loss)`, word or subword tokens). With a memory model it carries each part's
  memory from step to step (dropped where the stream starts a new epoch) and saves it in every
  checkpoint, so a resumed run continues with exactly the memory it had. It also records the
  learning curve and the wall time of every update (throughput), in the checkpoint as well.
- `evaluate` (in `lm_scoring`, which needs no Lightning, for `urpe evaluate`): a whole token
  stream scored exactly once, in consecutive chunks of a given context length (with or without
  carried memory) or in sliding windows.

Under DDP each rank carries the memory of its own rows; checkpoints hold rank 0's, so an exact
resume with memory is guaranteed for single-process runs (the default on CPU).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor
from torchmetrics import MeanMetric

from ..data.text import ContiguousBatches
from ..data.text.documents import document_ends, packed_documents
from ..models.lm import LanguageModel
from .inputs import InputEncoding
from .lm_scoring import (
    evaluate,  # noqa: F401  (where callers have always found it)
    report_metric,
    token_losses,
)
from .objectives import Objective
from .optim import OptimConfig


class SegmentStream:
    """Step t's global batch = segment t of `ContiguousBatches(tokens, batch_size, L)` (endless,
    epoch after epoch); part p of P holds rows [p B / P, (p + 1) B / P) of every segment.

    separator: (k,) token ids that end a document (a blank line), or None. Given, the batches
    are packed documents (`urpe.data.text.documents`): they carry "document_ids" (B, L), and
    the target after each document's end is not scored."""

    def __init__(
        self, tokens: Tensor, batch_size: int, segment_length: int, separator: Tensor | None = None
    ):
        self.tokens, self.batch_size, self.segment_length = tokens, batch_size, segment_length
        self._batches: dict[int, dict[int, ContiguousBatches]] = {}
        ContiguousBatches(tokens, batch_size, segment_length)  # checks the sizes now
        self.ends = None if separator is None else document_ends(tokens, separator)  # (N,)

    def batch(self, step: int, part: int, parts: int) -> dict[str, Tensor]:
        per_layout = self._batches.setdefault(parts, {})
        if part not in per_layout:
            per_layout[part] = ContiguousBatches(
                self.tokens, self.batch_size, self.segment_length, rank=part, world_size=parts
            )
        segment = per_layout[part][step]
        batch = segment_batch(segment.inputs, segment.targets, segment.reset_memory, part)
        if self.ends is not None:
            stream = segment.offsets[:, None] + torch.arange(self.segment_length)  # (B, L)
            batch["document_ids"], batch["targets"] = packed_documents(
                self.ends[stream], segment.targets
            )
        return batch


def segment_batch(inputs: Tensor, targets: Tensor, reset: bool, part: int = 0) -> dict[str, Tensor]:
    """The dict a `CausalLM` step takes: inputs, targets (B, L); reset and part as 0-d tensors."""
    return {
        "inputs": inputs,
        "targets": targets,
        "reset": torch.tensor(bool(reset)),
        "part": torch.tensor(int(part)),
    }


def held_out_segments(tokens: Tensor, batch_size: int, segment_length: int) -> list[dict]:
    """A held-out stream as consecutive segments scoring every target once (validation)."""
    batches = ContiguousBatches(tokens, batch_size, segment_length, cover_all=True)
    return [segment_batch(s.inputs, s.targets, s.reset_memory) for s in batches]


class CausalLM(Objective):
    """Next-token cross-entropy for a `LanguageModel` on `SegmentStream` batches.

    metric: "bpc" or "perplexity" (how losses are reported besides nats). Logs train/loss and
    val/loss (nats per token) and val/<metric>.

    context_parallel: N > 1 processes share each row (context parallelism,
    `urpe.distributed`): consecutive ranks form groups of N (a (dp, cp) mesh made when training
    starts), each rank runs its shard of every row, and its loss is its share of the mean over
    the whole batch, total_r W / (tokens of all W ranks' rows), so that the usual mean of the
    gradients over all ranks (DDP) is exactly the one-process gradient (the other ranks' queries
    reach this rank's keys through the ring: every rank's gradient is a part of the whole), and
    train/loss is that mean, the one-process value, on every rank.
    """

    def __init__(
        self,
        model: LanguageModel,
        optim: OptimConfig,
        metric: str = "bpc",
        run: dict | None = None,
        inputs: InputEncoding | None = None,
        context_parallel: int = 1,
    ):
        super().__init__(model, optim, run, inputs)
        report_metric(1.0, metric)  # checks the name
        if context_parallel > 1 and model.memory_length > 0:
            raise ValueError("context parallelism carries no segment memory (memory_length=0)")
        self.context_parallel = context_parallel
        self._cp = None  # the ContextParallel group, made when training starts
        self.metric = metric
        self.val_loss = MeanMetric()
        self._memory: dict[int, list[Tensor]] = {}
        self._val_memory: list[Tensor] | None = None
        self.curve: dict[str, list[list[float]]] = {"train": [], "val": []}
        self.step_seconds: list[float] = []
        self._window: list[float] = []
        self._started: float | None = None

    def forward(self, tokens: Tensor, memory: list[Tensor] | None = None):
        return self.model(tokens, memory)

    def setup(self, stage: str) -> None:
        if self.context_parallel > 1 and self._cp is None:
            from ..distributed import context_parallel_mesh

            # the strategy's device: the module itself moves there only after `setup`
            device = self.trainer.strategy.root_device.type
            self._cp = context_parallel_mesh(self.context_parallel, device_type=device).cp

    def _split(self, batch: dict[str, Tensor]) -> bool:
        """Whether this batch runs context-parallel: rows that split into the layout's chunks
        (a short last held-out segment runs whole on every rank instead)."""
        if self._cp is None:
            return False
        chunks = self._cp.size * (2 if self._cp.layout == "zigzag" else 1)
        return batch["inputs"].shape[1] % chunks == 0

    def _step(self, batch: dict[str, Tensor], memory: list[Tensor] | None):
        if bool(batch["reset"]):
            memory = None
        # Only packed batches carry document ids (not every model takes them).
        packed = {k: batch[k] for k in ("document_ids",) if k in batch}
        inputs, targets = batch["inputs"], batch["targets"]
        if self._split(batch):  # this rank's shard of every row
            cp = self._cp
            packed = {k: cp.shard(v) for k, v in packed.items()}
            inputs, targets = cp.shard(inputs), cp.shard(targets)
            packed["context_parallel"] = cp
        logits, memory = self.model(inputs, memory, **packed)
        total, count = token_losses(logits, targets)
        return total, count, memory

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        part = int(batch["part"])
        total, count, memory = self._step(batch, self._memory.get(part))
        if memory is not None:
            self._memory[part] = memory
        loss = total / count.clamp(min=1)
        reported = loss.detach()
        if self._split(batch):  # this rank's share of the mean over every rank's rows
            import torch.distributed as dist

            sums = torch.stack([total.detach(), count.to(total.dtype)])
            dist.all_reduce(sums)  # over all ranks: DDP's mean of the gradients is over them
            loss = total * dist.get_world_size() / sums[1].clamp(min=1)
            reported = sums[0] / sums[1].clamp(min=1)
        self.log("train/loss", reported, prog_bar=True)
        self._window.append(float(reported))
        return loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._started = time.perf_counter()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._started is not None:
            self.step_seconds.append(time.perf_counter() - self._started)
        step = self.trainer.global_step
        log_every = self.trainer.log_every_n_steps or 1
        if self._window and (step % log_every == 0 or step == self.trainer.max_steps):
            self.curve["train"].append([float(step), sum(self._window) / len(self._window)])
            self._window = []

    def on_validation_epoch_start(self) -> None:
        self._val_memory = None

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        total, count, self._val_memory = self._step(batch, self._val_memory)
        self.val_loss.update(total / count.clamp(min=1), weight=count)
        self.log("val/loss", self.val_loss, on_step=False, on_epoch=True, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking or self.trainer.state.fn != "fit":
            return
        loss = float(self.val_loss.compute())
        self.log(f"val/{self.metric}", report_metric(loss, self.metric))
        self.curve["val"].append([float(self.trainer.global_step), loss])

    # Memory, curves and step times travel in training_state.pt (plain tensors and lists).
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["lm_state"] = {
            "memory": {str(p): [m.detach().cpu() for m in mem] for p, mem in self._memory.items()},
            "curve": self.curve,
            "step_seconds": list(self.step_seconds),
            "window": list(self._window),
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("lm_state") or {}
        device = next(self.model.parameters()).device
        self._memory = {
            int(p): [m.to(device) for m in mem] for p, mem in state.get("memory", {}).items()
        }
        self.curve = {k: [list(v) for v in rows] for k, rows in state.get("curve", {}).items()}
        self.curve.setdefault("train", [])
        self.curve.setdefault("val", [])
        self.step_seconds = list(state.get("step_seconds", []))
        self._window = list(state.get("window", []))

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "metric": self.metric}

    def data_parallel(self, rank: int, world: int) -> tuple[int, int]:
        """(rank, world) of the data: the ranks of one context-parallel group read the same
        rows (`StepDataModule` asks)."""
        return rank // self.context_parallel, world // self.context_parallel
