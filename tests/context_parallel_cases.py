"""Run by tests/test_distributed.py in spawned processes: context-parallel attention on each rank
against one process's attention on the whole sequence, case by case.

Every rank builds the same global tensors from a case's seed, computes the one-process output
and gradients with `urpe.attention` (backend "reference", the specification), then its own
shard with `context_parallel_attention`, and records the largest differences: its output and
q, k, v, log_forget gradients against its shard of the one-process ones, and the tables'
gradients summed over the group against the one-process table gradients.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import urpe
from urpe.distributed import context_parallel_attention, context_parallel_mesh, shard


@dataclass(frozen=True)
class Case:
    layout: str = "zigzag"
    causal: bool = True
    normalization: str = "softmax"
    bias: str | None = "toeplitz"  # "toeplitz", "decay", "rows" (dense per query) or None
    gate: bool = True
    documents: bool = False
    padding: bool = False
    gqa: bool = False
    dropout: float = 0.0
    dtype: str = "float64"
    backend: str = "auto"
    batch: int = 2
    heads: int = 4
    chunk: int = 3  # positions per chunk of the layout
    dim: int = 8

    def name(self) -> str:
        return ",".join(f"{k}={v}" for k, v in asdict(self).items())


def _global_inputs(case: Case, length: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, case.dtype)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    b, h = case.batch, case.heads
    kv = h // 2 if case.gqa else h
    x = {
        "q": rand(b, h, length, case.dim),
        "k": rand(b, kv, length, case.dim),
        "v": rand(b, kv, length, case.dim),
        "grad": rand(b, h, length, case.dim),
    }
    if case.bias == "toeplitz":
        x["bias_table"] = rand(h, 2 * 4 + 1)  # K = 4: offsets beyond it clamp, across chunks
    elif case.bias == "decay":
        x["log_forget"] = -torch.rand(b, h, length, generator=gen, dtype=torch.float64).to(dtype)
    elif case.bias == "rows":
        x["rows"] = rand(b, 1, length, 1)
    if case.gate:
        x["gate_table"] = 1.0 + rand(1 if case.gqa else h, 2 * 5 + 1, scale=0.3)
    if case.documents:  # runs of 2..(2 chunks + 1) positions: documents cross chunk borders
        ids = torch.zeros(b, length, dtype=torch.int64)
        for row in range(b):
            position, doc = 0, 0
            while position < length:
                width = int(torch.randint(2, 2 * case.chunk + 2, (1,), generator=gen))
                ids[row, position : position + width] = doc
                position, doc = position + width, doc + 1
        x["document_ids"] = ids
    if case.padding:
        padded = torch.rand(b, length, generator=gen) < 0.3
        padded[0, : case.chunk] = True  # a whole chunk, and (causal) queries that see nothing
        x["key_padding_mask"] = padded
    return x


def _arguments(case: Case, x: dict, cut) -> tuple[dict, dict]:
    """(tensors that get gradients, keyword arguments) with `cut` applied to the sequence."""
    leaves = {name: cut(x[name], -2).clone().requires_grad_() for name in ("q", "k", "v")}
    kwargs = dict(
        is_causal=case.causal,
        normalization=case.normalization,
        enable_gqa=case.gqa,
    )
    if case.bias == "toeplitz":
        leaves["bias_table"] = x["bias_table"].clone().requires_grad_()
        kwargs["bias"] = urpe.Toeplitz(leaves["bias_table"])
    elif case.bias == "decay":
        leaves["log_forget"] = cut(x["log_forget"], -1).clone().requires_grad_()
        kwargs["bias"] = urpe.Decay(leaves["log_forget"])
    elif case.bias == "rows":
        leaves["rows"] = cut(x["rows"], -2).clone().requires_grad_()
        kwargs["bias"] = leaves["rows"]
    if case.gate:
        leaves["gate_table"] = x["gate_table"].clone().requires_grad_()
        kwargs["gate"] = urpe.Toeplitz(leaves["gate_table"])
    for name in ("document_ids", "key_padding_mask"):
        if name in x:
            kwargs[name] = cut(x[name], -1)
    if case.dropout:
        kwargs.update(dropout_p=case.dropout, dropout_seed=1234)
    return leaves, kwargs


TABLES = ("bias_table", "gate_table")


def run_case(case: Case, seed: int, group=None) -> tuple[dict[str, float], dict[str, float]]:
    """The largest difference per compared tensor on this rank, and the largest magnitude of
    each expected tensor (the scale of unbounded exp weights)."""
    size = dist.get_world_size(group)
    chunks = size if case.layout == "contiguous" else 2 * size
    length = chunks * case.chunk
    x = _global_inputs(case, length, seed)

    def whole(t, dim):
        return t

    def part(t, dim):
        return shard(t, layout=case.layout, group=group, dim=dim)

    leaves, kwargs = _arguments(case, x, whole)
    expected = urpe.attention(leaves["q"], leaves["k"], leaves["v"], backend="reference", **kwargs)
    expected.backward(x["grad"])
    mine, my_kwargs = _arguments(case, x, part)
    out = context_parallel_attention(
        mine["q"], mine["k"], mine["v"], group=group, layout=case.layout,
        backend=case.backend, **my_kwargs,
    )  # fmt: skip
    out.backward(part(x["grad"], -2))
    want = part(expected.detach(), -2)
    errors = {"out": (out - want).abs().max().item()}
    scales = {"out": want.abs().max().item()}
    for name, leaf in mine.items():
        if name in TABLES:  # each rank's part; the group's sum is the gradient
            grad = leaf.grad.clone()
            dist.all_reduce(grad, group=group)
            want = leaves[name].grad
        else:
            grad = leaf.grad
            want = part(leaves[name].grad, -1 if name == "log_forget" else -2)
        errors[name] = (grad - want).abs().max().item()
        scales[name] = want.abs().max().item()
    return errors, scales


def worker(rank: int, size: int, port: int, cases: list[dict], out: str, refusals: bool) -> None:
    """The cases' differences to rank<rank>.json; with `refusals`, the messages of bad use
    too (`refusals`)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    try:
        results = []
        for index, fields in enumerate(cases):
            case = Case(**fields)
            errors, scales = run_case(case, seed=index)
            results.append({"case": case.name(), "errors": errors, "scale": scales})
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
        if refusals:
            Path(out, f"refusals{rank}.json").write_text(json.dumps(bad_use_messages(rank)))
    finally:
        dist.destroy_process_group()


