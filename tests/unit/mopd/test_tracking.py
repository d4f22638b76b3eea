"""MLflow that tells the truth: metrics survive a slow or locked store (buffered, retried,
never raised into training); a resume whose run is gone starts a linked new run; runs
end with the status they earned."""
from __future__ import annotations

import sqlite3
import subprocess
import sys

import mlflow
import pytest

from core.tracking import MetricLogger, end_run, start_run


class FlakyClient:
    """MlflowClient.log_batch that fails (like sqlite's "database is locked") `fails` times."""

    def __init__(self, fails: int):
        self.fails, self.calls, self.got = fails, 0, []

    def log_batch(self, run_id, metrics=()):
        self.calls += 1
        if self.calls <= self.fails:
            raise mlflow.exceptions.MlflowException("(sqlite3.OperationalError) database is locked")
        self.got.extend(metrics)


def test_metric_logger_buffers_and_retries_without_raising(capsys):
    client = FlakyClient(fails=3)
    log = MetricLogger("r", "sqlite:///x.db", client=client, retry_s=0.05)
    for step in range(1, 6):          # the training loop: never blocked, never raised into
        log.log({"loss": float(step), "lr": 0.1}, step=step)
    assert log.close(timeout=10) == 0
    assert sorted((m.step, m.key) for m in client.got) == sorted((s, k) for s in range(1, 6) for k in ("loss", "lr"))
    err = capsys.readouterr().err
    assert err.count("buffering") == 1, "warned once"


def test_a_name_mlflow_refuses_is_dropped_once_and_never_holds_the_others_back(capsys):
    client = FlakyClient(fails=0)
    log = MetricLogger("r", "sqlite:///x.db", client=client, retry_s=0.05)
    for step in (1, 2):
        log.log({"loss": 1.0, "kl/turn_4+": 2.0, "a/../b": 3.0}, step=step)
    assert log.close(timeout=10) == 0
    assert sorted((m.step, m.key) for m in client.got) == [(1, "loss"), (2, "loss")]
    err = capsys.readouterr().err
    assert err.count("MLflow refuses") == 1 and "kl/turn_4+" in err and "a/../b" in err


def test_every_metric_name_the_loop_can_log_is_one_mlflow_takes():
    import mlflow.utils.validation as V

    from mopd.distill.metrics import TURN_BUCKETS
    from core.tracking import valid_metric_name

    names = [f"reverse_kl/agent/turn_{k}" for k in TURN_BUCKETS] + ["agent/success/coding_agent", "loss"]
    names += [f"agent/token_age/agent/age_{k}" for k in ("0", "1", "2", "3plus")]
    for n in names:
        V._validate_metric_name(n)          # MLflow's own check raises on a bad name
        assert valid_metric_name(n), n
    for bad in ("x+", "a/../b", "/lead", "tab\tname"):
        assert not valid_metric_name(bad), bad


def test_metric_logger_writes_what_never_arrived(tmp_path):
    client = FlakyClient(fails=10 ** 6)
    log = MetricLogger("r", "sqlite:///x.db", client=client, retry_s=0.05, fallback=tmp_path / "unsent.jsonl")
    log.log({"loss": 1.0}, step=1)
    assert log.close(timeout=0.5) == 1
    assert '"step": 1' in (tmp_path / "unsent.jsonl").read_text()


