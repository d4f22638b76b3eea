"""The MOPD loop: on-policy samples from the student, scored token by token by the
teacher of each prompt's domain, trained with an importance-corrected policy gradient.

    accelerate launch -m mopd.distill --config recipes/mopd/toy.yaml --out runs/toy [key=value ...]
    mopd distill --config recipes/mopd/toy.yaml --out runs/toy

`run()` checks everything that needs no model (`inputs.check_inputs`), opens the MLflow
run, then hands over to `trainer.MOPDTrainer`, whose methods are the steps: per sampled
batch `sample` -> `score` (and correct) -> per minibatch `update` -> `log` -> `save`, then
`sync` (the new weights into the sampler). Every rank samples its own shard of the global
batch with its own colocated sampler; the gradient is averaged by DDP/FSDP, so the update
does not depend on how many processes share the batch.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


from core import ranks
from core.config import describe_fields, load_config
from mopd.distill.checkpoints import read_state
from mopd.distill.config import DistillConfig
from mopd.distill.inputs import check_inputs, start_mlflow
from mopd.distill.signals import Interrupted, StopOnSignal, follow_launcher
from mopd.distill.trainer import MOPDTrainer, StepCallback
from core.outdir import hold_out_dir
from core.tracking import MetricLogger, close_stale_run, end_run, record_run, resolve_uri


def run(cfg: DistillConfig, out: str | Path, progress: bool = True,
        callbacks: list[StepCallback] | None = None) -> dict:
    """Run (or resume) a distillation; returns the per-step metric history.

    The MLflow run ends FINISHED, FAILED (any error) or KILLED (a signal, Ctrl-C); on
    SIGTERM / SIGINT a checkpoint of the last finished step is saved first."""
    out = Path(out)
    accelerator = ranks.accelerator()
    main = accelerator.is_main_process
    lock = hold_out_dir(out, "mopd distill") if main else None  # noqa: F841 - one writer per --out, held to the end
    inputs = check_inputs(cfg, out, accelerator)
    old_run_id = inputs.old_run_id
    stop = StopOnSignal()
    follow_launcher()
    status, metrics, trainer = "FAILED", None, None
    try:
        # the store is opened (and a bad one reported) before any model is loaded
        run_id = start_mlflow(cfg, out, old_run_id, inputs.domains, fresh=inputs.ckpt is None,
                              changed=inputs.changed, ckpt=inputs.ckpt) if main else None
        if main:   # the lock is ours: a run recorded here and still RUNNING was killed (SIGKILL, OOM)
            uri = resolve_uri(cfg.mlflow.tracking_uri, out)
            close_stale_run(out, uri, keep=run_id)
            record_run(out, run_id)
            metrics = MetricLogger(run_id, uri, fallback=out / "metrics_unsent.jsonl",
                                   resumed_from=read_state(inputs.ckpt).get("step", 0) if inputs.ckpt is not None else None)
        trainer = MOPDTrainer(cfg, out, accelerator, inputs, run_id=run_id, metrics=metrics, stop_signal=stop,
                              progress=progress, callbacks=callbacks)
        result = trainer.train()
        status = "FINISHED"
        return result
    except (KeyboardInterrupt, Interrupted):
        status = "KILLED"
        raise
    finally:
        if trainer is None and inputs.rollout is not None:   # the sampler server opened by check_inputs
            inputs.rollout.close()
        elif trainer is not None and status == "FAILED":
            # an error inside a step: its engines go now, or a later run in this process (a test
            # session, a sweep) finds their memory and threads still held
            try:
                trainer.close()
            except Exception as e:  # noqa: BLE001 - the step's own error is the one to report
                print(f"[mopd] closing the sampler and teachers after the failure: {type(e).__name__}: {e}",
                      file=sys.stderr)
        try:
            if metrics is not None:   # a preempted job has seconds, a finished one can wait for the store
                metrics.close(timeout=120.0 if status == "FINISHED" else 15.0)
            if main:
                end_run(status)
        finally:
            # restored last: a signal during the wait for the store must not kill the
            # process before its MLflow run is ended (it would stay RUNNING)
            stop.restore()


def print_config_help(cls=DistillConfig, prefix: str = "") -> None:
    """Every recipe key with its type, default and help text."""
    for line in describe_fields(cls, prefix):
        print(line)


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(prog="mopd.distill", description=__doc__.split("\n")[0])
    ap.add_argument("--config")
    ap.add_argument("--out")
    ap.add_argument("--help-config", action="store_true", help="print every recipe key with its help and exit")
    ap.add_argument("overrides", nargs="*", help="key=value, e.g. train.max_steps=10")
    args = ap.parse_args(argv)
    if args.help_config:
        print_config_help()
        return
    if not args.config or not args.out:
        ap.error("--config and --out are required")
    cfg = load_config(DistillConfig, args.config, args.overrides)
    from mopd.distill.dryrun import preflight   # every problem `--dry-run` names, at once, before any model loads

    preflight(cfg, args.out)
    run(cfg, args.out)
