"""The top layer: the `mopd` command (`pipeline/cli.py`), the stage runner
(`pipeline/runner.py`), `mopd pipeline`'s plan (`pipeline/plan.py`, one module per stage
kind under `pipeline/stages/`, run by `pipeline/run.py`), the toy (`pipeline/toy.py`) and
the `mopd expert` entry point (`pipeline/expert.py`). Nothing imports it."""
