"""One writer per output folder, and the checks an output folder gets before anything is
written into it.

`hold_out_dir(out, what)` takes an exclusive lock on OUT/.mopd.lock (fcntl.flock) before
a command writes anything there (checkpoints, config.yaml, the MLflow store); the file
names the holder (pid, host, command, start time). A second command on the same folder
is refused at once with an error naming that holder. The OS drops a flock when its
process dies, however it dies, so a lock left by a killed run never blocks: the next run
takes it and says whose it was.

Nested writers. Every command locks its own --out; a folder inside a locked one is
refused too, unless the holder is this process (the pipeline and the toy run some
stages in-process: `mopd` in DIR/mopd) or one of its ancestors: the holder's token is
put in $MOPD_LOCK_TOKENS, which the stages it starts as subprocesses (`python -m
pipeline.expert --out DIR/experts/...`) inherit. So a pipeline's own stages go through,
and a stray `mopd distill --out DIR/mopd` beside a running pipeline is refused. The other
way round too: a folder that holds, at any depth, a folder another run has locked is
refused (`mopd pipeline --out DIR` while `mopd distill --out DIR/sub/x` runs).
Within one process the lock is re-entrant (a test that resumes a run in the same
process, after a failure left the first run's frame alive, is the same writer).
"""
from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
import sqlite3
import sys
import threading
import uuid
import weakref
from pathlib import Path

LOCK_NAME = ".mopd.lock"
ENV = "MOPD_LOCK_TOKENS"


class OutDirError(ValueError):
    """An output folder that cannot be used: in use by another run, a file, not writable."""


_mutex = threading.Lock()
_held: dict[Path, dict] = {}     # resolved folder -> {"fd", "token", "count"} this process holds


def _describe(info: dict) -> str:
    if not info:
        return "another process (its lock file names none)"
    return (f"pid {info.get('pid', '?')} on {info.get('host', '?')} ({info.get('command', '?')}), "
            f"started {info.get('started', '?')}")


def _read_info(path: Path) -> dict:
    try:
        text = path.read_text(errors="replace").strip()
        return json.loads(text) if text else {}
    except (OSError, json.JSONDecodeError):
        return {}


# the locks of the processes that started this one (read once: later this process puts
# its own tokens into the variable too, for its children)
_INHERITED = frozenset(t for t in os.environ.get(ENV, "").split(",") if t)


def _inherited_tokens() -> frozenset[str]:
    return _INHERITED


def _export_tokens():
    """This process's held tokens (and the inherited ones) in $MOPD_LOCK_TOKENS, for the
    subprocesses it starts."""
    tokens = set(_INHERITED) | {h["token"] for h in _held.values()}
    if tokens:
        os.environ[ENV] = ",".join(sorted(tokens))
    else:
        os.environ.pop(ENV, None)


def check_out_dir(out: str | Path, flag: str = "--out") -> Path:
    """`out` resolved and created, or an OutDirError: a file where the folder should be
    (or above it), a folder that cannot be created or written."""
    p = Path(out).expanduser().resolve()
    for q in (p, *p.parents):
        if q.exists() and not q.is_dir():
            what = "is a file" if q == p else f"cannot be created: {q} is a file"
            raise OutDirError(f"{flag} {out}: {what}, not a folder")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutDirError(f"{flag} {out}: cannot create the folder ({e.strerror or e})") from None
    if not os.access(p, os.W_OK | os.X_OK):
        raise OutDirError(f"{flag} {out}: the folder is not writable")
    return p


def _ancestor_holder(p: Path) -> tuple[Path, dict] | None:
    """An enclosing folder locked by a run that is not this process or an ancestor of it."""
    mine = _inherited_tokens()
    for q in p.parents:
        f = q / LOCK_NAME
        if q in _held or not f.is_file():
            continue
        info = _held_by_other(f, mine)
        if info is not None:
            return q, info
    return None


def _held_by_other(f: Path, mine: frozenset[str]) -> dict | None:
    """The holder of lock file `f` when a live run that is not us (nor a run that started
    us) holds it; None for a free (stale) lock file or one of ours."""
    info = _read_info(f)
    if info.get("token") in mine:
        return None
    try:
        fd = os.open(f, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)      # free: a stale file
        return None
    except OSError:
        return info
    finally:
        os.close(fd)


