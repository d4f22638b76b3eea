"""The edit that undoes an injected bug, as the `replace` tool takes it: the buggy text
(occurring exactly once in the buggy file) and what to put there."""
from __future__ import annotations


def fix_edit(buggy: str, start: int, bug_snip: str, good_snip: str) -> tuple[str, str]:
    """(old, new) for replace(): `bug_snip` sits at `start` in `buggy` and must become
    `good_snip`. The snippet alone when it occurs once and is not empty (the shortest
    edit, what a small model copies best); else widened to whole lines, then a line more
    on each side, until the old text occurs once."""
    if buggy[start:start + len(bug_snip)] != bug_snip:
        raise ValueError("fix_edit: the snippet is not at that position")
    if bug_snip.strip() and buggy.count(bug_snip) == 1:
        return bug_snip, good_snip
    a = buggy.rfind("\n", 0, start) + 1
    e = buggy.find("\n", start + len(bug_snip))
    e = len(buggy) if e == -1 else e + 1
    while True:
        old = buggy[a:e]
        if old.strip() and buggy.count(old) == 1:
            break
        if a == 0 and e == len(buggy):
            break
        if a > 0:
            a = buggy.rfind("\n", 0, a - 1) + 1
        if e < len(buggy):
            nxt = buggy.find("\n", e)
            e = len(buggy) if nxt == -1 else nxt + 1
    left, right = buggy[a:start], buggy[start + len(bug_snip):e]
    return left + bug_snip + right, left + good_snip + right
