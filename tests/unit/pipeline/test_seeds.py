"""pipeline `extra_seeds`: seeded copies of MOPD, seq-KD and Mix-RL (and their evals) in the
plan, the plain stages' hashes untouched, and the report's seeds section."""
import json

import pytest

from evals.report import build_report, render_markdown, seed_summary
from core.config import ConfigError, load_config
from pipeline.config import PipelineConfig
from pipeline.plan import build_plan
from pipeline.runner import stable_hash

from tests.unit.pipeline.test_mix_rl import TINY


def _stages(tmp_path, *more):
    cfg = load_config(PipelineConfig, TINY, ["domains=[math,tool_use]", "train.max_steps=6", *more])
    return {s.name: s for s in build_plan(cfg, tmp_path / "run").stages}


def test_extra_seeds_add_seeded_copies_and_leave_the_plain_stages_alone(tmp_path):
    plain = _stages(tmp_path)
    st = _stages(tmp_path, "extra_seeds=[1, 2]")
    assert {n: (stable_hash(s.settings), s.deps) for n, s in plain.items() if n != "report"} == \
        {n: (stable_hash(st[n].settings), st[n].deps) for n in plain if n != "report"}
    for seed in (1, 2):
        m, sk, mr = st[f"mopd/seed{seed}"], st[f"baseline/seq_kd/seed{seed}"], st[f"baseline/mix_rl/seed{seed}"]
        assert m.settings["train"]["seed"] == seed and stable_hash(m.settings) != stable_hash(plain["mopd"].settings)
        assert str(m.out).endswith(f"seeds/seed{seed}/mopd")
        # seq-KD of seed N: that seed's training, replaying seed N's MOPD stream, matched to its tokens
        assert sk.settings["seed"] == seed and sk.settings["prompts"]["seed"] == seed
        assert f"mopd/seed{seed}" in sk.deps and "mopd" not in sk.deps
        assert str(sk.out).endswith(f"seeds/seed{seed}/baselines/seq_kd")
        assert mr.settings["rl"]["seed"] == seed and mr.settings["prompts"]["seed"] == seed
        assert str(mr.out).endswith(f"seeds/seed{seed}/baselines/mix_rl")
        for model, src in (("student", "mopd"), ("seq_kd", "baseline/seq_kd"), ("mix_rl", "baseline/mix_rl")):
            e = st[f"eval/{model}/seed{seed}"]
            assert e.deps[0] == f"{src}/seed{seed}" and f"eval/{model}/seed{seed}" in st["report"].deps
    assert not any(n.startswith(("baseline/warmup", "baseline/weight_avg")) and "seed" in n for n in st)
    # every training stage computes something else (an eval's settings are its columns; its
    # model comes in through its deps)
    hashed = [stable_hash(s.settings) for n, s in st.items() if n.startswith(("mopd", "baseline/"))]
    assert len(set(hashed)) == len(hashed)


def test_extra_seeds_follow_the_enabled_baselines_and_are_checked(tmp_path):
    st = _stages(tmp_path, "extra_seeds=[3]", "baselines.mix_rl.enabled=false")
    assert "mopd/seed3" in st and "baseline/seq_kd/seed3" in st and "baseline/mix_rl/seed3" not in st
    for bad in ("extra_seeds=[1, 1]", "extra_seeds=[-1]"):
        with pytest.raises((ConfigError, ValueError), match="extra_seeds"):
            _stages(tmp_path, bad)


def _ev(scores):
    return {"domains": ["a", "b"], "scores": scores, "settings": {"a": {"n": 100}, "b": {"n": 100}}}


def test_seed_summary_and_the_report_section(tmp_path):
    scores = {"teacher/a": {"a": 0.9}, "teacher/b": {"b": 0.8}, "base": {"a": 0.0, "b": 0.0},
              "student": {"a": 0.6, "b": 0.4}, "student/seed1": {"a": 0.7, "b": 0.5},
              "seq_kd": {"a": 0.5, "b": 0.4}, "seq_kd/seed1": {"a": 0.5, "b": 0.6},
              "mix_rl": {"a": 0.1, "b": 0.1}, "mix_rl/seed1": {"a": 0.2}}
    groups = {"student": ["student", "student/seed1"], "seq_kd": ["seq_kd", "seq_kd/seed1"],
              "mix_rl": ["mix_rl", "mix_rl/seed1"]}
    s = seed_summary(_ev(scores), ["a", "b"], groups)
    assert s["student"]["means"] == pytest.approx([0.5, 0.6]) and s["student"]["mean"] == pytest.approx(0.55)
    assert s["student"]["std"] == pytest.approx(0.0707, abs=1e-4)
    assert s["seq_kd"]["by_domain"]["b"]["mean"] == pytest.approx(0.5)
    assert s["mix_rl"]["models"] == ["mix_rl"] and s["mix_rl"]["missing"] == ["mix_rl/seed1"]
    assert s["paired"]["seq_kd"]["diffs"] == pytest.approx([0.05, 0.05])
    assert "mix_rl" not in s["paired"]          # a missing run cannot be paired
    r = build_report(_ev(scores), [], tmp_path, seeds=groups)
    assert json.loads((tmp_path / "report.json").read_text())["seeds"]["student"]["mean"] == pytest.approx(0.55)
    md = render_markdown(r)
    assert "## Training seeds" in md and "0.550 ± 0.071" in md and "+0.050, +0.050" in md
    assert "## Training seeds" not in render_markdown(build_report(_ev(scores), [], tmp_path / "plain"))
