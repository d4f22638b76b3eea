"""`mopd pipeline --config recipes/pipeline/tiny.yaml --out DIR`: every stage, from the
common base to the report, as one cached, resumable run.

Stages (each is its own MLflow run, nested under one parent run for DIR):

    data                      MOPD train prompts per teacher key -> DIR/data/<domain>[-<effort>]/
    base                      experts.base.build_base (recipes/base/tiny.yaml) -> DIR/base/model
    expert/<key>/sft          experts.run.run_expert, SFT from the base, QAT on
    chat_rm                   (chat only) the reward model the chat expert is trained and scored with,
                              started from the chat SFT checkpoint (experts.chat_rm.init)
    expert/<key>/rl           ... then RL from the SFT checkpoint; registered as <domain>[-<effort>]-expert@teacher
    mopd                      mopd.train.run: one student from the base, every expert a teacher (vLLM sampling)
    baseline/seq_kd           off-policy sequence-level KD with MOPD's student-token budget
    baseline/weight_avg       uniform parameter average of the experts
    eval/<model>              held-out scores (evals.run) of base, each teacher, student, baselines
    report                    DIR/eval.json, DIR/report.{json,md}, DIR/retention.png, DIR/kl_curves.png

A teacher key is "domain" or "domain/effort" (math has low and high), the same key the
MOPD recipe's `teachers` and the eval columns use.

Caching: a stage's hash covers its resolved settings (paths inside DIR written as $OUT)
and its upstream stages' hashes; DIR/stages/<stage>.json records hash, status and outputs.
A stage is reused when it finished with the same hash from the same upstream runs (every
finished stage gets a run id; a rerun upstream stage has a new one), so an edit redoes
the stages it changes and everything downstream of them, and nothing else. `--force STAGE`
(a name or a glob such as 'eval/*') redoes that stage (and so its dependents). A stage
that was killed (status "running") is redone from scratch, except `mopd`, which resumes
from its last checkpoint (train.save_every) when its hash still matches. Code changes
are not part of any hash: after editing code, --force the stages it touches.

Relative paths in the config (recipes) are read from the working directory, else from
the repository root.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import fnmatch
import hashlib
import json
import os
import shutil
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- config
@dataclass
class BaseSection:
    recipe: str = "recipes/base/tiny.yaml"
    overrides: list[str] = field(default_factory=list)   # key=value for the BaseConfig


@dataclass
class StageOverrides:
    sft: list[str] = field(default_factory=list)          # key=value for the SFT ExpertConfig
    rl: list[str] = field(default_factory=list)           # key=value for the RL ExpertConfig


@dataclass
class ChatRMSection:
    """experts/chat/train_rm.py settings (only when chat is one of the domains)."""
    steps: int = 300
    n_pairs: int = 4000
    n_heldout: int = 400
    lr: float = 1e-3
    batch_size: int = 32
    seed: int = 0
    # Where the reward model's body starts: "sft" (the chat expert's SFT checkpoint, as
    # InstructGPT does: it already reads the chat format, and tells on-topic from off-topic
    # answers far better, 0.97 vs 0.67 held-out pairwise accuracy on off-topic pairs in
    # our runs), "base", or "random".
    init: Literal["sft", "base", "random"] = "sft"


@dataclass
class ExpertsSection:
    recipes: str = "recipes/experts"                      # <domain>/{sft,rl}[-<effort>].yaml
    sft: list[str] = field(default_factory=list)          # overrides for every domain's SFT recipe
    rl: list[str] = field(default_factory=list)           # overrides for every domain's RL recipe
    # per "domain" or "domain/effort" (applied after the above, domain before domain/effort)
    domains: dict[str, StageOverrides] = field(default_factory=dict)
    chat_rm: ChatRMSection = field(default_factory=ChatRMSection)


@dataclass
class MopdSection:
    recipe: str = "recipes/mopd/pipeline.yaml"            # a DistillConfig recipe
    overrides: list[str] = field(default_factory=list)    # key=value for it
    n_prompts: int = 1000          # train prompts per teacher key saved under DIR/data

    def validate(self):
        if self.n_prompts < 1:
            raise ValueError("n_prompts must be >= 1")


@dataclass
class SeqKDSection:
    enabled: bool = True
    temperature: float = 0.0       # teacher answers: 0 = greedy, else sampled
    max_new_tokens: int = 0        # 0: the MOPD recipe's rollout.max_new_tokens
    lr: float = 1e-3
    batch_size: int = 32
    warmup_steps: int = 0
    gen_batch_size: int = 64
    seed: int = 0

    def seq_kd_kwargs(self, rollout_max_new_tokens: int) -> dict:
        """evals.baselines.seq_kd's training settings from this section (the pipeline's
        stage and bench.mopd_vs_seqkd both call it, so the two cannot drift apart)."""
        return {"lr": self.lr, "batch_size": self.batch_size, "warmup": self.warmup_steps,
                "max_new_tokens": self.max_new_tokens or rollout_max_new_tokens,
                "temperature": self.temperature, "seed": self.seed, "gen_batch_size": self.gen_batch_size}


@dataclass
class WeightAvgSection:
    enabled: bool = True


@dataclass
class BaselinesSection:
    seq_kd: SeqKDSection = field(default_factory=SeqKDSection)
    weight_avg: WeightAvgSection = field(default_factory=WeightAvgSection)
    quantize: bool = True          # export the baselines through the experts' INT4 fake-quant


@dataclass
class EvalSection:
    n: int = 200                   # held-out rows per column
    n_per_domain: dict[str, int] = field(default_factory=dict)      # "math" or "math/low" -> n
    max_new_tokens: dict[str, int] = field(default_factory=dict)    # default: expert recipe's eval.max_new_tokens
    batch_size: int = 0            # 0: the expert recipe's eval.batch_size
    teachers_on_all_domains: bool = False   # also score every teacher off its own domain


@dataclass
class PipelineTrain:
    max_steps: int = 1_000_000     # cap on every training stage's steps (smoke runs: train.max_steps=2)

    def validate(self):
        if self.max_steps < 1:
            raise ValueError("max_steps must be >= 1")


@dataclass
class PipelineMlflow:
    experiment: str = "mopd-pipeline"
    tracking_uri: str | None = None  # default: $MLFLOW_TRACKING_URI, else sqlite:///DIR/mlflow.db


@dataclass
class PipelineConfig:
    domains: list[str] = field(default_factory=list)      # empty: every folder under experts.recipes
    # Stages run side by side: up to `jobs` at once among those that can (each expert stage in
    # its own process, one thread each; the chat RM); the others (base, MOPD, baselines,
    # evals) run alone. 2 fits a 2-core laptop; on a GPU box, one per free device/core set.
    jobs: int = 2
    base: BaseSection = field(default_factory=BaseSection)
    experts: ExpertsSection = field(default_factory=ExpertsSection)
    mopd: MopdSection = field(default_factory=MopdSection)
    baselines: BaselinesSection = field(default_factory=BaselinesSection)
    eval: EvalSection = field(default_factory=EvalSection)
    train: PipelineTrain = field(default_factory=PipelineTrain)
    mlflow: PipelineMlflow = field(default_factory=PipelineMlflow)


# ----------------------------------------------------------------------------- stages and caching
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


def stable_hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


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
    "run_id", "upstream": {dep: run_id}, "outputs", "seconds"}."""

    def __init__(self, root: str | Path, force: list[str] | tuple = (), log: Callable[[str], None] | None = None,
                 jobs: int = 1):
        self.root = Path(root)
        self.jobs = max(1, int(jobs))
        self.heartbeat_s = 60.0        # with jobs > 1: a status line this often while stages run
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
        from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

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
        return self.outputs

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
                           concurrent=concurrent, log=self.log_path(s.name))
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
        import re
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


