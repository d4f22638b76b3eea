"""The MLflow store and experiment every entry point (loop, experts, base, pipeline)
logs to, resolved one way everywhere, and the one place runs are started.

A stage run of the pipeline is nested under the pipeline's parent run: the parent's id
is handed down explicitly (a config field `mlflow.parent_run_id` or an argument),
never through an environment variable."""
from __future__ import annotations

import atexit
import json
import os
import queue
import re
import sys
import threading
import time
from pathlib import Path

import mlflow

from core.config import ConfigError
from core.store_probe import StoreUnreachable, probe_server  # noqa: F401 - StoreUnreachable re-exported


class StoreMissing(ConfigError):
    """A command that only reads a store was pointed at none, or at one that does not exist."""


def check_store(uri: str, *, create: bool = True, timeout_s: float = 8.0) -> None:
    """Refuse a store that cannot be used, in seconds and before any model loads: a tracking
    server that does not answer (MLflow's own client retries for minutes before it says so),
    a local sqlite file that is not a database, or, with `create=False` (a command that
    only reads), a local store that does not exist (it would be created empty)."""
    if uri.startswith(("http://", "https://")):
        probe_server(uri, timeout_s)
    elif uri.startswith("sqlite:///"):
        from core.outdir import check_store as check_sqlite

        path = Path(uri[len("sqlite:///"):])
        if not create and not path.exists():
            raise StoreMissing(f"there is no MLflow store at {uri} (no file {path}): point --tracking-uri / "
                               f"mlflow.tracking_uri / $MLFLOW_TRACKING_URI at the store the models are in")
        check_sqlite(uri)


def given_store(uri: str | None, what: str) -> str:
    """The store a read-only command was pointed at (`uri`, else $MLFLOW_TRACKING_URI),
    checked: never MLflow's default ./mlflow.db, which the first read would create."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        found = sorted(str(p) for p in [*Path().glob("mlflow.db"), *Path().glob("runs/*/mlflow.db")])[:3]
        hint = f" (stores here: {', '.join('sqlite:///' + str(Path(f).resolve()) for f in found)})" if found else ""
        raise StoreMissing(f"{what}: no MLflow store given: pass --tracking-uri URI (a pipeline's "
                           f"sqlite:///DIR/mlflow.db, or http://HOST:PORT of a shared server) or set "
                           f"$MLFLOW_TRACKING_URI{hint}")
    check_store(uri, create=False)
    return uri


def pip_requirements() -> list[str]:
    """What a logged model needs to load, pinned to this environment. Given explicitly:
    MLflow would otherwise infer them by importing packages (torchvision, absent here)."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for pkg in ("torch", "transformers", "accelerate", "safetensors", "tokenizers"):
        try:
            out.append(f"{pkg}=={version(pkg).split('+')[0]}")
        except PackageNotFoundError:
            out.append(pkg)
    return out


def log_hf_model(checkpoint: str | Path, name: str = "model") -> str | None:
    """Log the HF checkpoint folder to the active run as an MLflow transformers model
    (`mlflow.transformers.load_model("runs:/<run>/model")` opens it as a text-generation
    pipeline); the folder is copied as is, no model is loaded. Returns the logged model's
    URI (models:/m-...), or None when the store refused it: the checkpoint is on disk, its
    MLflow copy is a convenience (reported, never raised)."""
    import logging

    try:
        import mlflow.transformers

        quiet = logging.getLogger("mlflow.transformers")   # "no model card / license on the hub": a local folder
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            info = mlflow.transformers.log_model(transformers_model=str(checkpoint), name=name,
                                                 task="text-generation", pip_requirements=pip_requirements())
        finally:
            quiet.setLevel(level)
        return info.model_uri
    except Exception as e:  # noqa: BLE001 - any store or flavor error
        print(f"[mopd] could not log {checkpoint} to MLflow as a model ({type(e).__name__}: {str(e)[:300]}); "
              f"it is on disk", file=sys.stderr)
        return None


def resolve_uri(configured: str | None, out: str | Path) -> str:
    """$MLFLOW_TRACKING_URI (a team's server), else the recipe's, else sqlite under `out`."""
    return os.environ.get("MLFLOW_TRACKING_URI") or configured or f"sqlite:///{Path(out).resolve()}/mlflow.db"


