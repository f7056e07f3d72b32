"""Where queries and keys sit: one small object built once per forward pass.

A `Positions` carries the absolute positions of the queries and of the keys, shared by the batch,
(L,), or per batch row, (B, L), and optionally a pairwise relation index (B, Lq, Lk), such as the
shortest-path distance between graph nodes. Encodings and gates compute their terms from it:
RoPE rotates by the positions, Toeplitz-style encodings look up the offsets key - query, FIRE
reads the query positions, relation-indexed encodings read the relation.

Which form an encoding may return is decided from Python values set by the constructor, never by
looking at tensor values (no host sync, no graph break under `torch.compile`):

- `is_aligned`: keys sit at consecutive positions start .. start + Lk - 1, shared by the batch, and
  the queries are the last Lq of them. That is exactly the layout of `urpe.Toeplitz`
  (pos(i) = i + Lk - Lq up to a common shift, which relative offsets do not see), so a Toeplitz
  table stays structured and the tiled kernels read it tile by tile. `sequence` and `graph` build
  aligned positions.
- otherwise (per-row positions, arbitrary offsets) encodings fall back to an exact `Relation` over
  clipped offsets or a dense term.

KV-cache decoding and segment memory (Transformer-XL) are the same layout: Lq new queries at
past .. past + Lq - 1 over past + Lq keys (`Positions.sequence(Lq, past=M)`).

Packed documents (`Positions.from_document_ids`): several documents concatenated in one row,
attention kept inside each (`urpe.attention(..., document_ids=)`). The absolute positions restart
at 0 with every document (what RoPE, FIRE and absolute encodings read), while the layout stays
aligned: within a document key - query is the same counted from the row's start or from the
document's, and pairs across documents are never attended, so Toeplitz terms keep their
structure and need no change.
"""

from __future__ import annotations

import torch
from torch import Tensor

_INTEGER = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _check_index_tensor(name: str, t: Tensor, dims: tuple[int, ...]) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    if t.dtype not in _INTEGER:
        raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    if t.dim() not in dims:
        shapes = " or ".join({1: "(L,)", 2: "(B, L)", 3: "(B, Lq, Lk)"}[d] for d in dims)
        raise ValueError(f"{name} must have shape {shapes}, got {tuple(t.shape)}")


def _check_relation(relation: Tensor | None, lq: int, lk: int, rows: set[int]) -> None:
    """A relation index (B|1, Lq, Lk) that matches the positions (rows: their batch sizes)."""
    if relation is None:
        return
    _check_index_tensor("positions.relation", relation, (3,))
    if tuple(relation.shape[-2:]) != (lq, lk):
        raise ValueError(
            f"positions.relation must have shape (B, Lq, Lk) = (B, {lq}, {lk}), "
            f"got {tuple(relation.shape)}"
        )
    if rows and relation.shape[0] not in rows | {1}:
        raise ValueError(
            f"positions.relation has batch {relation.shape[0]}, positions have {rows.pop()}"
        )


def _device_of(device: torch.device | str | None) -> torch.device:
    """The device torch.arange(..., device=device) would put its result on ("cuda" -> "cuda:0")."""
    if type(device) is torch.device and (device.type == "cpu" or device.index is not None):
        return device  # a tensor's own device, the usual case
    if device is None:
        getter = getattr(torch, "get_default_device", None)  # torch >= 2.3
        device = getter() if getter is not None else torch.device("cpu")
    device = torch.device(device)
    if device.type != "cpu" and device.index is None:
        device = torch.empty(0, device=device).device
    return device