def _expert_cost(ecfg) -> float:
    """Rough work of an expert stage, to start the longest first (the critical path):
    rows seen times the characters of a few of its rows (tool_use prompts carry the tool
    list), RL counting its generations."""
    from experts.run import load_domain

    n = ecfg.train.max_steps * ecfg.train.batch_size
    try:
        dom = load_domain(ecfg.domain)
        kw = {"effort": ecfg.effort} if ecfg.effort else {}
        rows = dom.data.make_dataset("train", 8, seed=ecfg.data.seed, difficulty=ecfg.data.difficulty, **kw)
        chars = sum(len(str(r.get("prompt", ""))) + len(str(r.get("completion", ""))) for r in rows) / len(rows)
    except Exception:  # only a scheduling hint: never fail the plan over it
        chars = 100.0
    return float(n * chars * (4 if ecfg.stage == "rl" else 1))


def _run_in_subprocess(ctx: StageContext, module: str, cfg) -> dict:
    """`python -m <module> --config <resolved yaml> --out ctx.out` with this process's
    environment (MLflow parent run, tracking URI), output to the stage's log file;
    returns its summary.json. A failure raises with the log's tail."""
    import subprocess

    from mopd.config import dump_yaml

    log = ctx.log or ctx.out.parent / f"{ctx.out.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cfg_path = log.with_suffix(".yaml")
    cfg_path.write_text(dump_yaml(cfg))
    cmd = [sys.executable, "-m", module, "--config", str(cfg_path), "--out", str(ctx.out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    _say(f"{ctx.name}: in its own process, output in {log}")
    with open(log, "w") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=str(REPO), env=env).returncode
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise RuntimeError(f"stage {ctx.name} failed (exit {rc}); last lines of {log}:\n{tail}")
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


# ----------------------------------------------------------------------------- helpers
def _find(path: str) -> Path:
    p = Path(path)
    if p.is_absolute() or p.exists():
        return p.resolve()
    q = REPO / p
    return q if q.exists() else p.resolve()


def _normalize(obj: Any, root: str) -> Any:
    """Settings with DIR written as $OUT, so a moved DIR keeps its hashes."""
    if isinstance(obj, str):
        return obj.replace(root, "$OUT")
    if isinstance(obj, dict):
        return {k: _normalize(v, root) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_normalize(v, root) for v in obj]
    return obj


def _settings(cfg) -> dict:
    """A stage config as hashed: without its mlflow section (where runs are logged does
    not change what a stage computes; a new tracking store must not retrain everything)."""
    from mopd.config import to_dict

    d = to_dict(cfg)
    d.pop("mlflow", None)
    return d


def key_dir(key: str) -> str:
    return key.replace("/", "-")


def tracking_uri_for(cfg: PipelineConfig, root: Path) -> str:
    from mopd.tracking import resolve_uri
    return resolve_uri(cfg.mlflow.tracking_uri, root)


@dataclass
class Key:
    key: str                       # "math/low" or "code"
    domain: str
    effort: str | None


@dataclass
class Plan:
    """Everything resolved before any work: the stage list and what it was built from."""
    root: Path
    cfg: PipelineConfig
    keys: list[Key]
    tracking_uri: str
    stages: list[Stage]
    mopd_cfg: Any
    columns: list
    clock: dict = field(default_factory=dict)   # {"t0": perf_counter at the start}: the report's wall time


# ----------------------------------------------------------------------------- the plan
def build_plan(cfg: PipelineConfig, out: str | Path) -> Plan:
    """Resolve every stage's config (errors name the key and file before any work) and
    return the stages in run order."""
    from evals.run import all_domains, column_from_config, expert_recipe, teacher_keys
    from experts.base import BaseConfig
    from experts.run import ExpertConfig, load_domain
    from mopd.config import ConfigError, load_config, to_dict
    from mopd.train import DistillConfig

    root = Path(out).resolve()
    R = str(root)
    cap = cfg.train.max_steps
    uri = tracking_uri_for(cfg, root)
    exp = cfg.mlflow.experiment
    recipes_dir = _find(cfg.experts.recipes)
    known = all_domains(recipes_dir)
    domains = list(cfg.domains) or known
    if not domains:
        raise ConfigError(f"pipeline: no domains (none under {recipes_dir} and `domains` is empty)")
    bad = [d for d in domains if d not in known]
    if bad:
        raise ConfigError(f"pipeline: domains {bad} have no recipes under {recipes_dir} (known: {known})")
    for d in domains:
        load_domain(d)
    keys = [Key(k, d, e) for d in domains for k, e in teacher_keys(d)]
    key_names = {k.key for k in keys}
    for k in cfg.experts.domains:
        if k not in key_names and k not in domains:
            raise ConfigError(f"pipeline: experts.domains.{k}: not a selected domain or domain/effort "
                              f"(have {sorted(set(domains) | key_names)})")
    chat = "chat" in domains
    # the chat RM starts from the chat SFT checkpoint: it runs between chat SFT and chat RL,
    # and chat SFT cannot score itself with it
    rm_from_sft = chat and cfg.experts.chat_rm.init == "sft"
    rm_dir = root / "chat_rm"
    base_dir = root / "base"

    # --- base
    base_cfg = load_config(BaseConfig, _find(cfg.base.recipe), list(cfg.base.overrides))
    if not base_cfg.data.domains:
        base_cfg.data.domains = list(domains)
    base_cfg.train.max_steps = min(base_cfg.train.max_steps, cap)
    base_cfg.mlflow.experiment, base_cfg.mlflow.tracking_uri = exp, uri

    # --- experts
    experts: dict[str, dict[str, Any]] = {}
    for k in keys:
        per = [cfg.experts.domains.get(k.domain), cfg.experts.domains.get(k.key) if k.key != k.domain else None]
        stage_dir = root / "experts" / key_dir(k.key)
        experts[k.key] = {}
        for st in ("sft", "rl"):
            ov = list(getattr(cfg.experts, st))
            for p in per:
                if p is not None:
                    ov += list(getattr(p, st))
            ov += [f"model.base={base_dir / 'model'}",
                   f"model.path={base_dir / 'model' if st == 'sft' else stage_dir / 'sft' / 'model'}",
                   "quant.enabled=true", f"mlflow.experiment={exp}", f"mlflow.tracking_uri={uri}",
                   f"mlflow.register={'true' if st == 'rl' else 'false'}"]
            if chat and k.domain == "chat":
                ov.append(f"rl.reward_kwargs.reward_model={rm_dir}")
                if st == "sft" and rm_from_sft:   # the RL stage scores this checkpoint instead
                    ov.append("eval.score=false")
            path = expert_recipe(recipes_dir, k.domain, k.effort, st)
            ecfg = load_config(ExpertConfig, path, ov)
            if ecfg.domain != k.domain or ecfg.effort != k.effort or ecfg.stage != st:
                raise ConfigError(f"{path}: says domain={ecfg.domain!r} effort={ecfg.effort!r} "
                                  f"stage={ecfg.stage!r}, expected {k.domain!r} {k.effort!r} {st!r}")
            ecfg.train.max_steps = min(ecfg.train.max_steps, cap)
            experts[k.key][st] = ecfg
    quants = {k: asdict(experts[k]["rl"].quant) for k in experts}
    first = next(iter(quants))
    for k, q in quants.items():
        if q != quants[first] or asdict(experts[k]["sft"].quant) != q:
            raise ConfigError(f"pipeline: the experts' quant sections differ ({first}: {quants[first]}, "
                              f"{k}: {q}); the student's quant must equal the teachers', so they must agree")
    quant = experts[first]["rl"].quant

    # --- MOPD
    data_paths = {k.key: root / "data" / key_dir(k.key) for k in keys}
    teachers = {k.key: {"path": str(root / "experts" / key_dir(k.key) / "rl" / "model"), "backend": "hf"}
                for k in keys}
    mopd_recipe = _find(cfg.mopd.recipe)
    # The recipe's own teacher entries are placeholders; their backend is kept.
    backend = next(iter(load_config(DistillConfig, mopd_recipe, list(cfg.mopd.overrides)).teachers.values())).backend
    for t in teachers.values():
        t["backend"] = backend
    mopd_ov = list(cfg.mopd.overrides) + [
        f"model.path={base_dir / 'model'}",
        "data.datasets=" + json.dumps([{"path": str(data_paths[k.key])} for k in keys]),
        "teachers=" + json.dumps(teachers),
        "quant=" + json.dumps(asdict(quant)),
        f"mlflow.experiment={exp}", f"mlflow.tracking_uri={uri}", "mlflow.run_name=mopd",
        "train.resume=false",
    ]
    mopd_cfg = load_config(DistillConfig, mopd_recipe, mopd_ov)
    mopd_cfg.train.max_steps = min(mopd_cfg.train.max_steps, cap)
    # the recipe covers every domain; a run over some of them keeps their entries only
    mopd_cfg.data.mix = {d: w for d, w in mopd_cfg.data.mix.items() if d in domains}
    mopd_cfg.rollout.by_domain = {d: o for d, o in mopd_cfg.rollout.by_domain.items() if d in domains}
    if mopd_cfg.data.mix:
        missing = [d for d in domains if d not in mopd_cfg.data.mix]
        if missing:
            raise ConfigError(f"{mopd_recipe}: data.mix has no weight for {missing} (drop data.mix for uniform)")

    # --- eval columns (settings from the RL recipes, as resolved above)
    columns = [column_from_config(k.key, experts[k.key]["rl"], n=cfg.eval.n, n_per_domain=cfg.eval.n_per_domain,
                                  max_new_tokens=cfg.eval.max_new_tokens, batch_size=cfg.eval.batch_size or None)
               for k in keys]
    for name in list(cfg.eval.n_per_domain) + list(cfg.eval.max_new_tokens):
        # an entry of a domain this run leaves out is fine (the recipe covers every domain);
        # a name that is no domain at all is a typo
        if name not in key_names and name not in domains and name.split("/")[0] not in known:
            raise ConfigError(f"pipeline: eval settings name {name!r}, not a domain or domain/effort "
                              f"(domains: {known})")
    col_by_key = {c.name: c for c in columns}

    # ------------------------------------------------------------------------- stages
    stages: list[Stage] = []
    clock = {"t0": time.perf_counter()}
    N = lambda x: _normalize(x, R)  # noqa: E731

    # data
    data_settings = {}
    for k in keys:
        rl = experts[k.key]["rl"]
        data_settings[k.key] = {"n": cfg.mopd.n_prompts, "seed": rl.data.seed, "difficulty": rl.data.difficulty,
                                "effort": k.effort, "path": str(data_paths[k.key])}

    def run_data(ctx: StageContext) -> dict:
        with _stage_run(ctx, "data"):
            paths = {}
            for k in keys:
                s = data_settings[k.key]
                dom = load_domain(k.domain)
                kw = {"effort": k.effort} if k.effort else {}
                ds = dom.data.make_dataset("train", s["n"], seed=s["seed"], difficulty=s["difficulty"], **kw)
                for col in ("domain",) + (("effort",) if k.effort else ()):
                    if col not in ds.column_names:
                        raise ValueError(f"experts/{k.domain}/data.py make_dataset gives no {col!r} column")
                ds.save_to_disk(s["path"])
                paths[k.key] = s["path"]
            _log_params({f"n/{k}": v["n"] for k, v in data_settings.items()})
        return {"paths": paths}

    stages.append(Stage("data", N(data_settings), run_data, out=root / "data"))

    # base
    def run_base(ctx: StageContext) -> dict:
        from experts.base import build_base
        s = build_base(base_cfg, ctx.out)
        return {"checkpoint": str(Path(s["checkpoint"])), "mlflow_run_id": s.get("mlflow_run_id")}

    stages.append(Stage("base", N(_settings(base_cfg)), run_base, out=base_dir))

    # chat reward model
    rm_deps: list[str] = []
    if chat:
        rm = cfg.experts.chat_rm
        rm_settings = {**asdict(rm), "steps": min(rm.steps, cap)}
        chat_sft = root / "experts" / "chat" / "sft"
        rm_init, rm_init_deps = {"sft": (str(chat_sft / "model"), ["expert/chat/sft"]),
                                 "base": (str(base_dir / "model"), ["base"]), "random": (None, [])}[rm.init]

        def run_rm(ctx: StageContext) -> dict:
            from experts.chat.train_rm import INFO_FILE, train_reward_model
            with _stage_run(ctx, "chat_rm", domain="chat"):
                _log_params(rm_settings)
                acc = train_reward_model(str(ctx.out), base=rm_init,
                                         n_pairs=rm.n_pairs, steps=rm_settings["steps"], lr=rm.lr, seed=rm.seed,
                                         batch_size=rm.batch_size, n_heldout=rm.n_heldout)
                _log_metrics({"pairwise_accuracy": acc})
                _log_artifact(ctx.out / INFO_FILE)
            return {"checkpoint": str(ctx.out), "pairwise_accuracy": acc}

        # concurrent: it trains in this process, but on one thread, beside expert subprocesses
        rm_stage = Stage("chat_rm", N(rm_settings), run_rm, deps=rm_init_deps, out=rm_dir, concurrent=True,
                         cost=rm_settings["steps"] * rm.batch_size * 2 * 150.0)  # pairs of ~150-char rows
        if not rm_from_sft:
            stages.append(rm_stage)   # else right after the chat SFT stage it starts from
        rm_deps = ["chat_rm"]

    # experts
    def expert_fn(key: str, st: str):
        def fn(ctx: StageContext) -> dict:
            if ctx.concurrent:
                # its own process: torch threads and MLflow's active run are per process
                s = _run_in_subprocess(ctx, "experts.run", experts[key][st])
            else:
                from experts.run import run_expert
                s = run_expert(experts[key][st], ctx.out)
            return {k: s.get(k) for k in ("checkpoint", "score", "score_sft", "score_base", "model_uri",
                                          "mlflow_run_id", "train_seconds")}
        return fn

    rl_stages = []
    for k in keys:
        sdir = root / "experts" / key_dir(k.key)
        extra = rm_deps if k.domain == "chat" else []
        sft_extra = [] if (k.domain == "chat" and rm_from_sft) else extra
        stages.append(Stage(f"expert/{k.key}/sft", N(_settings(experts[k.key]["sft"])), expert_fn(k.key, "sft"),
                            deps=["base", *sft_extra], out=sdir / "sft", concurrent=True,
                            cost=_expert_cost(experts[k.key]["sft"])))
        if k.domain == "chat" and rm_from_sft:
            stages.append(rm_stage)
        stages.append(Stage(f"expert/{k.key}/rl", N(_settings(experts[k.key]["rl"])), expert_fn(k.key, "rl"),
                            deps=[f"expert/{k.key}/sft", *extra], out=sdir / "rl", concurrent=True,
                            cost=_expert_cost(experts[k.key]["rl"])))
        rl_stages.append(f"expert/{k.key}/rl")

    # MOPD
    mopd_dir = root / "mopd"
    mopd_settings = _settings(mopd_cfg)
    mopd_settings["train"].pop("resume", None)

    def run_mopd(ctx: StageContext) -> dict:
        from mopd.train import latest_checkpoint, run
        c = dataclasses.replace(mopd_cfg, train=dataclasses.replace(mopd_cfg.train))
        if ctx.resume and latest_checkpoint(ctx.out) is not None:
            c.train.resume = True
            _say(f"mopd: resuming from {latest_checkpoint(ctx.out)}")
        elif ctx.out.exists():
            shutil.rmtree(ctx.out)
        res = run(c, ctx.out)
        from evals.report import tokens_from_history
        return {"final": res["final"], "mlflow_run_id": res["mlflow_run_id"], "steps": len(res["history"]),
                "tokens": tokens_from_history(res["history"]), "history": str(ctx.out / "history.json")}

    stages.append(Stage("mopd", N(mopd_settings), run_mopd, deps=["data", "base", *rl_stages], out=mopd_dir,
                        resumable=True))

    # baselines
    bl = cfg.baselines
    bquant = quant if bl.quantize else None
    baseline_models: dict[str, str] = {}
    if bl.seq_kd.enabled:
        sk = bl.seq_kd
        # The prompt stream replays MOPD's sampler: its data, mix, seed and batch shape count.
        sk_settings = {**asdict(sk), "max_new_tokens": sk.max_new_tokens or mopd_cfg.rollout.max_new_tokens,
                       "prompts": {"data": to_dict(mopd_cfg.data), "seed": mopd_cfg.train.seed,
                                   "prompts_per_step": mopd_cfg.train.prompts_per_step,
                                   "minibatches": mopd_cfg.train.minibatches},
                       "quant": asdict(bquant) if bquant else None}

        def run_seq_kd(ctx: StageContext) -> dict:
            from transformers import AutoTokenizer

            from evals.baselines import mopd_prompt_stream, seq_kd
            budget = int(ctx.inputs["mopd"]["tokens"])
            base_ckpt = ctx.inputs["base"]["checkpoint"]
            stream = mopd_prompt_stream(mopd_cfg, AutoTokenizer.from_pretrained(base_ckpt))
            tpaths = {k.key: ctx.inputs[f"expert/{k.key}/rl"]["checkpoint"] for k in keys}
            with _stage_run(ctx, "seq_kd"):
                _log_params({k: v for k, v in sk_settings.items() if k != "quant"})
                s = seq_kd(base_ckpt, tpaths, stream, ctx.out, budget_tokens=budget, quant=bquant,
                           **sk.seq_kd_kwargs(mopd_cfg.rollout.max_new_tokens))
                for i, loss in enumerate(s.pop("losses")):
                    _log_metrics({"loss": loss}, step=i)
                _log_metrics({"tokens": s["tokens"], "budget_tokens": s["budget_tokens"], "rows": s["rows"],
                              "steps": s["steps"]})
            return s

        stages.append(Stage("baseline/seq_kd", N(sk_settings), run_seq_kd,
                            deps=["data", "base", *rl_stages, "mopd"], out=root / "baselines" / "seq_kd"))
        baseline_models["seq_kd"] = "baseline/seq_kd"
    if bl.weight_avg.enabled:
        def run_wavg(ctx: StageContext) -> dict:
            from evals.baselines import weight_average
            paths = [ctx.inputs[s]["checkpoint"] for s in rl_stages]
            with _stage_run(ctx, "weight_avg"):
                s = weight_average(paths, ctx.out / "model", quant=bquant)
            return s

        stages.append(Stage("baseline/weight_avg", N({"quant": asdict(bquant) if bquant else None,
                                                      "teachers": rl_stages}),
                            run_wavg, deps=list(rl_stages), out=root / "baselines" / "weight_avg"))
        baseline_models["weight_avg"] = "baseline/weight_avg"

    # evals
    def eval_fn(model_name: str, src: str, cols: list):
        def fn(ctx: StageContext) -> dict:
            from evals.run import evaluate_model
            o = ctx.inputs[src]
            ref = o.get("checkpoint") or o.get("final")
            with _stage_run(ctx, f"eval-{model_name.replace('/', '-')}"):
                _log_params({"model": ref})
                scores = evaluate_model(ref, cols, label=model_name)
                _log_metrics({f"score/{c}": v for c, v in scores.items()})
            ctx.out.mkdir(parents=True, exist_ok=True)
            (ctx.out / "scores.json").write_text(json.dumps({"model": ref, "scores": scores}, indent=1))
            return {"model": ref, "scores": scores}
        return fn

    eval_models: list[tuple[str, str, list]] = [("base", "base", columns)]
    for k in keys:
        cols = columns if cfg.eval.teachers_on_all_domains else [col_by_key[k.key]]
        eval_models.append((f"teacher/{k.key}", f"expert/{k.key}/rl", cols))
    eval_models.append(("student", "mopd", columns))
    for name, src in baseline_models.items():
        eval_models.append((name, src, columns))
    eval_stages = []
    for name, src, cols in eval_models:
        sname = f"eval/{name}"
        needs_rm = chat and any(c.domain == "chat" for c in cols)
        stages.append(Stage(sname, N([asdict(c) for c in cols]), eval_fn(name, src, cols),
                            deps=[src, *(rm_deps if needs_rm else [])], out=root / "evals" / key_dir(name)))
        eval_stages.append((name, sname))

    # report
    def run_report(ctx: StageContext) -> dict:
        from evals.report import build_report
        from evals.run import eval_json
        scores = {name: ctx.inputs[s]["scores"] for name, s in eval_stages}
        models = {name: ctx.inputs[s]["model"] for name, s in eval_stages}
        ev = eval_json(scores, columns, models)
        (root / "eval.json").write_text(json.dumps(ev, indent=1))
        hist_path = Path(ctx.inputs["mopd"]["history"])
        hist = json.loads(hist_path.read_text()) if hist_path.exists() else []
        tokens = {"mopd": ctx.inputs["mopd"]["tokens"],
                  "seq_kd": ctx.inputs["baseline/seq_kd"]["tokens"] if "baseline/seq_kd" in ctx.inputs else None}
        build_report(ev, hist, root, student_tokens=tokens, stage_seconds=ctx.seconds,
                           wall_seconds=time.perf_counter() - clock["t0"],
                           mlflow={"tracking_uri": uri, "parent_run_id": os.environ.get("MOPD_PARENT_RUN_ID")},
                           extra={"teacher_models": {k.key: ctx.inputs[f"expert/{k.key}/rl"].get("model_uri")
                                                     for k in keys}})
        with _stage_run(ctx, "report"):
            for f in ("report.json", "report.md", "retention.png", "kl_curves.png", "eval.json"):
                _log_artifact(root / f)
        return {"report": str(root / "report.json")}

    stages.append(Stage("report", None, run_report,
                        deps=["mopd", *rl_stages, *[s for _, s in eval_stages],
                              *(["baseline/seq_kd"] if "seq_kd" in baseline_models else [])],
                        always=True))
    return Plan(root=root, cfg=cfg, keys=keys, tracking_uri=uri, stages=stages, mopd_cfg=mopd_cfg, columns=columns,
                clock=clock)


# ----------------------------------------------------------------------------- mlflow
def _say(msg: str):
    print(f"[pipeline] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _stage_run(ctx: StageContext, run_name: str, domain: str = "all"):
    """A nested MLflow run under the pipeline's parent for a stage this module runs itself."""
    import mlflow

    parent = os.environ.get("MOPD_PARENT_RUN_ID")
    exp_id = os.environ.get("MOPD_PIPELINE_EXPERIMENT_ID")
    with mlflow.start_run(run_name=run_name, experiment_id=exp_id, nested=bool(parent),
                          parent_run_id=parent or None,
                          tags={"stage": ctx.name, "domain": domain, "stage_hash": ctx.hash}) as run:
        yield run


def _log_params(d: dict):
    import mlflow
    if mlflow.active_run():
        mlflow.log_params({k: str(v)[:500] for k, v in d.items()})


def _log_metrics(d: dict, step: int | None = None):
    import mlflow
    if mlflow.active_run():
        mlflow.log_metrics({k: float(v) for k, v in d.items() if v is not None}, step=step)


def _log_artifact(path: Path):
    import mlflow
    if mlflow.active_run() and Path(path).exists():
        mlflow.log_artifact(str(path))


def _parent_run(plan: Plan) -> tuple[str, str]:
    """(experiment id, parent run id): the run recorded in DIR/pipeline.json when it is in
    this tracking store, else a new one."""
    import mlflow
    from mlflow.entities import RunStatus

    from mopd.tracking import experiment_id

    exp_id = experiment_id(plan.cfg.mlflow.experiment, plan.tracking_uri)
    client = mlflow.MlflowClient()
    state_file = plan.root / "pipeline.json"
    state = json.loads(state_file.read_text()) if state_file.exists() else {}
    run_id = None
    if state.get("tracking_uri") == plan.tracking_uri and state.get("parent_run_id"):
        try:
            r = client.get_run(state["parent_run_id"])
            if r.info.lifecycle_stage == "active":
                run_id = r.info.run_id
                client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        except Exception:
            run_id = None
    if run_id is None:
        r = client.create_run(exp_id, run_name=f"pipeline-{plan.root.name}", tags={"stage": "pipeline"})
        run_id = r.info.run_id
        from mopd.config import flatten, to_dict
        for k, v in flatten(to_dict(plan.cfg)).items():
            client.log_param(run_id, k, str(v)[:500])
    state.update({"tracking_uri": plan.tracking_uri, "parent_run_id": run_id, "experiment_id": exp_id})
    state_file.write_text(json.dumps(state, indent=1))
    return exp_id, run_id


# ----------------------------------------------------------------------------- entry point
def run_pipeline(cfg: PipelineConfig, out: str | Path, *, force: list[str] | None = None,
                 dry_run: bool = False, config_text: str | None = None) -> dict:
    """Run (or resume) the whole pipeline in `out`; returns the report (or, with
    dry_run, the plan: which stages would be reused, resumed or run)."""
    import mlflow
    import torch
    from mlflow.entities import RunStatus

    from mopd.config import dump_yaml

    t_start = time.perf_counter()
    root = Path(out).resolve()
    root.mkdir(parents=True, exist_ok=True)
    plan = build_plan(cfg, root)
    plan.clock["t0"] = t_start
    runner = StageRunner(root, force=force or [], jobs=cfg.jobs,
                         log=lambda m: _console().print(m, highlight=False, markup=False, soft_wrap=True))
    if dry_run:
        rows = runner.plan(plan.stages)
        _print_plan(rows)
        return {"plan": [{"stage": s, "hash": h, "action": a} for s, h, a in rows]}
    runner.check(plan.stages)
    (root / "pipeline.yaml").write_text(config_text or dump_yaml(cfg))
    exp_id, parent = _parent_run(plan)
    mlflow.MlflowClient().log_artifact(parent, str(root / "pipeline.yaml"))
    env_keys = ("MOPD_PARENT_RUN_ID", "MLFLOW_TRACKING_URI", "MOPD_PIPELINE_EXPERIMENT_ID", "MOPD_CHAT_REWARD_MODEL")
    saved_env = {k: os.environ.get(k) for k in env_keys}
    os.environ.update({"MOPD_PARENT_RUN_ID": parent, "MLFLOW_TRACKING_URI": plan.tracking_uri,
                       "MOPD_PIPELINE_EXPERIMENT_ID": exp_id})
    if any(k.domain == "chat" for k in plan.keys):
        os.environ["MOPD_CHAT_REWARD_MODEL"] = str(root / "chat_rm")
    client = mlflow.MlflowClient()
    threads = torch.get_num_threads()
    _say(f"{len(plan.stages)} stages in {root}; MLflow {plan.tracking_uri}, parent run {parent}")
    for s in plan.stages:  # every stage runs with the process's thread setting, whatever the last one did
        s.fn = _with_threads(s.fn, threads)
    ok = False
    try:
        runner.run(plan.stages)
        ok = True
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        wall = time.perf_counter() - t_start
        try:
            client.log_metric(parent, "wall_seconds", wall)
            for name, secs in runner.seconds.items():
                client.log_metric(parent, f"stage_seconds/{name}", secs)
            client.set_terminated(parent, RunStatus.to_string(RunStatus.FINISHED if ok else RunStatus.FAILED))
        except Exception as e:  # the store being unreachable must not hide the stage's own error
            _say(f"could not update the parent MLflow run: {e}")
    report = json.loads((root / "report.json").read_text())
    for m, row in report["scores"].items():
        for d, v in row.items():
            if v is not None:
                client.log_metric(parent, f"score/{m}/{d}", v)
    for d, v in report["retention"].items():
        if v is not None:
            client.log_metric(parent, f"retention/{d}", v)
    for m, v in (report.get("means") or {}).items():
        if v is not None:
            client.log_metric(parent, f"mean/{m}", v["mean"])
    for f in ("report.md", "report.json", "retention.png", "kl_curves.png", "eval.json"):
        if (root / f).exists():
            client.log_artifact(parent, str(root / f))
    _print_stages(runner, wall)
    from evals.report import print_table
    print_table(report, title=f"{root.name}: held-out scores (greedy)")
    return report


def _with_threads(fn, threads: int):
    def wrapped(ctx):
        import torch
        try:
            return fn(ctx)
        finally:
            torch.set_num_threads(threads)
    return wrapped


def _console():
    from rich.console import Console
    return Console(stderr=True)


def _print_plan(rows):
    from rich.table import Table
    t = Table(title="pipeline plan")
    for c in ("stage", "hash", "action"):
        t.add_column(c)
    for s, h, a in rows:
        t.add_row(s, h, {"cached": "reuse", "resume": "resume", "run": "run"}[a])
    _console().print(t)


def _print_stages(runner: StageRunner, wall: float):
    from rich.table import Table
    t = Table(title=f"pipeline stages ({wall:.0f} s wall)")
    for c in ("stage", "status", "seconds"):
        t.add_column(c)
    for name, secs in runner.seconds.items():
        t.add_row(name, runner.status.get(name, "-"), f"{secs:.1f}")
    _console().print(t)


def main(argv: list[str] | None = None):

    ap = argparse.ArgumentParser(prog="mopd pipeline", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    return main_args(args)


def add_arguments(p):
    p.add_argument("--config", required=True, help="a recipes/pipeline/*.yaml")
    p.add_argument("--out", required=True)
    p.add_argument("--force", action="append", default=[], metavar="STAGE",
                   help="redo this stage (name or glob, e.g. mopd, 'eval/*'); repeatable")
    p.add_argument("--dry-run", action="store_true", help="show which stages would be reused, resumed or run")
    p.add_argument("overrides", nargs="*", help="key=value, e.g. domains=[math] train.max_steps=2")


def main_args(args) -> int:
    from mopd.config import dump_yaml, load_config

    cfg = load_config(PipelineConfig, args.config, args.overrides)
    run_pipeline(cfg, args.out, force=args.force, dry_run=args.dry_run, config_text=dump_yaml(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
