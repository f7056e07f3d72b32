"""One context-parallel call, checked and described once: its chunk pairs and their kernel calls.

`plan_call` checks `urpe.attention`'s arguments on this rank's shards (one clear error naming
what to do where a call cannot be split), agrees with the other ranks on the shard length and
the dropout seed (one small all-gather), and returns a `RingCall`: what every ring step needs
besides q, k and v. The ring itself is in `ring_attention`.

Chunk pairs. Every rank's shard is whole chunks of equal length C (`layout`), so a pair of a
query chunk (start a) and a key chunk (start b) is, under causal masking, all in the future
(b > a: skipped), the diagonal (b = a: the kernel's own causal mask) or all visible (b < a).
Its kernel call (`arguments`) carries

- the keys' padding (B, C) and their documents: on the diagonal the chunk's ids (B, C), else the
  queries' ids then the keys' (B, 2C), the kernels' form for queries apart from their keys
  (`urpe.kernels.masks.query_documents`); pairs that share no document are skipped;
- the bias and gate at that pair (`chunk_terms`);
- the dropout seed with the pair's place in the whole (L, L) matrix of weights
  (`urpe.kernels.dropout.seed_placement`), so each weight keeps the mask one process draws.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from ..kernels import Decay, Dense, Toeplitz
from ..kernels.host import may_read
from ..kernels.layout import BackwardArgs, ForwardArgs
from ..kernels.masks import visible_key_counts
from ..kernels.reference import draw_seed
from ..kernels.spec import AttentionSpec, resolve
from .chunk_terms import ChunkTerm, DecayChunks, DenseChunks, Pair, ToeplitzChunks
from .kernels import ChunkKernel, chunk_kernel
from .layout import Segment, ShardLayout, group_rank_and_size
from .merge import MERGED
from .ring import Ring

SPLIT_HINT = (
    "express it as a urpe.Toeplitz table over offsets or a urpe.Decay, and hide pairs with "
    "is_causal, key_padding_mask and document_ids"
)


@dataclass
class KeySide:
    """What travels around the ring with a rank's keys: k (B, Hkv, L, D), v (B, Hkv, L, Dv),
    and where given their padding (B, L), documents (B, L) and a decay's c (B|1, H|1, L)."""

    k: Tensor
    v: Tensor
    padding: Tensor | None = None
    documents: Tensor | None = None
    decay: Tensor | None = None

    def _fields(self) -> tuple[Tensor | None, ...]:
        return self.k, self.v, self.padding, self.documents, self.decay

    def tensors(self) -> list[Tensor]:
        return [t for t in self._fields() if t is not None]

    def replaced(self, tensors: list[Tensor]) -> KeySide:
        """The same fields filled, in order, from `tensors` (what a transfer received)."""
        received = iter(tensors)
        return KeySide(*(None if t is None else next(received) for t in self._fields()))