def _refusal(call) -> str:
    try:
        call()
    except ValueError as error:
        return str(error)
    return "(accepted)"


def bad_use_messages(rank: int) -> dict[str, str]:
    """The message of each kind of bad use (a collective: every rank runs it)."""
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    table = torch.randn(2, 5, dtype=torch.float64)
    uneven = torch.randn(1, 2, 4 + 2 * rank, 8, dtype=torch.float64)
    index = torch.zeros(1, 4, 4, dtype=torch.long)
    return {
        "unequal shards": _refusal(lambda: context_parallel_attention(uneven, uneven, uneven)),
        "layout does not divide": _refusal(lambda: shard(torch.zeros(1, 2, 6, 8))),
        "group does not divide": _refusal(lambda: context_parallel_mesh(3)),
        "dense term": _refusal(
            lambda: context_parallel_attention(q, q, q, bias=torch.zeros(1, 2, 4, 4))
        ),
        "attn_mask": _refusal(
            lambda: context_parallel_attention(q, q, q, attn_mask=torch.ones(4, 4).bool())
        ),
        "relation": _refusal(
            lambda: context_parallel_attention(q, q, q, gate=urpe.Relation(table, index))
        ),
    }


# ---------------------------------------------------------------------------------------------
# Models: a Transformer given `context_parallel=` equals the same model on the whole sequence

MODELS = [
    dict(position="rpe", gate="toeplitz", causal=True, documents=True),
    dict(position="rope", gate="toeplitz", causal=True, documents=False),
    dict(position="fox", gate=None, causal=True, documents=True),
    dict(position="alibi", gate="toeplitz", causal=False, documents=False),
    dict(position="t5", gate=None, causal=False, documents=True),
]


