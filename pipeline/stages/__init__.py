"""One module per stage kind of `mopd pipeline`; each builds its stage's typed config
from the pipeline config (`config`), its Stage (`stage` / `stages`) and the function the
runner calls (`run`). pipeline/plan.py composes them in run order."""
