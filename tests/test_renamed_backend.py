"""The backend "fused" is called "blockwise" now; the old name keeps working everywhere it was
written down (calls, configs and checkpoints, command lines, benchmark rows and flags), with one
DeprecationWarning per process."""

from __future__ import annotations

import warnings

import pytest
import torch

from urpe import TransformerConfig
from urpe.cli import build_parser
from urpe.kernels import Toeplitz, attention, backends, select_backend

F64 = dict(dtype=torch.float64)


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Forget which deprecations were already announced in this process."""
    monkeypatch.setattr(backends, "_WARNED", set())


def test_the_old_name_runs_the_blockwise_kernel_and_warns_once(fresh_warnings):
    q = torch.randn(1, 2, 6, 4, **F64)
    gate = Toeplitz(torch.rand(2, 5, **F64))
    with pytest.warns(DeprecationWarning, match="backend 'fused' is deprecated.*'blockwise'"):
        old = attention(q, q, q, gate=gate, backend="fused")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second use is quiet
        again = attention(q, q, q, gate=gate, backend="fused")
        assert select_backend("fused", q, q, q, gate=gate).name == "blockwise"
    new = attention(q, q, q, gate=gate, backend="blockwise")
    assert torch.equal(old, new) and torch.equal(again, new)


def test_a_config_or_checkpoint_that_says_fused_loads_as_blockwise(fresh_warnings):
    saved = dict(vocab_size=7, attention_backend="fused")  # as an old checkpoint records it
    with pytest.warns(DeprecationWarning, match="'fused' is deprecated"):
        config = TransformerConfig(**saved)
    assert config.attention_backend == "blockwise"


def test_old_command_line_flags_and_benchmark_rows(fresh_warnings):
    argv = ["reproduce", "synthetic", "--tasks", "probe", "--backend", "fused"]
    with pytest.warns(DeprecationWarning):
        assert build_parser(argv).parse_args(argv).backend == "blockwise"
    argv = ["bench", "attention", "--rows", "fused_urpe", "fused_rpe", "--fused-max-length", "64"]
    args = build_parser(argv).parse_args(argv)
    assert args.rows == ["blockwise_urpe", "blockwise_rpe"] and args.blockwise_max_length == 64