def _descendant_holder(p: Path) -> tuple[Path, dict] | None:
    """A folder below `p`, at any depth, locked by a run that is not this process or an
    ancestor of it (symlinks are not followed: a link out of the tree is not inside it)."""
    mine = _inherited_tokens()
    todo = [p]
    while todo:
        q = todo.pop()
        try:
            entries = list(os.scandir(q))
        except OSError:
            continue
        for e in entries:
            try:
                if not e.is_dir(follow_symlinks=False):
                    continue
            except OSError:
                continue
            sub = Path(e.path)
            todo.append(sub)
            f = sub / LOCK_NAME
            if sub not in _held and f.is_file():
                info = _held_by_other(f, mine)
                if info is not None:
                    return sub, info
    return None


class OutDirLock:
    """A held lock on one folder; released by release(), at the end of a `with`, when the
    object is dropped, or when the process ends."""

    def __init__(self, folder: Path, delegated: bool = False):
        self.folder, self.delegated = folder, delegated
        self._finalizer = weakref.finalize(self, _release, folder) if not delegated else None

    def release(self):
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def _release(folder: Path):
    with _mutex:
        h = _held.get(folder)
        if h is None:
            return
        h["count"] -= 1
        if h["count"] > 0:
            return
        del _held[folder]
        try:
            os.ftruncate(h["fd"], 0)   # an empty file: released cleanly (non-empty: its holder died)
        except OSError:
            pass
        # A run that stopped before writing anything (a config error) leaves no folder
        # behind when it made the folder itself.
        try:
            if h.get("created") and [c.name for c in folder.iterdir()] == [LOCK_NAME]:
                (folder / LOCK_NAME).unlink()
                folder.rmdir()
        except OSError:
            pass
        fcntl.flock(h["fd"], fcntl.LOCK_UN)
        os.close(h["fd"])
        _export_tokens()


def hold_out_dir(out: str | Path, what: str, flag: str = "--out") -> OutDirLock:
    """Lock `out` (created if needed) for this process before anything is written into
    it; an OutDirError naming the holder when another run has it or an enclosing folder."""
    created = not Path(out).expanduser().resolve().exists()
    p = check_out_dir(out, flag)
    with _mutex:
        if p in _held:
            _held[p]["count"] += 1
            return OutDirLock(p)
        outer = _ancestor_holder(p)
        if outer is not None:
            raise OutDirError(f"{flag} {out} is inside {outer[0]}, which another run is writing to: "
                              f"{_describe(outer[1])}; wait for it to finish or choose another {flag}")
        inner = _descendant_holder(p)
        if inner is not None:
            raise OutDirError(f"{flag} {out} holds {inner[0]}, which another run is writing to: "
                              f"{_describe(inner[1])}; wait for it to finish or choose another {flag}")
        f = p / LOCK_NAME
        try:
            fd = os.open(f, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise OutDirError(f"{flag} {out}: cannot write in the folder ({e.strerror or e})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            info = _read_info(f)
            if info.get("token") and info["token"] in _inherited_tokens():
                return OutDirLock(p, delegated=True)     # our parent holds it and started us
            raise OutDirError(f"{flag} {out} is in use by another run: {_describe(info)}; wait for it "
                              f"to finish or choose another {flag}") from None
        prev = _read_info(f)
        if prev:
            print(f"[mopd] {p}: taking over the lock of {_describe(prev)}, which ended without "
                  "releasing it (no longer running)", file=sys.stderr)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "what": what,
                "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:500] if sys.argv else what,
                "started": datetime.datetime.now().isoformat(timespec="seconds"), "token": uuid.uuid4().hex}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        os.fsync(fd)
        _held[p] = {"fd": fd, "token": info["token"], "count": 1, "created": created}
        _export_tokens()
        return OutDirLock(p)


def check_store(uri: str) -> None:
    """A local sqlite MLflow store that exists must be a readable database (a corrupt
    mlflow.db otherwise fails deep inside MLflow's migrations, after the models loaded)."""
    if not uri.startswith("sqlite:///"):
        return
    path = Path(uri[len("sqlite:///"):])
    if not path.exists():
        return
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            con.execute("PRAGMA schema_version").fetchone()
            con.execute("SELECT name FROM sqlite_master LIMIT 1").fetchall()
        finally:
            con.close()
    except sqlite3.DatabaseError as e:
        raise OutDirError(f"the MLflow store {path} is not a readable sqlite database ({e}): move it "
                          "away (or point mlflow.tracking_uri elsewhere) and rerun") from None
