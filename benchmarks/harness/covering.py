"""Covering arrays: few rows that hold every combination of any `strength` factors' values.

A kernel has too many variants to compile them all (four bias kinds x four gate kinds x four
normalisations x masks x dropout x ...: thousands per tile configuration), but a problem such
as a register spill appears when a few features meet. A covering array of strength t is a set
of rows (one value per factor) in which every combination of values of every t factors occurs
at least once: for 10 factors of 2 to 4 values, strength 2 needs about 20 rows and strength 3
about 80, where the full product has thousands.

The rows are built greedily (AETG's rule, deterministic): start each row from the first
combination not yet covered and give every other factor the value that covers most of what is
still missing.
"""

from __future__ import annotations

import itertools


def _combinations(row: dict, names: tuple[str, ...], strength: int):
    """The t-combinations (tuples of (name, value)) a complete or partial row holds."""
    present = [n for n in names if n in row]
    for chosen in itertools.combinations(present, strength):
        yield tuple((n, row[n]) for n in chosen)


def all_combinations(factors: dict[str, tuple], strength: int) -> set[tuple]:
    """Every combination of values of every `strength` factors."""
    names = tuple(factors)
    found = set()
    for chosen in itertools.combinations(names, min(strength, len(names))):
        for values in itertools.product(*(factors[n] for n in chosen)):
            found.add(tuple(zip(chosen, values, strict=True)))
    return found


def covered(rows: list[dict], factors: dict[str, tuple], strength: int) -> set[tuple]:
    """The combinations the rows hold."""
    names = tuple(factors)
    strength = min(strength, len(names))
    return {c for row in rows for c in _combinations(row, names, strength)}


def covering_rows(factors: dict[str, tuple], strength: int = 2) -> list[dict]:
    """Rows (dicts factor -> value) holding every combination of `strength` factors' values."""
    names = tuple(factors)
    strength = min(strength, len(names))
    missing = all_combinations(factors, strength)
    order = {n: i for i, n in enumerate(names)}
    rows = []
    while missing:
        start = min(missing, key=lambda c: [(order[n], factors[n].index(v)) for n, v in c])
        row = dict(start)
        for name in (n for n in names if n not in row):
            gains = []  # per value: the missing combinations it would cover with the row so far
            for value in factors[name]:
                trial = dict(row, **{name: value})
                new = (c for c in _combinations(trial, names, strength) if (name, value) in c)
                gains.append(sum(c in missing for c in new))
            row[name] = factors[name][gains.index(max(gains))]  # the first value among equals
        rows.append({n: row[n] for n in names})
        missing -= set(_combinations(row, names, strength))
    return rows