@dataclass
class RingCall:
    """A checked context-parallel call (module docstring); q, k, v are (B, H|Hkv, L, D)."""

    spec: AttentionSpec  # this rank's resolved call (shapes flattened to one batch dim)
    group: dist.ProcessGroup | None
    split: ShardLayout
    rank: int
    shard_length: int
    is_causal: bool
    seed: Tensor | None  # int64 scalar, the same on every rank
    padding: Tensor | None  # (B, L) bool, this rank's keys
    documents: Tensor | None  # (B, L) int64
    kernel: ChunkKernel
    ring: Ring = field(init=False)

    def __post_init__(self) -> None:
        self.ring = Ring(self.group, self.rank, self.split.size)

    @property
    def size(self) -> int:
        return self.split.size

    @property
    def length(self) -> int:
        """The global sequence length L."""
        return self.shard_length * self.size

    @property
    def segments(self) -> tuple[Segment, ...]:
        return self.split.segments(self.rank, self.shard_length)

    def owner_of(self, step: int) -> int:
        """Whose keys this rank holds at ring step `step` (its own at 0)."""
        return (self.rank - step) % self.size

    def key_side(self, k: Tensor, v: Tensor, decay: Tensor | None) -> KeySide:
        return KeySide(k.contiguous(), v.contiguous(), self.padding, self.documents, decay)

    # ------------------------------------------------------------------------- the chunk pairs
    def pairs(self, owner: int, keys: KeySide):
        """The pairs of this rank's query chunks with `owner`'s key chunks that hold a visible
        pair (what is skipped is skipped alike forward and backward)."""
        for query in self.segments:
            for key in self.split.segments(owner, self.shard_length):
                if self.is_causal and key.start > query.start:
                    continue  # all in the future
                if self._all_hidden(query, key, keys):
                    continue
                yield Pair(query, key, causal=self.is_causal and key.start == query.start)

    def _all_hidden(self, query: Segment, key: Segment, keys: KeySide) -> bool:
        """Whether padding or documents hide every pair (read only where values may be read)."""
        if keys.padding is not None and may_read(keys.padding):
            if bool(keys.padding[:, key.rows].all()):
                return True
        if keys.documents is not None and may_read(keys.documents):
            ours = self.documents[:, query.rows]
            theirs = keys.documents[:, key.rows]
            if not bool(torch.isin(ours.contiguous(), theirs.contiguous()).any()):
                return True
        return False

    def arguments(self, pair: Pair, q: Tensor, keys: KeySide, bias, gate) -> ForwardArgs:
        """The kernel call of one pair (module docstring)."""
        rows, cols = pair.query.rows, pair.key.rows
        spec = self.spec
        bias_tensor, bias_kind = (None, "none") if bias is None else bias.at(pair, keys.decay)
        gate_tensor, gate_kind = (None, "none") if gate is None else gate.at(pair, None)
        padding = None if keys.padding is None else keys.padding[:, cols]
        documents = None
        if keys.documents is not None:
            documents = keys.documents[:, cols]
            if not pair.diagonal:  # the queries' own ids, then the keys'
                documents = torch.cat([self.documents[:, rows], documents], -1)
        seed = None
        if self.seed is not None:  # this pair's place in the (L, L) weights
            where = [pair.query.start, self.length, pair.key.start, self.length]
            seed = torch.cat([self.seed.view(1), self.seed.new_tensor(where)])
        return ForwardArgs(
            q[:, :, rows],
            keys.k[:, :, cols],
            keys.v[:, :, cols],
            bias_tensor,
            None,
            gate_tensor,
            None,
            None,
            padding,
            documents,
            seed,
            bias_kind,
            gate_kind,
            pair.causal,
            spec.normalization,
            spec.scale,
            spec.dropout_p,
            0,
            0,
        )

    def counts(self, args: ForwardArgs) -> Tensor:
        """The keys each query of a pair sees (B|1, H|1, C): relu2's n_i, summed over pairs."""
        length = args.q.shape[2]
        return visible_key_counts(
            args.key_padding_mask,
            None,
            args.is_causal,
            length,
            args.k.shape[2],
            device=args.q.device,
            document_ids=args.document_ids,
        )

    def backward_arguments(
        self, pair: Pair, args: ForwardArgs, grad_out: Tensor, out: Tensor, stat: Tensor, needs
    ) -> BackwardArgs:
        rows = pair.query.rows
        return BackwardArgs(
            grad_out[:, :, rows], out[:, :, rows], stat[:, :, rows], args, needs[0], needs[1], False
        )


# ---------------------------------------------------------------------------------------------
# Checking and planning a call


def _refuse_unsplittable(spec: AttentionSpec, q: Tensor, k: Tensor) -> None:
    """ValueError, in one line naming what to do, for a call that cannot be split by chunks."""
    if q.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"context parallelism splits one sequence: q and k must be shards of the same "
            f"length, got {q.shape[-2]} and {k.shape[-2]}"
        )
    if spec.attn_mask is not None:
        raise ValueError(f"an attn_mask is a dense (L, L) term and cannot be split: {SPLIT_HINT}")
    if spec.normalization not in MERGED:
        raise ValueError(
            f"context parallelism merges the chunks of {', '.join(MERGED)} rows; normalization "
            f"{spec.normalization!r} has no merge rule here"
        )
    for role in ("bias", "gate"):
        term = getattr(spec, role)
        if term is None or isinstance(term, (Toeplitz, Decay)):
            continue
        if isinstance(term, Dense) and term.tensor.shape[-1] == 1:
            continue  # broadcast over the keys: read at each query chunk
        what = "a dense (L, L) term" if isinstance(term, Dense) else f"a {term.kind} term"
        raise ValueError(f"{role} is {what}, which context parallelism cannot split: {SPLIT_HINT}")