class Positions:
    """Absolute positions of queries and keys, and an optional pairwise relation.

    Args:
        query: (Lq,) or (B, Lq) integer positions of the queries.
        key: (Lk,) or (B, Lk) integer positions of the keys.
        relation: optional (B, Lq, Lk) (or (1, Lq, Lk)) integer relation index, read by
            relation-indexed encodings (`RelationBias`, `RelationGate`).

    Built this way the positions are treated as arbitrary (encodings use the exact fallback
    forms). Prefer the constructors, which also record the structure:
    `Positions.sequence`, `Positions.from_padding`, `Positions.graph`.
    """

    def __init__(self, query: Tensor, key: Tensor, relation: Tensor | None = None):
        _check_index_tensor("positions.query", query, (1, 2))
        _check_index_tensor("positions.key", key, (1, 2))
        if query.device != key.device:
            raise ValueError(f"positions.query is on {query.device}, positions.key on {key.device}")
        if query.dim() == 2 and key.dim() == 2 and query.shape[0] != key.shape[0]:
            raise ValueError(
                f"positions.query has {query.shape[0]} rows but positions.key has {key.shape[0]}"
            )
        rows = {t.shape[0] for t in (query, key) if t.dim() == 2}
        _check_relation(relation, query.shape[-1], key.shape[-1], rows)
        self._query, self._key, self.relation = query, key, relation
        self._lengths = (query.shape[-1], key.shape[-1])
        self._device = query.device
        # Python-level structure: (start of the keys) when aligned, else None. Set only by the
        # constructors that know it; never derived from tensor values.
        self._aligned_start: int | None = None
        self._relation_range: tuple[int, int] | None = None
        self._documents: Tensor | None = None
        self._shift: Tensor | int | None = None
        self._sharded: int | None = None

    @property
    def query(self) -> Tensor:
        """(Lq,) or (B, Lq) integer positions of the queries."""
        if self._query is None:  # aligned: made on first use (decoding steps often never ask)
            lq, lk = self._lengths
            end = self._aligned_start + lk
            self._query = torch.arange(end - lq, end, device=self._device)
        return self._query

    @property
    def key(self) -> Tensor:
        """(Lk,) or (B, Lk) integer positions of the keys."""
        if self._key is None:
            start = self._aligned_start
            self._key = torch.arange(start, start + self._lengths[1], device=self._device)
        return self._key

    # ----------------------------------------------------------------------------- constructors
    @classmethod
    def sequence(
        cls,
        length: int,
        *,
        past: int = 0,
        start: int = 0,
        device: torch.device | str | None = None,
        relation: Tensor | None = None,
    ) -> Positions:
        """`length` queries over `past` earlier keys plus themselves.

        Keys sit at start .. start + past + length - 1 and the queries are the last `length` of
        them: a plain sequence (past=0), decoding after `past` cached tokens, or a segment after
        `past` memory positions (Transformer-XL). `start` shifts everything; relative encodings
        do not see it, absolute ones (APE, FIRE, RoPE's angles) do.
        """
        for name, value in (("length", length), ("past", past), ("start", start)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if length < 0 or past < 0:
            raise ValueError(f"length and past must be >= 0, got length={length}, past={past}")
        return cls.aligned(length, past + length, start=start, device=device, relation=relation)

    @classmethod
    def aligned(
        cls,
        query_length: int,
        key_length: int,
        *,
        start: int = 0,
        device: torch.device | str | None = None,
        relation: Tensor | None = None,
    ) -> Positions:
        """Keys at start .. start + Lk - 1, queries the last Lq of them (start + Lk - Lq + i).

        This is `urpe.attention`'s own convention for Lq != Lk (and its causal alignment); with
        Lq > Lk the first queries sit before the first key. The default for cross-attention.
        """
        _check_relation(relation, query_length, key_length, set())
        # The position tensors are made on first use: many calls only read the structure.
        positions = cls.__new__(cls)
        positions._query = positions._key = None
        positions.relation = relation
        positions._lengths = (query_length, key_length)
        positions._device = _device_of(device)
        positions._aligned_start = start
        positions._relation_range = None
        positions._documents = None
        positions._shift = None
        positions._sharded = None
        return positions

    @classmethod
    def sharded(cls, positions: Tensor, length: int) -> Positions:
        """This process's tokens of one sequence of `length` tokens split across processes
        (context parallelism, `urpe.distributed`): positions (L/N,) or (B, L/N) are their
        absolute positions (what RoPE, FIRE and absolute encodings read; packed documents'
        restart at each document), queries and keys alike.

        The layout counts as aligned over the whole sequence: a Toeplitz-style term keeps its
        table, which the context-parallel call reads at the global offsets of each pair of
        chunks. Only a context-parallel call reads such terms right (`urpe.attention` itself
        would read the table at the shard's own offsets): models build these positions when
        given `context_parallel=`.
        """
        _check_index_tensor("positions", positions, (1, 2))
        shard = positions.shape[-1]
        out = cls.aligned(shard, shard, device=positions.device)
        out._query = out._key = positions
        out._sharded = length
        return out

    @classmethod
    def contiguous(
        cls,
        query_length: int,
        key_length: int,
        query_start: Tensor | int,
        key_start: Tensor | int,
        *,
        device: torch.device | str | None = None,
    ) -> Positions:
        """Keys at key_start + j, queries at query_start + i, each start an int or a 0-dim
        integer tensor: a static KV cache, whose new queries sit inside a longer key buffer at
        an offset that, under torch.compile, is a tensor (never read on the host).

        Offsets are those of `aligned` positions shifted by one number (`toeplitz_shift`), so
        a Toeplitz-style term stays one, over its table shifted by that number
        (`urpe.encodings.base.shifted_offsets`): no (Lq, Lk) index.
        """
        for name, start in (("query_start", query_start), ("key_start", key_start)):
            tensor = isinstance(start, Tensor) and start.dim() == 0 and start.dtype in _INTEGER
            if not (tensor or (isinstance(start, int) and not isinstance(start, bool))):
                raise TypeError(f"{name} must be an int or a 0-dim integer tensor, got {start!r}")
        device = _device_of(device)
        query = torch.arange(query_length, device=device) + query_start
        key = torch.arange(key_length, device=device) + key_start
        positions = cls(query, key)
        # key - query = (j - (i + Lk - Lq)) + shift, the aligned offsets plus one number
        positions._shift = (key_start - query_start) + (key_length - query_length)
        return positions

    @classmethod
    def from_document_ids(
        cls, document_ids: Tensor, query_length: int | None = None, relation: Tensor | None = None
    ) -> Positions:
        """Packed documents: each key's position counts from the start of its document.

        document_ids: (Lk,) or (B, Lk) integer, one id per key; a document is a run of equal
            ids (packing concatenates them), and position 0 is where the id changes. Attention
            joins equal ids wherever they are, so give each document of a row its own id (as
            0, 1, 2, ... does). The queries
            are the last `query_length` keys (default all of them): a KV cache passes the ids of
            cache + new tokens.

        The layout stays aligned (see the module doc): `offsets()` are the row's own j - i',
        equal to the in-document offsets for every pair a query may attend to, so Toeplitz terms
        keep their structure; `query` and `key` are the restarted positions.
        """
        _check_index_tensor("document_ids", document_ids, (1, 2))
        lk = document_ids.shape[-1]
        lq = lk if query_length is None else query_length
        if not 0 <= lq <= lk:
            raise ValueError(f"query_length must be in [0, {lk}], got {query_length}")
        index = torch.arange(lk, device=document_ids.device).expand_as(document_ids)
        starts = torch.ones_like(document_ids, dtype=torch.bool)
        starts[..., 1:] = document_ids[..., 1:] != document_ids[..., :-1]
        first = torch.where(starts, index, torch.zeros_like(index)).cummax(-1).values
        key = index - first  # (B?, Lk): steps since the document's first key
        positions = cls.aligned(lq, lk, device=document_ids.device, relation=relation)
        positions._query, positions._key = key[..., lk - lq :], key
        positions._documents = document_ids
        return positions

    @classmethod
    def from_padding(cls, key_padding_mask: Tensor, query_length: int | None = None) -> Positions:
        """Per-row positions counted over real tokens: each row's first real key is position 0.

        key_padding_mask: (B, Lk) bool, True = padded. The queries are the last `query_length`
        keys (default all of them), so this also serves cached decoding of left-padded prompts
        (pass the mask of cache + new tokens). A padded slot gets the position of the real token
        before it (0 before the first); it is masked anyway.
        """
        if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool:
            raise TypeError("key_padding_mask must be a bool tensor (True marks a padded key)")
        if key_padding_mask.dim() != 2:
            raise ValueError(
                f"key_padding_mask must have shape (B, Lk), got {tuple(key_padding_mask.shape)}"
            )
        lk = key_padding_mask.shape[1]
        lq = lk if query_length is None else query_length
        if not 0 <= lq <= lk:
            raise ValueError(f"query_length must be in [0, {lk}], got {query_length}")
        key = ((~key_padding_mask).long().cumsum(-1) - 1).clamp_min(0)  # (B, Lk)
        return cls(key[:, lk - lq :], key)

    @classmethod
    def graph(cls, relation: Tensor) -> Positions:
        """Nodes of a graph (self-attention, N queries = N keys) with a pairwise relation.

        relation: (B, N, N) integer, e.g. shortest-path distances. The node order gives the
        positions 0..N-1, which only sequence encodings read.
        """
        _check_index_tensor("positions.relation", relation, (3,))
        if relation.shape[1] != relation.shape[2]:
            raise ValueError(
                f"a graph relation must be (B, N, N), got {tuple(relation.shape)}; "
                "use Positions(query, key, relation) for other layouts"
            )
        return cls.sequence(relation.shape[1], device=relation.device, relation=relation)

    def with_relation(self, relation: Tensor | None) -> Positions:
        """The same positions (and structure) with another relation index."""
        if self._sharded is not None:
            raise ValueError("positions of a shard (context parallelism) carry no relation")
        if self._documents is not None:
            return Positions.from_document_ids(self._documents, self.query_length, relation)
        if self.is_aligned:
            lq, lk = self._lengths
            return Positions.aligned(
                lq, lk, start=self._aligned_start, device=self._device, relation=relation
            )
        positions = Positions(self.query, self.key, relation)
        positions._shift = self._shift
        return positions

    # ------------------------------------------------------------------------------- structure
    @property
    def query_length(self) -> int:
        return self._lengths[0]

    @property
    def key_length(self) -> int:
        return self._lengths[1]

    @property
    def batch(self) -> int | None:
        """B when positions are per row, else None (shared by the batch)."""
        if self._documents is not None:
            return self._documents.shape[0] if self._documents.dim() == 2 else None
        if self._sharded is not None:
            return self._query.shape[0] if self._query.dim() == 2 else None
        if self.is_aligned:
            return None
        for t in (self.query, self.key):
            if t.dim() == 2:
                return t.shape[0]
        return None

    @property
    def is_aligned(self) -> bool:
        """Keys consecutive and shared by the batch, queries the last Lq of them (Toeplitz form)."""
        return self._aligned_start is not None

    @property
    def toeplitz_shift(self) -> Tensor | int | None:
        """For `contiguous` positions, the number s with key - query = j - (i + Lk - Lq) + s
        (an int, or a 0-dim tensor never read on the host); None for any other positions
        (aligned ones have s = 0: see `is_aligned`)."""
        return self._shift

    @property
    def table_lengths(self) -> tuple[int, int]:
        """(Lq, Lk) whose offsets a Toeplitz table over these aligned positions must span: the
        call's own, or the whole sequence's for `sharded` positions."""
        if self._sharded is not None:
            return self._sharded, self._sharded
        return self._lengths

    @property
    def sharded_length(self) -> int | None:
        """The whole sequence's length for `sharded` positions, else None."""
        return self._sharded

    @property
    def documents(self) -> Tensor | None:
        """The document ids (Lk,) or (B, Lk) of packed positions (`from_document_ids`), else
        None."""
        return self._documents

    @property
    def query_start(self) -> int | None:
        """Position of the first query as a Python int when aligned (one sequence), else None."""
        if self._aligned_start is None or self._documents is not None:
            return None
        if self._sharded is not None:  # where the shard's rows sit: `query`
            return None
        return self._aligned_start + self.key_length - self.query_length

    @property
    def device(self) -> torch.device:
        return self._device

    def offsets(self) -> Tensor:
        """d_ij = key position - query position. Shape (B or 1, Lq, Lk), int64.

        Packed documents: the row's own offsets j - i' (1, Lq, Lk), which equal the in-document
        ones for every pair inside a document (the only pairs attended)."""
        if self._documents is not None:
            lq, lk = self._lengths
            key = torch.arange(lk, device=self._device)
            return (key[None, :] - key[lk - lq :, None])[None]
        query = self.query if self.query.dim() == 2 else self.query[None]  # (B or 1, Lq)
        key = self.key if self.key.dim() == 2 else self.key[None]  # (B or 1, Lk)
        return key.long()[:, None, :] - query.long()[:, :, None]

    def require_relation(self, owner: str) -> Tensor:
        """The relation index, or a ValueError saying who needed it."""
        if self.relation is None:
            raise ValueError(
                f"{owner} reads positions.relation, but these positions carry none: build them "
                "with urpe.Positions.graph(relation) or Positions(query, key, relation)"
            )
        return self.relation

    def check_relation_range(self, num_relations: int, owner: str) -> None:
        """ValueError naming positions.relation when an index falls outside [0, num_relations).

        Eager: one host sync per Positions object (the range is remembered for later layers).
        Under torch.compile: an asynchronous device assertion, so the graph does not break.
        """
        relation = self.require_relation(owner)
        message = (
            f"positions.relation must hold indices in [0, {num_relations}) for {owner} "
            f"(num_relations={num_relations})"
        )
        if torch.compiler.is_compiling():
            torch._assert_async(((relation >= 0) & (relation < num_relations)).all(), message)
            return
        if relation.numel() == 0:
            return
        if self._relation_range is None:
            low, high = torch.aminmax(relation.long())
            self._relation_range = (int(low), int(high))
        low, high = self._relation_range
        if low < 0 or high >= num_relations:
            raise ValueError(f"{message}, got indices {low}..{high}")

    def check_shape(
        self,
        query_length: int,
        key_length: int,
        batch: int,
        where: str = "positions",
        device: torch.device | None = None,
    ) -> None:
        """ValueError unless these positions describe Lq queries over Lk keys in a batch of B
        (on `device`, when given)."""
        if device is not None and self.device != torch.device(device):
            raise ValueError(f"{where} are on {self.device}, the inputs on {device}")
        if (self.query_length, self.key_length) != (query_length, key_length):
            raise ValueError(
                f"{where} describe {self.query_length} queries over {self.key_length} keys, "
                f"but this call has {query_length} queries over {key_length} keys"
            )
        rows = self.batch
        if rows is not None and rows not in (1, batch):
            raise ValueError(f"{where} are per row for a batch of {rows}, but the batch is {batch}")
        if self.relation is not None and self.relation.shape[0] not in (1, batch):
            raise ValueError(
                f"{where}.relation has batch {self.relation.shape[0]}, but the batch is {batch}"
            )

    def __repr__(self) -> str:
        form = f"aligned, start={self._aligned_start}" if self.is_aligned else "arbitrary"
        if self._shift is not None:
            form = "contiguous"
        if self._documents is not None:
            form = "packed documents"
        if self._sharded is not None:
            form = f"a shard of {self._sharded}"
        rows = "shared" if self.batch is None else f"per row (B={self.batch})"
        relation = "" if self.relation is None else f", relation {tuple(self.relation.shape)}"
        return f"Positions(Lq={self.query_length}, Lk={self.key_length}, {form}, {rows}{relation})"
