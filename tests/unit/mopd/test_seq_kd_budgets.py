"""seq-KD's budget matched to the MOPD run's both ways (issue 36, item 2): equal student
tokens (the default) or equal optimizer updates (`match`), and the pipeline report
says which one it used."""
from __future__ import annotations

import importlib
import json

import pytest
import torch

from core.sft import encode_example
from core.tiny import build_tiny_model
from evals.report import budget_lines
from mopd.distill.data import Prompt
from pipeline.config import SeqKDSection

S = importlib.import_module("mopd.baselines.seq_kd")   # the package exports the function seq_kd

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("seqkd_budget") / "teacher", seed=1)


def _prompts(n=40):
    return [Prompt(index=i, domain="alpha", teacher_key="alpha", messages=[{"role": "user", "content": f"Say {i}."}],
                   ids=[], columns={"effort": None}) for i in range(n)]


def test_rows_budget_gives_exactly_that_many_rows(tok, teacher):
    ds, tokens = S.seq_kd_dataset(iter(_prompts()), {"alpha": str(teacher)}, tok, budget_tokens=0, batch_size=2,
                                  max_new_tokens=6, gen_batch_size=4, progress=False, budget_rows=6)
    assert len(ds) == 6
    assert tokens == sum(len(encode_example(tok, p, c)[1]) for p, c in zip(ds["prompt"], ds["completion"]))


@pytest.mark.parametrize("match", ["tokens", "updates"])
def test_seq_kd_matches_tokens_or_updates(tok, teacher, tmp_path, match):
    """The same MOPD budget (60 student tokens, 5 updates): matched tokens trains on about
    60 tokens in whatever steps they make; matched updates makes exactly 5 steps of 2."""
    s = S.seq_kd(str(teacher), {"alpha": str(teacher)}, iter(_prompts()), tmp_path / match, budget_tokens=60,
                 budget_updates=5, match=match, batch_size=2, max_new_tokens=6, gen_batch_size=4, progress=False,
                 save_fractions=(0.4, 0.8))
    assert s["match"] == match
    if match == "updates":
        assert (s["steps"], s["rows"]) == (5, 10)
    else:
        assert abs(s["tokens"] - 60) <= 2 * max(1, s["tokens"] // s["rows"]) and s["steps"] == s["rows"] // 2
    # the curve's checkpoints (bench.capacity_gap): saved along the run, with the tokens seen so far
    log = json.loads((tmp_path / match / "sft_log.json").read_text())
    at = {int(k): v for k, v in log["checkpoint_tokens"].items()}
    assert sorted(at) == sorted({max(1, round(f * s["steps"])) for f in (0.4, 0.8)})
    assert all((tmp_path / match / "checkpoints" / f"step_{k}" / "config.json").exists() for k in at if k < s["steps"])
    assert list(at.values()) == sorted(at.values()) and max(at.values()) <= log["tokens"] == s["tokens"]


def test_answers_of_an_earlier_run_are_trained_on_without_asking_the_teachers(tok, teacher, tmp_path):
    """bench.harness_generalization's seeds share one set of expert episodes: a second run
    given the first's teacher_answers trains on exactly those rows (no teacher, no prompts),
    and its training seed still changes the student (the SFT's data order)."""
    import datasets
    from transformers import AutoModelForCausalLM

    kw = dict(budget_tokens=1, budget_updates=3, match="updates", batch_size=2, max_new_tokens=6, gen_batch_size=4,
              progress=False, lr=1e-2)
    first = S.seq_kd(str(teacher), {"alpha": str(teacher)}, iter(_prompts()), tmp_path / "a", seed=0, **kw)
    again = S.seq_kd(str(teacher), {}, iter([]), tmp_path / "b", seed=1, answers=tmp_path / "a" / "teacher_answers",
                     **kw)
    assert (again["rows"], again["steps"], again["tokens"]) == (first["rows"], first["steps"], first["tokens"])
    assert (datasets.load_from_disk(str(tmp_path / "b" / "teacher_answers"))["completion"]
            == datasets.load_from_disk(str(tmp_path / "a" / "teacher_answers"))["completion"])
    wa, wb = (AutoModelForCausalLM.from_pretrained(str(tmp_path / d / "model")).lm_head.weight for d in "ab")
    assert not torch.equal(wa, wb)
    with pytest.raises(ValueError, match="not a seq_kd teacher_answers folder"):
        S.seq_kd(str(teacher), {}, iter([]), tmp_path / "c", answers=tmp_path / "a", **kw)
    with pytest.raises(ValueError, match="has 6 rows, budget_updates x batch_size is 4 x 2"):
        S.seq_kd(str(teacher), {}, iter([]), tmp_path / "c", answers=tmp_path / "a" / "teacher_answers",
                 **{**kw, "budget_updates": 4})


def test_bad_match_is_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="match='rows'"):
        S.seq_kd("nowhere", {}, iter([]), tmp_path, budget_tokens=1, match="rows")
    with pytest.raises(ValueError, match="budget_updates >= 1"):
        S.seq_kd("nowhere", {}, iter([]), tmp_path, budget_tokens=1, match="updates")
    assert SeqKDSection().match == "tokens" and SeqKDSection(match="updates").match == "updates"


@pytest.mark.parametrize("match", ["tokens", "updates"])
def test_report_says_which_budget_seq_kd_matched(match):
    r = {"budgets": {"student": {"student_tokens": 1000, "updates": 10},
                     "seq_kd": {"student_tokens": 990, "updates": 14 if match == "tokens" else 10,
                                "matched": match}}}
    text = "\n".join(budget_lines(r, {}))
    what = "optimizer updates" if match == "updates" else "student tokens"
    assert f"seq-KD is matched to MOPD's {what} (baselines.seq_kd.match: {match})" in text


def test_pipeline_stage_hash_keeps_the_default_and_changes_with_updates(tmp_path):
    """baselines.seq_kd.match=tokens (the default) stays out of the hashed settings, so
    existing runs reuse their seq-KD; updates is a new stage (and the warm-up keeps tokens)."""
    from tests.unit.pipeline.test_no_silent_drops import plan, stage

    tokens = stage(plan(tmp_path), "baseline/seq_kd")
    updates = stage(plan(tmp_path, "baselines.seq_kd.match=updates"), "baseline/seq_kd")
    assert "match" not in tokens.settings and updates.settings["match"] == "updates"
    assert {k: v for k, v in updates.settings.items() if k != "match"} == tokens.settings
