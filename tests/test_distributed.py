"""Context-parallel attention (`urpe.distributed`) on 2 and 4 gloo processes on the CPU equals
one process: each rank's output and gradients against its shard of the one-process ones
(float64 to 1e-10, float32 to 1e-5; relative where a tensor's magnitude exceeds 1), over
layouts, causality, Toeplitz bias and gate, Decay, documents crossing shard borders, key
padding, grouped queries, the four normalisations and dropout; and so do models given a
context-parallel group. Each test is one spawn running many cases (`context_parallel_cases`)."""

from __future__ import annotations

import itertools
import json
import socket
from dataclasses import asdict, replace

import pytest
import torch.multiprocessing as mp

from urpe.distributed import LAYOUTS, ShardLayout

from .context_parallel_cases import MODELS, Case, mesh_worker, model_worker, worker

TOLERANCE = {"float64": 1e-10, "float32": 1e-5}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cases: list[Case], processes: int, tmp_path, refusals: bool = False) -> None:
    mp.spawn(
        worker,
        args=(processes, _free_port(), [asdict(c) for c in cases], str(tmp_path), refusals),
        nprocs=processes,
    )
    failures = []
    for rank in range(processes):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(results) == len(cases)
        for case, result in zip(cases, results, strict=True):
            for name, error in result["errors"].items():
                # relative to the expected tensor's magnitude where it exceeds 1 (exp and
                # relu2 weights are unbounded: exp outputs reach ~1e3 here)
                scale = max(result["scale"][name], 1.0)
                if not error <= TOLERANCE[case.dtype] * scale:
                    failures.append(f"rank {rank} {name} {error:.2e} {case.name()}")
    assert not failures, "\n".join(failures)


# One spawn of 2 processes: every feature at least once, both layouts, all normalisations.
FAST_CASES = [
    Case(),  # zigzag, causal, Toeplitz bias and gate, softmax
    Case(layout="contiguous", causal=False, gqa=True),
    Case(bias="decay", documents=True, padding=True),
    Case(layout="contiguous", bias="decay", dropout=0.3),
    Case(normalization="l2", documents=True, causal=False, padding=True),
    Case(normalization="exp", bias="rows", padding=True),
    Case(normalization="relu2", documents=True, padding=True, gqa=True),
    Case(dtype="float32", bias="decay", documents=True, dropout=0.2),
    Case(backend="blockwise", normalization="relu2", bias="decay", causal=False, dropout=0.2),
    Case(backend="blockwise", gqa=True, documents=True, padding=True),
]


def test_two_processes_equal_one_and_refuse_bad_use_in_one_line(tmp_path):
    _run(FAST_CASES, 2, tmp_path, refusals=True)
    for rank in range(2):
        messages = json.loads((tmp_path / f"refusals{rank}.json").read_text())
        for case, message in messages.items():
            assert "\n" not in message, case
        assert "shards of unequal length" in messages["unequal shards"]
        assert "pad it to a multiple of 4" in messages["layout does not divide"]
        assert "size of 3 does not divide the 2 processes" in messages["group does not divide"]
        assert "dense (L, L) term" in messages["dense term"]
        assert "urpe.Toeplitz" in messages["dense term"]
        assert "attn_mask" in messages["attn_mask"]
        assert "a relation term" in messages["relation"]


def _matrix() -> list[Case]:
    cases = []
    for layout, causal, norm, bias in itertools.product(
        LAYOUTS, (True, False), ("softmax", "exp", "l2", "relu2"), ("toeplitz", "decay", None)
    ):
        base = Case(layout=layout, causal=causal, normalization=norm, bias=bias)
        cases += [
            base,
            replace(base, documents=True, padding=True, gqa=True, gate=False),
            replace(base, dropout=0.25, dtype="float32", documents=True),
        ]
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("processes", [2, 4])
def test_every_combination_equals_one_process(processes, tmp_path):
    _run(_matrix(), processes, tmp_path)


@pytest.mark.slow
def test_four_processes_equal_one(tmp_path):
    cases = [
        Case(bias="decay", documents=True, padding=True, dropout=0.2),
        Case(layout="contiguous", normalization="relu2", gqa=True, documents=True),
    ]
    _run(cases, 4, tmp_path)


def test_layouts_place_every_position_once():
    for name, size in itertools.product(LAYOUTS, (1, 2, 3, 4)):
        split = ShardLayout(name, size)
        shard_length = 12 if name == "contiguous" else 6
        seen = sorted(int(p) for rank in range(size) for p in split.positions(rank, shard_length))
        assert seen == list(range(shard_length * size))
    with pytest.raises(ValueError, match="multiple of 8"):
        ShardLayout("zigzag", 4).check_length(12)
    with pytest.raises(ValueError, match="layout must be one of"):
        ShardLayout("striped", 2)


@pytest.mark.parametrize("layout", ["zigzag", pytest.param("contiguous", marks=pytest.mark.slow)])
def test_models_given_a_context_parallel_group_equal_one_process(layout, tmp_path):
    mp.spawn(model_worker, args=(2, _free_port(), layout, str(tmp_path)), nprocs=2)
    for rank in range(2):
        results = json.loads((tmp_path / f"models{rank}.json").read_text())
        for setting, errors in zip(MODELS, results, strict=True):
            worst = max(errors, key=errors.get)
            assert errors[worst] < 1e-10, (rank, setting, worst, errors[worst])


@pytest.mark.slow  # 4 processes: ~40 s each on a loaded 2-core machine
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_data_parallel_over_context_parallel_groups_equals_one_process(wrapper, tmp_path):
    # dp = 2 x cp = 2 on 4 gloo processes: every parameter's gradient, reduced by DDP (or
    # reduce-scattered by FSDP2 over the flattened mesh), is the one-process gradient
    mp.spawn(mesh_worker, args=(4, _free_port(), 2, wrapper, str(tmp_path)), nprocs=4)
    for rank in range(4):
        errors = json.loads((tmp_path / f"mesh{rank}.json").read_text())
        assert errors.pop("missing") == 0
        worst = max(errors, key=errors.get)
        assert errors[worst] < 1e-10, (rank, worst, errors[worst])
