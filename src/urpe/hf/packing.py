"""Packed batches in transformers' attention calls: which document each key belongs to.

transformers' `DataCollatorWithFlattening` concatenates a batch's documents into one row with
no padding and marks them in one of two ways, both of which reach the attention function as
keyword arguments:

- `position_ids` restarting at 0 with every document (the default);
- flash-attention's `cu_seq_lens_q` / `cu_seq_lens_k` (`return_flash_attn_kwargs=True`): the
  cumulative document lengths, [0, n_0, n_0 + n_1, ..., T].

transformers' own mask builders turn restarting position ids into a dense block-diagonal mask
only without a cache; in training the model makes a fresh cache (use_cache defaults to True),
and then no mask comes at all and the documents would see each other. `document_ids_of` reads
the documents from either marking, so urpe.attention keeps each document to itself
(`document_ids=`, O(L) beside q, k, v) whatever the cache or the base implementation.

A gate's offsets need no change: within a document, key slot minus query slot is the offset
counted from the document's start, and pairs across documents are never attended.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

# Where each gated module finds the reads of the pass it runs in (set by add_urpe).
READS = "_urpe_document_reads"


class DocumentReads:
    """The document ids read during one forward pass of a gated model, by the tensor read.

    A pass hands every layer the same position ids (or cu_seq_lens) tensor: reading it once
    per pass, not once per layer, spares a host sync per layer on a GPU. Reads are kept only
    while the pass runs (`begin` and `end`, hooks of the module whose call is the pass:
    `patch.pass_module`, the model's base model where it holds every gated layer): a buffer the
    caller rewrites in place between passes (also under torch.inference_mode, where tensors
    count no versions) is read again. Under torch.compile nothing is kept: the reads are traced ops.
    """

    def __init__(self) -> None:
        self.reads: dict[str, tuple[Tensor, tuple, Tensor | None]] | None = None

    def begin(self, model: nn.Module, args: tuple) -> None:
        if not torch.compiler.is_compiling():
            self.reads = {}

    def end(self, model: nn.Module, args: tuple, output) -> None:
        if not torch.compiler.is_compiling():
            self.reads = None

    def get(self, kind: str, tensor: Tensor, key: tuple, read: Callable[[], Tensor | None]):
        """read(), or its result when this pass already read the same tensor with this key."""
        if torch.compiler.is_compiling():
            return read()
        reads = self.reads
        if reads is None:  # a module called outside the model's forward: nothing to share
            return read()
        last = reads.get(kind)
        if last is not None and last[0] is tensor and last[1] == key:
            return last[2]
        result = read()
        reads[kind] = (tensor, key, result)
        return result


def _read(module: nn.Module | None, kind: str, tensor: Tensor, key: tuple, read: Callable):
    reads = None if module is None else module.__dict__.get(READS)
    return read() if reads is None else reads.get(kind, tensor, key, read)


def _from_cu_seq_lens(cu_seq_lens: Tensor, key_length: int) -> Tensor:
    """(1, Lk) document index of each key from cumulative lengths [0, ..., Lk]."""
    cu_seq_lens = cu_seq_lens.reshape(-1).long()
    # Checked where the data can be asked (not while torch.compile traces).
    if not torch.compiler.is_compiling():
        total = int(cu_seq_lens[-1])
        if total != key_length or int(cu_seq_lens[0]) != 0:
            raise ValueError(
                f"cu_seq_lens_k ends at {total} but the row has {key_length} keys (and must "
                "start at 0): pass the collator's cu_seq_lens with the input_ids it made"
            )
    lengths = cu_seq_lens.diff()  # (documents,)
    documents = torch.arange(len(lengths), device=cu_seq_lens.device)
    return torch.repeat_interleave(documents, lengths, output_size=key_length)[None]


def _from_position_ids(position_ids: Tensor) -> Tensor | None:
    """(B or 1, L) document index of each token, counting restarts (a position that does not
    follow its predecessor by one), or None when the rows are not packed: no row restarts, or
    some restart does not go back to the row's first position (padding: generate gives left
    padding position 1, then the text starts at 0; a packed row restarts at its start value)."""
    first = position_ids[..., :1]  # (B, 1)
    starts = position_ids.diff(dim=-1, prepend=first - 1) != 1  # (B, L)
    documents = starts.long().cumsum(-1)  # (B, L): 0 for the first document
    # Under torch.compile the data cannot be asked: the ids are passed as they are (padding
    # then forms documents of its own, hidden by the mask as before).
    if torch.compiler.is_compiling():
        return documents
    packed = starts[..., 1:].any() & (~starts | (position_ids == first)).all()
    return documents if bool(packed) else None


def document_ids_of(
    kwargs: dict, key_length: int, query_length: int, module: nn.Module | None = None
) -> Tensor | None:
    """(B or 1, Lk) int64 document index of every key of this attention call (of `module`: the
    ids are then read once per pass of its model), or None when the call is not packed (one
    document per row).

    cu_seq_lens_k wins when given. Position ids are read only for self-attention over the call's
    own tokens (Lq = Lk: no cached keys), whatever mask came with them (the eager mask builders
    always make one); padded rows, whose position ids repeat at the padding, are left to it.
    """
    cu_seq_lens = kwargs.get("cu_seq_lens_k")
    if cu_seq_lens is not None:
        read = lambda: _from_cu_seq_lens(cu_seq_lens, key_length)  # noqa: E731
        return _read(module, "cu_seq_lens", cu_seq_lens, (key_length,), read)
    position_ids = kwargs.get("position_ids")
    # (B, L) only: multimodal rope's (3, B, L) positions are not one position per token.
    if position_ids is None or position_ids.dim() > 2:
        return None
    if not position_ids.shape[-1] == query_length == key_length:
        return None
    return _read(module, "position_ids", position_ids, (), lambda: _from_position_ids(position_ids))