def _agreed(spec: AttentionSpec, q: Tensor, group, rank: int, size: int) -> Tensor | None:
    """Check that every rank holds a shard of the same length (and the same call shapes), and
    agree on one dropout seed (rank 0's): one all-gather of a few numbers."""
    seed = None
    if spec.dropout_p > 0.0:
        seed = spec.dropout_seed if spec.dropout_seed is not None else draw_seed(q.device)
    terms = [t.raw()[0] for t in (spec.bias, spec.gate) if t is not None]
    shapes = [spec.q.shape, spec.k.shape, spec.v.shape, *(t.shape for t in terms)]
    numbers = [n for shape in shapes for n in (*shape, *(-1,) * (4 - len(shape)))]
    numbers += [-1] * (4 * 5 - len(numbers))  # a fixed width, whatever the call
    mine = torch.tensor(numbers + [0], device=q.device)
    if seed is not None:
        mine[-1] = seed
    gathered = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(gathered, mine, group=group)
    rows = [g.tolist() for g in gathered]
    lengths = [row[2] for row in rows]  # q's (B, H, L, D): its L
    if len(set(lengths)) > 1:
        raise ValueError(
            f"shards of unequal length across the context-parallel group ({lengths}): cut the "
            "sequence with urpe.distributed.shard after padding it to a multiple of the "
            "layout's chunks (mask the padding with key_padding_mask)"
        )
    if any(row[:-1] != rows[0][:-1] for row in rows):
        raise ValueError(
            "the processes of the context-parallel group called with different shapes: each "
            "passes its shard of the same global q, k, v and terms"
        )
    if seed is None:
        return None
    return gathered[0][-1].clone()


def plan_call(
    q: Tensor, k: Tensor, v: Tensor, group, layout: str, backend: str, kwargs: dict
) -> RingCall:
    """Check a call (module docstring) and describe it."""
    spec = resolve(q, k, v, **kwargs)
    _refuse_unsplittable(spec, q, k)
    rank, size = group_rank_and_size(group)
    split = ShardLayout(layout, size)
    shard_length = spec.q.shape[2]
    split.check_shard(shard_length)
    kernel = chunk_kernel(backend, spec)
    seed = _agreed(spec, q, group, rank, size)
    batch = spec.q.shape[0]
    padding = spec.key_padding_mask
    if padding is not None:
        padding = padding.expand(batch, shard_length).contiguous()
    documents = spec.document_ids
    if documents is not None:
        documents = documents.to(torch.int64).expand(batch, shard_length).contiguous()
    return RingCall(
        spec=spec,
        group=group,
        split=split,
        rank=rank,
        shard_length=shard_length,
        # the caller's flag: `resolve` drops it for a one-query shard, where the ring needs it
        is_causal=bool(kwargs.get("is_causal", False)),
        seed=seed,
        padding=padding,
        documents=documents,
        kernel=kernel,
    )


def chunk_terms(
    call: RingCall, cumulative: Tensor | None, needs: tuple[bool, bool]
) -> tuple[ChunkTerm | None, ChunkTerm | None]:
    """The bias and gate of `call` read per chunk pair (`cumulative`: a Decay's global c)."""
    terms = []
    for term, needed in zip((call.spec.bias, call.spec.gate), needs, strict=True):
        if term is None:
            terms.append(None)
        elif isinstance(term, Toeplitz):
            terms.append(ToeplitzChunks(term.table.detach(), needed))
        elif isinstance(term, Decay):
            terms.append(DecayChunks(cumulative, needed))
        else:
            terms.append(DenseChunks(term.tensor.detach(), needed))
    return terms[0], terms[1]
