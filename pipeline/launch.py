"""`mopd launch --config_file FILE [accelerate options] COMMAND ARGS...`: `accelerate launch
--config_file FILE [options] -m pipeline.cli COMMAND ARGS...`, whose failure ends in one line.

Why: when a rank exits non-zero, torch's elastic agent raises `ChildFailedError`, and
`accelerate launch` re-raises it (accelerate/commands/launch.py `multi_gpu_launcher`:
`except Exception: ... raise`), so a recipe's one-line error (printed once, by rank 0:
core/exitcodes.py) is followed by the launcher's own traceback and a failure table. Nothing
a rank does changes that: `@record` and TORCHELASTIC_ERROR_FILE only change what the table
says, and a rank that exits 0 on an error would make the launch succeed. This command runs
the same launcher in its own process and ends a failure with one line naming the rank and
its exit code, with that code (2 for a bad recipe) instead of the traceback; the agent's
log lines ("Sending process ... closing signal", "failed (exitcode: 2)") are silenced too.
`accelerate launch` itself still works as before and is what the docs show for training.
"""
from __future__ import annotations

import argparse
import logging
import sys

# accelerate launch's options that take a value and the flags that do not, passed through as given
VALUE_OPTIONS = ("--config_file", "--num_processes", "--num_machines", "--machine_rank", "--main_process_ip",
                 "--main_process_port", "--mixed_precision", "--gpu_ids")
FLAGS = ("--cpu", "--multi_gpu")


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("launch", help="accelerate launch -m pipeline.cli COMMAND ..., a failure ending in one line "
                       "(no launcher traceback): mopd launch --config_file recipes/accelerate/cpu_ddp2.yaml "
                       "distill --config R --out DIR")
    for o in VALUE_OPTIONS:
        p.add_argument(o, required=o == "--config_file", help=f"accelerate launch {o}")
    for f in FLAGS:
        p.add_argument(f, action="store_true", help=f"accelerate launch {f}")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the mopd command and its arguments")
    p.set_defaults(fn=main)
    return p


def accelerate_argv(args) -> list[str]:
    out = []
    for o in VALUE_OPTIONS:
        v = getattr(args, o[2:])
        if v is not None:
            out += [o, str(v)]
    out += [f for f in FLAGS if getattr(args, f[2:])]
    return [*out, "-m", "pipeline.cli", *args.command]


def main(args) -> int:
    from core.config import ConfigError
    from core.dryrun import DryRun, check_accelerate_config

    if not args.command:
        raise ConfigError("launch: name the command to launch, e.g. distill --config R --out DIR")
    dry = DryRun("mopd launch")   # accelerate's own message for a bad config file is a traceback too
    check_accelerate_config(args.config_file, dry)
    dry.raise_if_any()
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    for name in ("torch.distributed.elastic", "torch.distributed.run"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    launch_args = launch_command_parser().parse_args(accelerate_argv(args))
    try:
        launch_command(launch_args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
        print(f"mopd launch: {args.command[0]} failed on rank {rank} (exit code {failure.exitcode}); its message "
              f"is above", file=sys.stderr, flush=True)
        return code
    return 0
