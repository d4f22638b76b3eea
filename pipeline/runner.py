"""The stage runner: stages in topological order, each reused when its settings and its
upstream runs are unchanged, resumed or redone when it was killed.

A stage's hash covers its settings (JSON-able, paths inside the run folder written as
$OUT by `normalize`) and its upstream stages' hashes; ROOT/stages/<stage>.json records
hash, status, run id, upstream run ids and outputs. A stage is reused when it finished
with the same hash from the same upstream runs (every finished stage gets a new run id,
so a rerun upstream stage invalidates everything downstream of it). `force` (names or
globs) redoes stages; a stage killed mid-way (status "running") starts over in a fresh
folder, or, if `resumable`, resumes (ctx.resume) when its hash still matches.
"""
from __future__ import annotations

import datetime
import fnmatch
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from core import exitcodes
from core.config import dump_yaml

REPO = Path(__file__).resolve().parents[1]


class StageUnreachable(RuntimeError, exitcodes.Unreachable):
    """A stage's process exited with exitcodes.UNREACHABLE (a server or store it needs is down)."""


@dataclass
class StageContext:
    name: str
    out: Path | None               # the stage's folder (fresh unless resuming)
    resume: bool                   # a killed run of this stage with the same hash left state behind
    inputs: dict[str, dict]        # upstream stage name -> its outputs
    hash: str
    seconds: dict[str, float]      # seconds of the stages finished (or reused) so far
    concurrent: bool = False       # other stages may be running beside this one right now
    log: Path | None = None        # where a concurrent stage writes its output
    parent_run_id: str | None = None   # the MLflow run the stage's own runs nest under
    wall_seconds: float = 0.0      # seconds since the runner's start clock when this stage started


@dataclass
class Stage:
    name: str
    settings: Any                  # JSON-able: everything that decides the stage's output
    fn: Callable[[StageContext], dict]
    deps: list[str] = field(default_factory=list)
    out: Path | None = None
    resumable: bool = False        # a killed run resumes (ctx.resume) instead of starting over
    always: bool = False           # never reused (the report)
    # may run beside other concurrent stages (StageRunner(jobs > 1)): it must not share this
    # process's torch threads or MLflow run state with them (subprocess, or one thread)
    concurrent: bool = False
    cost: float = 0.0              # rough size: among concurrent stages ready together, the longest
                                   # chain of them (this cost plus its dependents') goes first
    # what `--dry-run` shows of it (model, teachers, quant, dtype): its effective settings as
    # the stage will run them, read from its resolved config; not hashed
    shows: dict = field(default_factory=dict)


