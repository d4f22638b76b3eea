"""A dataset column as a reward receives it (TRL passes every column as a keyword), checked
against the batch: shared by the single-turn rewards that read task columns."""
from __future__ import annotations


def column(columns: dict, name: str, n: int, reward: str) -> list | None:
    """`columns[name]` as a list of `n` values, or None when the batch has no such column;
    a length other than the completions' is a ValueError naming `reward` and the column."""
    col = columns.get(name)
    if col is None:
        return None
    col = list(col)
    if len(col) != n:
        raise ValueError(f"{reward}: {n} completions but {len(col)} values in column {name!r}")
    return col
