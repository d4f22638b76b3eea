"""`timed`: the wall-clock seconds of a block, for the loop's time/* metrics."""
from __future__ import annotations

import time


class timed:
    """`with timed("sample", into=seconds) as t:` ... then `t.seconds` (also stored as
    `seconds["sample"]` when `into` is given); `t.start` and `t.end` are perf_counter
    readings, for overlaps between blocks that ran in different threads."""

    def __init__(self, name: str, into: dict[str, float] | None = None):
        self.name, self.into = name, into
        self.start = self.end = self.seconds = 0.0

    def __enter__(self) -> timed:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.end = time.perf_counter()
        self.seconds = self.end - self.start
        if self.into is not None:
            self.into[self.name] = self.seconds
