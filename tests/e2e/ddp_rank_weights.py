"""`python -m mopd.distill` as `accelerate launch` runs it, plus one thing: before the run
closes, every rank writes its own copy of the student's weights to OUT/rank<r>.safetensors,
so a test can check that the ranks hold the same weights after the update (gradients
all-reduced), which the loop's own output (rank 0's export) cannot show."""
from __future__ import annotations

import runpy

from safetensors.torch import save_file

from mopd.distill import trainer

_close = trainer.MOPDTrainer.close


def _close_and_dump(self) -> None:
    sd = self.acc.unwrap_model(self.m.model).state_dict()
    save_file({k: v.detach().clone().contiguous() for k, v in sd.items()},
              str(self.out / f"rank{self.acc.process_index}.safetensors"))
    _close(self)


trainer.MOPDTrainer.close = _close_and_dump
runpy.run_module("mopd.distill", run_name="__main__")
