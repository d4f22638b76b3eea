"""The train/test split of the procedural task generators (every domain's data.py, the
toy's tasks): a task belongs to a split by a stable hash of its key (its prompt text), so
a generator can draw tasks at random and keep those of the split it is asked for, and
the held-out split never leaks into training, whatever the seed or the number drawn.
Python's own hash() is salted per process, hence blake2b. Changing this function changes
every domain's datasets: tests pin their contents."""
from __future__ import annotations

import hashlib


def split_of(key: str, test_fraction: float) -> str:
    """'test' for about `test_fraction` of all keys, 'train' for the rest."""
    h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")
    return "test" if (h % 10_000) < test_fraction * 10_000 else "train"