def experiment_id(name: str, uri: str) -> str:
    """Point MLflow at `uri` and return the id of experiment `name`, creating it if needed.
    A local sqlite store keeps its artifacts beside it (not in ./mlruns of the cwd); a
    tracking server decides for itself."""
    mlflow.set_tracking_uri(uri)
    exp = mlflow.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    art = None
    if uri.startswith("sqlite:///"):
        art = (Path(uri[len("sqlite:///"):]).parent / "mlartifacts").as_uri()
    try:
        return mlflow.create_experiment(name, artifact_location=art)
    except mlflow.exceptions.MlflowException:   # another process (a team on a shared server) made it first
        exp = mlflow.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def start_run(*, experiment: str, uri: str, run_name: str | None = None, tags: dict | None = None,
              parent_run_id: str | None = None, run_id: str | None = None):
    """Start (or, with `run_id`, resume) an MLflow run in `experiment` of the store at
    `uri`, nested under `parent_run_id` when one is given. Usable as a context manager."""
    exp_id = experiment_id(experiment, uri)
    tags = dict(tags or {})
    if run_id:
        if run_exists(run_id, uri):
            return mlflow.start_run(run_id=run_id)
        # The run was deleted, or the store moved (a new tracking URI, a copied folder):
        # continue in a new run that says where it came from.
        print(f"[mopd] MLflow run {run_id} is not in the store at {uri}: starting a new run "
              f"(tag mopd.resumed_from_run_id={run_id})", file=sys.stderr)
        tags["mopd.resumed_from_run_id"] = run_id
        # the parent may be gone with it
        if parent_run_id and not run_exists(parent_run_id, uri):
            parent_run_id = None
    if parent_run_id and not run_exists(parent_run_id, uri):
        # A stage's config.yaml rerun against another store (a copied run folder, a new
        # MLFLOW_TRACKING_URI) still names the pipeline run of the old one.
        raise ValueError(
            f"mlflow.parent_run_id={parent_run_id} is not a run of the MLflow store at {uri}: it names the "
            "pipeline run the config was written under, in another store. Rerun with the override "
            "mlflow.parent_run_id=null (or delete that line from the config) to log a run of its own")
    return mlflow.start_run(experiment_id=exp_id, run_name=run_name, tags=tags,
                            nested=bool(parent_run_id), parent_run_id=parent_run_id or None)


def run_exists(run_id: str, uri: str) -> bool:
    """Whether `run_id` is a live (not deleted) run of the store at `uri`."""
    try:
        return mlflow.MlflowClient(tracking_uri=uri).get_run(run_id).info.lifecycle_stage != "deleted"
    except mlflow.exceptions.MlflowException:
        return False


def end_run(status: str = "FINISHED", tries: int = 3) -> None:
    """End the active run with `status` (FINISHED, FAILED or KILLED), retrying a store
    that does not answer; a failure is reported, never raised: the run's outcome matters
    more than its record. (mlflow's own exit hook would mark a still-active run FINISHED.)"""
    run = mlflow.active_run()
    if run is None:
        return
    run_id = run.info.run_id
    try:
        mlflow.end_run(status=status)   # pops the active run first, then writes the status
        return
    except Exception as e:  # noqa: BLE001 - any store error
        err = e
    for i in range(tries - 1):
        time.sleep(2.0 * (i + 1))
        try:
            mlflow.MlflowClient().set_terminated(run_id, status)
            return
        except Exception as e:  # noqa: BLE001
            err = e
    print(f"[mopd] could not mark MLflow run {run_id} {status}: {type(err).__name__}: {err}", file=sys.stderr)


_METRIC_NAME = re.compile(r"[\w\-. :/]+")


def valid_metric_name(name: str) -> bool:
    """Whether MLflow takes `name` as a metric key (its rule: letters, digits, `_ - . : /`
    and spaces; no `..`, no leading `/`)."""
    return bool(_METRIC_NAME.fullmatch(name)) and ".." not in name and not name.startswith("/")


