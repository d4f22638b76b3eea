"""`mopd eval` records what each task cost beside its score: eval.json's "cost" holds, per
model and column (math: per effort), the completion tokens per task (mean, p90) of the
batched, left-padded greedy eval, equal to what each prompt generates alone up to its EOS."""
from __future__ import annotations

import json

import torch
from conftest import mopd_in_process

from core.rollout import HFRollout, eos_ids
from core.sft import encode_prompt
from core.task_cost import completion_tokens, summary

N = 6


def _alone(model_dir, column) -> list[int]:
    """Each held-out prompt decoded on its own (no batch, no padding): its generated ids up
    to and including the first EOS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from experts.math.data import make_dataset

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    s = column
    ds = make_dataset("test", s["n"], seed=s["seed"], difficulty=s["difficulty"], effort=s["effort"])
    roll = HFRollout(model, tok, batch_size=1)
    out = []
    for p in ds["prompt"]:
        smp = roll.generate([encode_prompt(tok, p)], max_new_tokens=s["max_new_tokens"], temperature=0.0,
                            seeds=[0])[0]
        out.append(completion_tokens(smp.completion_ids, eos_ids(tok)))
    return out


def test_mopd_eval_records_tokens_per_task_per_effort(tiny_student_dir, tmp_path):
    out = tmp_path / "ev"
    r = mopd_in_process(["eval", "--models", f"tiny={tiny_student_dir}", "--domains", "math", "--n", str(N),
                         "--out", str(out)])
    assert r.returncode == 0, r.stderr
    ev = json.loads((out / "eval.json").read_text())
    assert ev["domains"] == ["math/low", "math/high"]
    assert "completion tokens per task" in r.stderr       # the printed table beside the scores
    for col in ev["domains"]:
        c = ev["cost"]["tiny"][col]
        assert c["n"] == N and set(c) == {"tokens", "n"}
        counts = _alone(tiny_student_dir, ev["settings"][col])
        assert 1 <= min(counts) and max(counts) <= ev["settings"][col]["max_new_tokens"]
        assert c["tokens"] == summary(counts), col
    # the EOS-heavy tiny model stops early on some rows: a count that ignored EOS would be the budget
    assert ev["cost"]["tiny"]["math/high"]["tokens"]["mean"] < ev["settings"]["math/high"]["max_new_tokens"]