def run_model(setting: dict, seed: int, cp) -> dict[str, float]:
    """The largest differences of logits (or hidden states) and of parameter gradients."""
    from urpe.models import TransformerConfig, TransformerDecoder, TransformerEncoder

    torch.manual_seed(seed)
    config = TransformerConfig(
        vocab_size=11, max_len=64, num_layers=2, dim=16, num_heads=2, position=setting["position"],
        gate=setting["gate"], absolute="sinusoidal" if setting["position"] == "rpe" else None,
    )  # fmt: skip
    model = (TransformerDecoder if setting["causal"] else TransformerEncoder)(config).double()
    length = 4 * cp.size * 3
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 11, (2, length), generator=gen)
    extra = {}
    if setting["documents"]:
        extra["document_ids"] = torch.arange(length).div(5, rounding_mode="floor").repeat(2, 1)
    if not setting["causal"]:
        padding = torch.zeros(2, length, dtype=torch.bool)
        padding[1, -5:] = True
        extra["key_padding_mask"] = padding
    whole = model(tokens, **extra)
    weights = torch.randn(whole.shape, generator=gen, dtype=whole.dtype)
    (whole * weights).sum().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    mine = model(cp.shard(tokens), **{k: cp.shard(v) for k, v in extra.items()},
                 context_parallel=cp)  # fmt: skip
    (mine * cp.shard(weights, dim=1)).sum().backward()
    errors = {"output": (mine - cp.shard(whole.detach(), dim=1)).abs().max().item()}
    for name, param in model.named_parameters():
        if name in expected:
            grad = param.grad.clone()
            dist.all_reduce(grad, group=cp.group)  # each rank's part
            errors[name] = (grad - expected[name]).abs().max().item()
    return errors


def model_worker(rank: int, size: int, port: int, layout: str, out: str) -> None:
    from urpe.distributed import ContextParallel

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    try:
        cp = ContextParallel(layout=layout)
        results = [run_model(setting, seed, cp) for seed, setting in enumerate(MODELS)]
        Path(out, f"models{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Composition: a (dp, cp) mesh, the data-parallel wrapper reducing every parameter's gradient
# over all ranks (DDP, or FSDP2 on the flattened mesh), equals one process on the whole batch


def _mean_loss_gradients(model, tokens, targets, cp=None) -> dict:
    """Parameter gradients of the mean next-token loss over `tokens`' rows; with `cp`, this
    rank's share: its shard's summed loss over the tokens of the group's rows, times the
    group's size, so that the mean over all ranks is the one-process gradient."""
    import torch.nn.functional as F

    given = {} if cp is None else {"context_parallel": cp}
    if cp is not None:
        tokens, targets = cp.shard(tokens), cp.shard(targets)
    logits = model(tokens, **given)
    total = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    count = targets.numel() * (1 if cp is None else cp.size)
    (total * (1 if cp is None else cp.size) / count).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def mesh_worker(rank: int, size: int, port: int, cp_size: int, wrapper: str, out: str) -> None:
    """dp = size / cp_size data-parallel groups of cp_size context-parallel ranks each; the
    largest gradient difference to one process per parameter to mesh<rank>.json."""
    import copy

    from torch.nn.parallel import DistributedDataParallel

    from urpe.distributed import context_parallel_mesh
    from urpe.models import TransformerConfig, TransformerDecoder

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    try:
        meshed = context_parallel_mesh(cp_size)
        cp, dp, dp_size = meshed.cp, meshed.data_parallel_rank, meshed.data_parallel_size
        torch.manual_seed(0)
        config = TransformerConfig(
            vocab_size=11, max_len=64, num_layers=2, dim=16, num_heads=2, position="rpe",
            gate="toeplitz",
        )  # fmt: skip
        model = TransformerDecoder(config).double()
        reference = copy.deepcopy(model)
        gen = torch.Generator().manual_seed(1)
        rows, length = 2 * dp_size, 4 * cp_size * 3
        tokens = torch.randint(0, 11, (rows, length), generator=gen)
        targets = torch.randint(0, 11, (rows, length), generator=gen)
        expected = _mean_loss_gradients(reference, tokens, targets)
        mine = slice(2 * dp, 2 * dp + 2)  # this data-parallel rank's rows
        if wrapper == "ddp":
            wrapped = DistributedDataParallel(model)
            got = _mean_loss_gradients(wrapped, tokens[mine], targets[mine], cp)
            got = {n.removeprefix("module."): g for n, g in got.items()}
        else:  # FSDP2: parameters sharded over all ranks, gradients reduce-scattered (mean)
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            # one FSDP group for the whole model: the layers share the position tables
            fully_shard(model, mesh=init_device_mesh("cpu", (size,)))
            got = _mean_loss_gradients(model, tokens[mine], targets[mine], cp)
            got = {n: g.full_tensor() for n, g in got.items()}
        errors = {n: (got[n] - expected[n]).abs().max().item() for n in expected}
        errors["missing"] = float(len(expected.keys() - got.keys()))
        Path(out, f"mesh{rank}.json").write_text(json.dumps(errors))
    finally:
        dist.destroy_process_group()