class MetricLogger:
    """Metrics sent to an MLflow run from a background thread, buffered and retried:
    a slow or locked store (sqlite's "database is locked") delays the metrics, never
    the training, and never raises into it. `close()` waits for the buffer to drain;
    what still could not be sent is written to `fallback` (JSON lines) and reported.

    `client` is anything with MlflowClient's `log_batch(run_id, metrics=[...], tags=[...])`.

    A resumed run (`resumed_from`: the checkpoint's step) does not log again the steps the
    stopped run already logged to the same MLflow run (found from `step_key`'s history):
    every metric keeps one point per step. The resume is recorded as a tag (`note_resume`)."""

    def __init__(self, run_id: str, uri: str, *, fallback: str | Path | None = None, client=None,
                 retry_s: float = 1.0, max_retry_s: float = 30.0, resumed_from: int | None = None,
                 step_key: str = "loss"):
        self.run_id, self.uri = run_id, uri
        self.fallback = Path(fallback) if fallback else None
        self.client = client or mlflow.MlflowClient(tracking_uri=uri)
        self.retry_s, self.max_retry_s = retry_s, max_retry_s
        self._q: queue.Queue = queue.Queue()
        self._pending: list[tuple[dict, int, int, dict]] = []   # (metrics, step, timestamp ms, tags)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._failing = False
        self._bad_names: set[str] = set()
        self.failures = 0
        self.skip_through = -1      # steps up to this one are in the run already (a resume)
        self.skipped = 0
        if resumed_from is not None:
            self.skip_through = note_resume(self.client, run_id, resumed_from, step_key)
        self._thread = threading.Thread(target=self._work, name="mopd-mlflow-metrics", daemon=True)
        self._thread.start()
        # a process that exits without close() (a caller's early sys.exit, an unhandled error
        # outside the loop's own finally) still sends what is queued: the daemon thread alone
        # would be killed at exit with the last steps in its buffer
        atexit.register(self._close_at_exit)

    def _close_at_exit(self) -> None:
        if not self._stop.is_set():
            self.close(timeout=15.0)

    def log(self, metrics: dict, step: int, tags: dict[str, str] | None = None) -> None:
        """Queue one step's metrics (and run tags, e.g. the fail-over lines of a step)."""
        if step <= self.skip_through:   # logged by the run this one resumes
            self.skipped += 1
            metrics = {}
            if not tags:
                return
        bad = [k for k in metrics if not valid_metric_name(k)]
        if bad:   # a permanent error: retrying would hold back every other metric of the batch forever
            new = sorted(set(bad) - self._bad_names)
            if new:
                self._bad_names.update(new)
                print(f"[mopd] metric names MLflow refuses (allowed: letters, digits, _ - . space : /), "
                      f"not logged: {new}", file=sys.stderr)
            metrics = {k: v for k, v in metrics.items() if k not in self._bad_names}
        self._q.put(({k: float(v) for k, v in metrics.items()}, int(step), int(time.time() * 1000),
                     {str(k): str(v)[:5000] for k, v in (tags or {}).items()}))

    def _drain_queue(self) -> None:
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                return
            with self._lock:
                self._pending.append(item)

    def _send(self) -> bool:
        """Send what is pending; True when nothing is left."""
        from mlflow.entities import Metric, RunTag

        while True:
            with self._lock:
                if not self._pending:
                    return True
                batch, n = [], 0
                for m, step, ts, tags in self._pending:
                    if n and (n + len(m) > 1000 or tags):   # log_batch takes at most 1000 metrics, 100 tags
                        break
                    batch.append((m, step, ts, tags))
                    n += len(m)
            tags = [RunTag(k, v) for *_, t in batch for k, v in t.items()]
            try:
                self.client.log_batch(self.run_id, metrics=[Metric(k, v, ts, step) for m, step, ts, _ in batch
                                                            for k, v in m.items()], **({"tags": tags} if tags else {}))
            except Exception as e:  # noqa: BLE001 - any store error: keep the metrics, retry later
                self.failures += 1
                if not self._failing:
                    print(f"[mopd] MLflow store at {self.uri} is not taking metrics ({type(e).__name__}: "
                          f"{str(e)[:200]}): buffering them and retrying; training goes on", file=sys.stderr)
                self._failing = True
                return False
            with self._lock:
                del self._pending[:len(batch)]
            if self._failing:
                print(f"[mopd] MLflow store at {self.uri} answers again: buffered metrics sent", file=sys.stderr)
                self._failing = False

    def _work(self) -> None:
        wait = self.retry_s
        while True:
            try:
                item = self._q.get(timeout=0.2)
                with self._lock:
                    self._pending.append(item)
            except queue.Empty:
                pass
            self._drain_queue()
            if self._send():
                wait = self.retry_s
                if self._stop.is_set() and self._q.empty():
                    return
                continue
            if self._stop.wait(wait) and self._closing_deadline_passed():
                return
            wait = min(wait * 2, self.max_retry_s)

    _deadline: float | None = None

    def _closing_deadline_passed(self) -> bool:
        return self._deadline is not None and time.monotonic() > self._deadline

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending) + self._q.qsize()

    def close(self, timeout: float = 120.0) -> int:
        """Wait up to `timeout` s for the buffer to reach the store; returns how many
        steps' metrics could not be sent (written to `fallback`)."""
        atexit.unregister(self._close_at_exit)
        self._deadline = time.monotonic() + timeout
        self._stop.set()
        self._thread.join(timeout + 1)
        self._drain_queue()
        with self._lock:
            left = list(self._pending)
        if left:
            msg = f"[mopd] {len(left)} steps of metrics never reached the MLflow store at {self.uri}"
            if self.fallback is not None:
                try:
                    with open(self.fallback, "a") as f:
                        for m, step, ts, tags in left:
                            f.write(json.dumps({"step": step, "timestamp": ts, "metrics": m,
                                                **({"tags": tags} if tags else {})}) + "\n")
                    msg += f"; they are in {self.fallback}"
                except OSError as e:
                    msg += f" (and could not be written to {self.fallback}: {e})"
            print(msg, file=sys.stderr)
        return len(left)