@pytest.mark.ci   # second tier: waits out a locked store's timeout (~26 s); the fast tier stays under 10 minutes
def test_metrics_reach_a_store_that_was_locked_longer_than_its_timeout(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    with start_run(experiment="t", uri=uri) as run:
        run_id = run.info.run_id
    # another process holds an exclusive write lock on mlflow.db for 25 s
    locker = subprocess.Popen([sys.executable, "-c",
                               "import sqlite3, sys, time\n"
                               f"c = sqlite3.connect({str(tmp_path / 'mlflow.db')!r}, isolation_level=None)\n"
                               "c.execute('BEGIN EXCLUSIVE'); print('locked', flush=True); time.sleep(25)\n"
                               "c.execute('COMMIT')\n"], stdout=subprocess.PIPE, text=True)
    assert locker.stdout.readline().strip() == "locked"
    log = MetricLogger(run_id, uri, retry_s=0.5, max_retry_s=2)
    for step in range(1, 4):
        log.log({"loss": float(step)}, step=step)
    # logging returned while the store is still locked: it did not wait for the store
    assert locker.poll() is None, "log() waited until the lock was released"
    assert log.close(timeout=120) == 0
    locker.wait()
    hist = mlflow.MlflowClient(tracking_uri=uri).get_metric_history(run_id, "loss")
    assert sorted(m.step for m in hist) == [1, 2, 3]


def test_resume_of_a_run_gone_from_the_store_starts_a_linked_run(tmp_path):
    a, b = f"sqlite:///{tmp_path}/a.db", f"sqlite:///{tmp_path}/b.db"
    with start_run(experiment="t", uri=a) as run:
        old = run.info.run_id
    with start_run(experiment="t", uri=a, run_id=old) as again:
        assert again.info.run_id == old          # still there: the same run continues
    with start_run(experiment="t", uri=b, run_id=old) as new:
        assert new.info.run_id != old
    assert mlflow.MlflowClient(tracking_uri=b).get_run(new.info.run_id).data.tags["mopd.resumed_from_run_id"] == old


def test_a_parent_run_of_another_store_is_an_error_that_says_how_to_clear_it(tmp_path):
    """Issue 38: a stage's config.yaml, rerun against another store, failed with MLflow's
    'Run with id=<parent> not found'; now the error names mlflow.parent_run_id, says it
    is a run of another store, and gives the override that clears it."""
    a, b = f"sqlite:///{tmp_path}/a.db", f"sqlite:///{tmp_path}/b.db"
    with start_run(experiment="t", uri=a) as parent:
        pid = parent.info.run_id
    with start_run(experiment="t", uri=a, parent_run_id=pid) as child:   # its own store: nested
        assert mlflow.MlflowClient(tracking_uri=a).get_run(child.info.run_id).data.tags["mlflow.parentRunId"] == pid
    with pytest.raises(ValueError) as e:
        start_run(experiment="t", uri=b, parent_run_id=pid)
    msg = str(e.value)
    assert f"mlflow.parent_run_id={pid} is not a run of the MLflow store at {b}" in msg
    assert "mlflow.parent_run_id=null" in msg
    assert mlflow.active_run() is None


@pytest.mark.parametrize("status", ["FAILED", "KILLED"])
def test_end_run_records_the_status(tmp_path, status):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run = start_run(experiment="t", uri=uri)
    end_run(status)
    assert mlflow.active_run() is None
    assert mlflow.MlflowClient(tracking_uri=uri).get_run(run.info.run_id).info.status == status


def test_sqlite_lock_helper_really_locks(tmp_path):
    """Guard for the lock test above: BEGIN EXCLUSIVE blocks another writer."""
    db = tmp_path / "x.db"
    c1 = sqlite3.connect(db, isolation_level=None)
    c1.execute("create table t (x)")
    c1.execute("BEGIN EXCLUSIVE")
    c2 = sqlite3.connect(db, timeout=0.1)
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        c2.execute("insert into t values (1)")
    c1.execute("COMMIT")


def test_a_run_left_running_by_a_killed_process_is_marked_killed_at_the_next_start(tmp_path):
    import mlflow

    from core.tracking import close_stale_run, record_run

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("stale")
    dead = client.create_run(exp).info.run_id          # what SIGKILL leaves: RUNNING, forever
    record_run(tmp_path, dead)
    assert close_stale_run(tmp_path, uri, keep=dead) is None           # the run a resume continues
    assert client.get_run(dead).info.status == "RUNNING"
    assert close_stale_run(tmp_path, uri, keep="another") == dead
    assert client.get_run(dead).info.status == "KILLED"
    assert "killed" in client.get_run(dead).data.tags["mopd.ended_by"]
    assert close_stale_run(tmp_path, uri) is None                      # already closed: nothing to do
    finished = client.create_run(exp).info.run_id
    client.set_terminated(finished, "FINISHED")
    record_run(tmp_path, finished)
    assert close_stale_run(tmp_path, uri) is None and client.get_run(finished).info.status == "FINISHED"



def test_trainer_callback_logs_numeric_logs_to_the_active_run_from_rank_zero(tmp_path):
    from types import SimpleNamespace

    from core.tracking import trainer_callback

    cb = trainer_callback()
    logs = {"loss": 1.5, "reward/math": 0.25, "rewards/reward_math/mean": 0.5, "done": True, "note": "x"}
    rank0, rank1 = (SimpleNamespace(is_world_process_zero=z, global_step=3) for z in (True, False))
    cb.on_log(None, rank0, None, logs=logs)          # no active run: nothing, and no run is started
    assert mlflow.active_run() is None
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    with start_run(experiment="t", uri=uri) as run:
        cb.on_log(None, rank1, None, logs={"loss": 9.0})   # another rank: nothing
        cb.on_log(None, rank0, None, logs=logs)
    got = mlflow.MlflowClient(tracking_uri=uri).get_run(run.info.run_id).data.metrics
    assert got == {"loss": 1.5, "reward/math": 0.25, "rewards_reward_math_mean": 0.5}


class HeldClient:
    """A store that takes nothing until `open` is set (a slow or locked store)."""

    def __init__(self):
        import threading

        self.open, self.got = threading.Event(), []

    def log_batch(self, run_id, metrics=(), tags=()):
        self.open.wait()
        self.got.extend(metrics)


def test_logging_is_off_the_step_and_keeps_every_metric_in_order():
    """log() returns while the store still holds the first batch (the step never waits for
    MLflow); close() then delivers every metric of every step, steps in order."""
    client = HeldClient()
    log = MetricLogger("r", "sqlite:///x.db", client=client, retry_s=0.05)
    for step in range(1, 41):
        log.log({"loss": float(step), "kl": step / 10}, step=step)
    assert client.got == [] and log.pending > 0     # every log() returned with nothing sent yet
    client.open.set()
    assert log.close(timeout=10) == 0
    assert [(m.step, m.key) for m in client.got] == [(s, k) for s in range(1, 41) for k in ("loss", "kl")]


def test_a_process_that_exits_without_close_still_sends_its_metrics(tmp_path):
    """The logger flushes at interpreter exit: the last steps of a process that never calls
    close() are not lost with its daemon thread."""
    out = tmp_path / "got.txt"
    code = f"""
import time
from core.tracking import MetricLogger

class Slow:
    def log_batch(self, run_id, metrics=(), tags=()):
        time.sleep(0.3)
        with open({str(out)!r}, "a") as f:
            f.writelines(f"{{m.step}} {{m.key}}\\n" for m in metrics)

log = MetricLogger("r", "sqlite:///x.db", client=Slow())
for step in range(1, 8):
    log.log({{"loss": 1.0}}, step=step)
raise SystemExit(3)   # no close()
"""
    import os

    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert p.returncode == 3, p.stderr
    assert out.read_text().split("\n")[:-1] == [f"{s} loss" for s in range(1, 8)]
