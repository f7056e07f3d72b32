"""Covering arrays (benchmarks/harness/covering.py): every combination of any t factors'
values, in few rows. The Triton compile matrix rests on them (benchmarks/compile_kernels.py)."""

from __future__ import annotations

import itertools
import math

import pytest

from harness.covering import all_combinations, covered, covering_rows

FACTORS = dict(
    a=(0, 1, 2, 3),
    b=("x", "y", "z"),
    c=(False, True),
    d=(False, True),
    e=(1, 2, 16),
    f=(False, True),
    g=("p", "q", "r", "s"),
)


@pytest.mark.parametrize("strength", [1, 2, 3])
def test_the_rows_hold_every_combination_of_t_factors(strength):
    rows = covering_rows(FACTORS, strength)
    assert covered(rows, FACTORS, strength) == all_combinations(FACTORS, strength)
    for row in rows:  # complete rows of valid values
        assert set(row) == set(FACTORS) and all(row[n] in FACTORS[n] for n in FACTORS)
    # far fewer than the full product, at least as many as the largest t factors need
    largest = sorted((len(v) for v in FACTORS.values()), reverse=True)[:strength]
    assert math.prod(largest) <= len(rows) < math.prod(len(v) for v in FACTORS.values()) / 4


def test_every_combination_is_counted_once_and_the_rows_are_reproducible():
    combos = all_combinations(FACTORS, 2)
    pairs = itertools.combinations(FACTORS.values(), 2)
    assert len(combos) == sum(len(x) * len(y) for x, y in pairs)
    assert covering_rows(FACTORS, 2) == covering_rows(FACTORS, 2)


def test_one_factor_or_a_strength_above_the_factor_count_gives_the_product():
    assert covering_rows(dict(a=(1, 2, 3)), 2) == [dict(a=1), dict(a=2), dict(a=3)]
    rows = covering_rows(dict(a=(1, 2), b=(3, 4)), 5)
    assert sorted((r["a"], r["b"]) for r in rows) == [(1, 3), (1, 4), (2, 3), (2, 4)]