def note_resume(client, run_id: str, from_step: int, step_key: str = "loss") -> int:
    """Record on `run_id` that it resumes from `from_step` now (tag mopd.resume.<n>), and
    return the last step it already holds (`step_key`'s history; `from_step` if none
    later): the resume does not log those steps again. A store that does not answer
    skips nothing (reported, never raised)."""
    try:
        last = max((m.step for m in client.get_metric_history(run_id, step_key)), default=from_step)
        n = 1 + sum(k.startswith("mopd.resume.") for k in client.get_run(run_id).data.tags)
        kept = f"steps {from_step + 1}-{last}" if last > from_step + 1 else f"step {last}"
        note = f"from step {from_step} at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}" + (
            f"; {kept} had been logged before the stop: the first points are kept" if last > from_step else "")
        client.set_tag(run_id, f"mopd.resume.{n}", note)
    except Exception as e:  # noqa: BLE001 - any store error: the resume matters more than its record
        print(f"[mopd] could not read or tag MLflow run {run_id} for the resume from step {from_step} "
              f"({type(e).__name__}: {str(e)[:200]}): steps it already holds may get a second point", file=sys.stderr)
        return from_step
    if last > from_step:
        print(f"[mopd] MLflow run {run_id} resumes from step {from_step}; it already holds {kept} from the run "
              f"that stopped: not logged again (history.json has the redone values)", file=sys.stderr)
    return max(last, from_step)


def trainer_callback():
    """A transformers TrainerCallback (TRL's SFT and GRPO trainers: the experts' stages,
    Mix-RL) that logs the trainer's numeric logs (loss, reward, the per-domain
    reward/<domain>, lengths) to the active MLflow run, from rank 0; nothing without one."""
    from transformers import TrainerCallback  # loads in seconds: only when a trainer is built

    class MlflowLogs(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if not state.is_world_process_zero or not logs or mlflow.active_run() is None:
                return
            # TRL's nested keys (rewards/<fn>/mean) flattened; reward/<domain> kept as is
            vals = {k.replace("/", "_") if k.count("/") > 1 else k: float(v) for k, v in logs.items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool)}
            if vals:
                mlflow.log_metrics(vals, step=state.global_step)
    return MlflowLogs()


RUN_RECORD = ".mlflow_run"   # in --out: the run that last wrote there


def record_run(out, run_id: str) -> None:
    """Note in `out` which MLflow run is writing there (read back by close_stale_run)."""
    try:
        (Path(out) / RUN_RECORD).write_text(run_id + "\n")
    except OSError as e:
        print(f"[mopd] could not write {Path(out) / RUN_RECORD}: {e}", file=sys.stderr)


def close_stale_run(out, uri: str, keep: str | None = None) -> str | None:
    """A run recorded in `out` that is still RUNNING, while this process holds the
    folder's lock, was killed where nothing could record it (SIGKILL, the kernel's OOM
    killer, a lost node): mark it KILLED, unless it is `keep` (the run a resume
    continues). Returns the id it closed. Never raises."""
    f = Path(out) / RUN_RECORD
    try:
        run_id = f.read_text().strip()
    except OSError:
        return None
    if not run_id or run_id == keep:
        return None
    try:
        client = mlflow.MlflowClient(tracking_uri=uri)
        if client.get_run(run_id).info.status != "RUNNING":
            return None
        client.set_tag(run_id, "mopd.ended_by", "found RUNNING at the next start in its folder: the process "
                                                "was killed before it could record its end")
        client.set_terminated(run_id, "KILLED")
    except Exception as e:  # noqa: BLE001 - a missing run or an unreachable store: nothing to close
        print(f"[mopd] could not close the earlier MLflow run {run_id}: {type(e).__name__}: {e}", file=sys.stderr)
        return None
    print(f"[mopd] MLflow run {run_id} of {out} was left RUNNING by a killed process: marked KILLED",
          file=sys.stderr)
    return run_id