def stable_hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def normalize(obj: Any, root: str | Path) -> Any:
    """Settings with the run folder `root` written as $OUT, so a moved folder keeps its hashes."""
    root = str(root)
    if isinstance(obj, str):
        return obj.replace(root, "$OUT")
    if isinstance(obj, dict):
        return {k: normalize(v, root) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [normalize(v, root) for v in obj]
    return obj


def say(msg: str):
    print(f"[pipeline] {msg}", file=sys.stderr, flush=True)


def _path_outputs_exist(outputs: dict) -> bool:
    """A reused stage's checkpoints must still be on disk."""
    for k in ("checkpoint", "final", "path"):
        v = outputs.get(k)
        if isinstance(v, str) and v and not Path(v).exists():
            return False
    for v in (outputs.get("paths") or {}).values():
        if isinstance(v, str) and not Path(v).exists():
            return False
    return True


class StageRunner:
    """Runs stages in the given (topological) order with hash-based reuse.

    Each stage's marker, root/stages/<name>.json: {"hash", "status": "running"|"done",
    "run_id", "upstream": {dep: run_id}, "outputs", "seconds"}. `parent_run_id` (the MLflow
    run the stages' runs nest under) and `started` (a time.perf_counter() value, default
    now) are handed to each stage in its StageContext."""

    def __init__(self, root: str | Path, force: list[str] | tuple = (), log: Callable[[str], None] | None = None,
                 jobs: int = 1, parent_run_id: str | None = None, started: float | None = None):
        self.root = Path(root)
        self.jobs = max(1, int(jobs))
        self.heartbeat_s = 60.0        # with jobs > 1: a status line this often while stages run
        self.parent_run_id = parent_run_id
        self.started = time.perf_counter() if started is None else started
        self._n, self._index = 0, {}
        self.force = list(force)
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.state_dir = self.root / "stages"
        self.hashes: dict[str, str] = {}
        self.run_ids: dict[str, str] = {}
        self.outputs: dict[str, dict] = {}
        self.seconds: dict[str, float] = {}
        self.status: dict[str, str] = {}      # cached | ran | resumed

    def marker_path(self, name: str) -> Path:
        return self.state_dir / (name.replace("/", "__") + ".json")

    def read_marker(self, name: str) -> dict | None:
        p = self.marker_path(name)
        try:
            return json.loads(p.read_text()) if p.exists() else None
        except json.JSONDecodeError:
            return None

    def _write_marker(self, name: str, data: dict):
        p = self.marker_path(name)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str))
        tmp.replace(p)

    def check(self, stages: list[Stage]):
        names = [s.name for s in stages]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate stage names in {names}")
        seen: set[str] = set()
        for s in stages:
            missing = [d for d in s.deps if d not in seen]
            if missing:
                raise ValueError(f"stage {s.name!r} depends on {missing}, which do not come before it")
            seen.add(s.name)
        for pat in self.force:
            if not any(fnmatch.fnmatchcase(n, pat) for n in names):
                raise ValueError(f"--force {pat!r} matches no stage; stages: {', '.join(names)}")

    def forced(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pat) for pat in self.force)

    def stage_hash(self, stage: Stage, hashes: dict[str, str]) -> str:
        return stable_hash({"stage": stage.name, "settings": stage.settings,
                            "upstream": {d: hashes[d] for d in stage.deps}})

    def decide(self, stage: Stage, h: str, run_ids: dict[str, str]) -> tuple[str, dict | None]:
        """'cached', 'resume' or 'run', and the marker."""
        m = self.read_marker(stage.name)
        upstream = {d: run_ids[d] for d in stage.deps}
        same = m is not None and m.get("hash") == h and m.get("upstream") == upstream
        if same and not stage.always and not self.forced(stage.name):
            if m.get("status") == "done" and _path_outputs_exist(m.get("outputs") or {}):
                return "cached", m
            if m.get("status") == "running" and stage.resumable:
                return "resume", m
        return "run", m

    def plan(self, stages: list[Stage]) -> list[tuple[str, str, str]]:
        """[(stage, hash, 'cached' | 'resume' | 'run')] without running anything."""
        self.check(stages)
        hashes, run_ids, out = {}, {}, []
        for s in stages:
            h = self.stage_hash(s, hashes)
            what, m = self.decide(s, h, run_ids)
            hashes[s.name] = h
            run_ids[s.name] = m["run_id"] if what in ("cached", "resume") else f"new-{uuid.uuid4().hex}"
            out.append((s.name, h, what))
        return out

    def run(self, stages: list[Stage]) -> dict[str, dict]:
        """Run every stage; with jobs > 1, concurrent stages whose upstream stages are done
        run side by side (at most `jobs`), and any other stage runs alone, in list order."""
        self.check(stages)
        self._n = len(stages)
        self._index = {s.name: i for i, s in enumerate(stages, 1)}
        for s in stages:  # hashes depend on settings only: known up front
            self.hashes[s.name] = self.stage_hash(s, self.hashes)
        if self.jobs <= 1:
            for s in stages:
                self._run_one(s, concurrent=False)
            return self.outputs
        self._run_side_by_side(stages)
        return self.outputs

    def _run_side_by_side(self, stages: list[Stage]):
        # Priority: a stage's cost plus the costliest chain of concurrent stages after it
        # (the critical path), so that e.g. the chat RM, which chat RL waits on, is not left
        # to the end.
        prio: dict[str, float] = {}
        for s in reversed(stages):
            after = [prio[t.name] for t in stages if s.name in t.deps and t.concurrent]
            prio[s.name] = s.cost + max(after, default=0.0)
        pending = list(stages)
        running: dict = {}            # future -> stage
        error: BaseException | None = None
        with ThreadPoolExecutor(max_workers=self.jobs) as pool:
            while (pending and error is None) or running:
                ready = [s for s in pending if all(d in self.outputs for d in s.deps)] if error is None else []
                started = False
                for s in ready:
                    decision = self.decide(s, self.hashes[s.name], self.run_ids)
                    if decision[0] == "cached":
                        pending.remove(s)
                        self._run_one(s, concurrent=False, decision=decision)   # only takes its marker
                        started = True
                if started:
                    continue
                free = self.jobs - len(running)
                conc = sorted((s for s in ready if s.concurrent), key=lambda s: -prio[s.name])
                if conc and free > 0:
                    for s in conc[:free]:
                        pending.remove(s)
                        running[pool.submit(self._run_one, s, True)] = s
                    continue
                first = ready[0] if ready else None     # in list order; [] once a stage failed
                if first is not None and not first.concurrent and not running:
                    pending.remove(first)
                    self._run_one(first, concurrent=False)
                    continue
                if not running:
                    if error is None and pending:
                        raise RuntimeError(f"pipeline: stages {[s.name for s in pending]} can never start")
                    break
                done, _ = wait(list(running), timeout=self.heartbeat_s, return_when=FIRST_COMPLETED)
                if not done:   # still running: one line on where each side-by-side stage is
                    self.log("  ... " + "; ".join(f"{s.name} {self._progress(s.name)}" for s in running.values()))
                for f in done:
                    s = running.pop(f)
                    if f.exception() is not None and error is None:
                        error = f.exception()
                        self.log(f"[{self._index[s.name]}/{self._n}] {s.name}: failed ({error}); "
                                 f"waiting for the {len(running)} stage(s) still running")
        if error is not None:
            raise error

    def _run_one(self, s: Stage, concurrent: bool, decision: tuple[str, dict | None] | None = None):
        h = self.hashes[s.name]
        what, m = decision or self.decide(s, h, self.run_ids)
        tag = f"[{self._index.get(s.name, 0)}/{self._n}] {s.name}"
        if what == "cached":
            self.run_ids[s.name] = m["run_id"]
            self.seconds[s.name] = float(m.get("seconds") or 0.0)
            self.status[s.name] = "cached"
            self.outputs[s.name] = m.get("outputs") or {}
            self.log(f"{tag}: reused (hash {h}; it ran {self.seconds[s.name]:.1f} s)")
            return
        resume = what == "resume"
        run_id = m["run_id"] if resume else uuid.uuid4().hex
        if not resume and s.out is not None and s.out.exists():
            shutil.rmtree(s.out)
        self.log(f"{tag}: {'resuming' if resume else 'running'} (hash {h})"
                 + (" [forced]" if self.forced(s.name) else "")
                 + (" [side by side]" if concurrent else ""))
        upstream = {d: self.run_ids[d] for d in s.deps}
        prev_s = 0.0
        if resume and m:
            killed = _attempt_seconds(m.get("started"), s.out)
            prev_s = float(m.get("seconds_so_far", 0.0)) + killed
            self.log(f"{tag}: the killed attempt ran >= {killed:.0f} s (to its last write in {s.out})")
        started = _now()
        self._write_marker(s.name, {"name": s.name, "hash": h, "status": "running", "run_id": run_id,
                                    "upstream": upstream, "started": started, "seconds_so_far": prev_s})
        ctx = StageContext(name=s.name, out=s.out, resume=resume,
                           inputs={d: self.outputs[d] for d in s.deps}, hash=h, seconds=dict(self.seconds),
                           concurrent=concurrent, log=self.log_path(s.name), parent_run_id=self.parent_run_id,
                           wall_seconds=time.perf_counter() - self.started)
        t0 = time.perf_counter()
        outputs = s.fn(ctx) or {}
        secs = prev_s + time.perf_counter() - t0
        self._write_marker(s.name, {"name": s.name, "hash": h, "status": "done", "run_id": run_id,
                                    "upstream": upstream, "started": started, "finished": _now(),
                                    "seconds": round(secs, 2),
                                    "outputs": outputs})
        self.run_ids[s.name] = run_id
        self.seconds[s.name] = secs
        self.status[s.name] = "resumed" if resume else "ran"
        self.outputs[s.name] = outputs     # last: marks the stage done for the scheduler
        self.log(f"{tag}: done in {secs:.1f} s")

    def _progress(self, name: str) -> str:
        """'3m10s, 120/400' from the stage's marker and the last progress bar in its log."""
        m = self.read_marker(name) or {}
        out = ""
        try:
            el = (datetime.datetime.now() - datetime.datetime.fromisoformat(m["started"])).total_seconds()
            out = f"{int(el // 60)}m{int(el % 60):02d}s"
        except (KeyError, ValueError):
            pass
        try:
            with open(self.log_path(name), "rb") as fh:
                fh.seek(0, 2)
                fh.seek(max(0, fh.tell() - 4096))
                bars = re.findall(r"(\d+)/(\d+) \[", fh.read().decode(errors="replace"))
            if bars:
                out += f", {bars[-1][0]}/{bars[-1][1]}"
        except OSError:
            pass
        return out or "running"

    def log_path(self, name: str) -> Path:
        """Where a stage run side by side writes its output (its progress bars would interleave)."""
        return self.root / "logs" / (name.replace("/", "__") + ".log")


