"""Baselines that show what MOPD buys, built from the same base and the same experts.

seq_kd        off-policy sequence-level distillation (Kim & Rush, 2016): each domain's
              teacher answers the MOPD train prompts and the student is fine-tuned on
              those answers, with the token budget MOPD trained on (seq_kd.py).
weight_avg    a uniform average of every teacher's parameters; no training (weight_avg.py).
mix_rl        joint RL (GRPO) over every domain's prompts and rewards at once, or the
              domains one after another (cascade), with MOPD's student samples (mix_rl.py).
budget        not a model: what each method costs, tokens and a FLOPs estimate from the
              model shapes (budget.py).

Each baseline model is exported like the student, so with `quant` enabled every model in
the report sits on the same INT4 grid: seq-KD and the weight average are fake-quantized
once at export (`export_checkpoint`), Mix-RL trains with QAT on, like the experts.
"""
from __future__ import annotations

from mopd.baselines.mix_rl import mix_rl, plan_phases
from mopd.baselines.seq_kd import mopd_prompt_stream, seq_kd, seq_kd_dataset
from mopd.baselines.weight_avg import export_checkpoint, weight_average

__all__ = ["mix_rl", "plan_phases", "seq_kd", "seq_kd_dataset", "mopd_prompt_stream", "weight_average", "export_checkpoint"]