def run_in_subprocess(ctx: StageContext, module: str, cfg) -> dict:
    """`python -m <module> --config <cfg as yaml> --out ctx.out`, output to the stage's log
    file; returns its summary.json. Everything the process needs (MLflow store, parent run)
    is in `cfg`. A failure raises with the log's tail."""
    log = ctx.log or ctx.out.parent / f"{ctx.out.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cfg_path = log.with_suffix(".yaml")
    cfg_path.write_text(dump_yaml(cfg))
    cmd = [sys.executable, "-m", module, "--config", str(cfg_path), "--out", str(ctx.out)]
    # the repository on the path, so the module imports without an installed package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    say(f"{ctx.name}: in its own process, output in {log}")
    with open(log, "w") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=str(REPO), env=env).returncode
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        # a stage that lost a dependency (exit 3) makes the pipeline exit 3 too: retry later, not fix
        err = StageUnreachable if rc == exitcodes.UNREACHABLE else RuntimeError
        raise err(f"stage {ctx.name} failed (exit {rc}); last lines of {log}:\n{tail}")
    return json.loads((ctx.out / "summary.json").read_text())


def _attempt_seconds(started: str | None, out: Path | None) -> float:
    """Seconds a killed attempt ran, from its start to the newest file it wrote under `out`
    (a lower bound: whatever it did after its last write is lost with it)."""
    if not started or out is None or not out.exists():
        return 0.0
    try:
        t0 = datetime.datetime.fromisoformat(started).timestamp()
    except ValueError:
        return 0.0
    newest = max((f.stat().st_mtime for f in out.rglob("*") if f.is_file()), default=t0)
    return max(0.0, newest - t0)


def _now() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")
