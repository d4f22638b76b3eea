"""`mopd pipeline`: stage caching (hashes, upstream invalidation, --force, resume after a
kill) with fake stage functions, and the pipeline config and plan without training."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from experts.run import ExpertConfig
from core.config import ConfigError, load_config
from pipeline.config import PipelineConfig
from pipeline.plan import build_plan
from pipeline.runner import Stage, StageRunner

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "recipes" / "pipeline" / "tiny.yaml"


# ----------------------------------------------------------------------------- fake stages
class Fake:
    """A diamond a -> (b, c) -> d, plus an always-run report; records which stages ran."""

    def __init__(self, root: Path):
        self.root = root
        self.calls: list[str] = []
        self.resumed: list[str] = []
        self.settings = {"a": 1, "b": 1, "c": 1, "d": 1}
        self.crash: str | None = None

    def fn(self, name):
        def run(ctx):
            self.calls.append(name)
            if ctx.resume:
                self.resumed.append(name)
            if ctx.out is not None:
                ctx.out.mkdir(parents=True, exist_ok=True)
                (ctx.out / "partial").write_text("x")
            if self.crash == name:
                raise RuntimeError(f"killed in {name}")
            ups = sorted(ctx.inputs)
            return {"value": f"{name}({','.join(ctx.inputs[u]['value'] for u in ups)})"}
        return run

    def stages(self, resumable=("c",)):
        r = self.root
        return [
            Stage("a", {"x": self.settings["a"]}, self.fn("a"), out=r / "a"),
            Stage("b", {"x": self.settings["b"]}, self.fn("b"), deps=["a"], out=r / "b"),
            Stage("c", {"x": self.settings["c"]}, self.fn("c"), deps=["a"], out=r / "c",
                  resumable="c" in resumable),
            Stage("d", {"x": self.settings["d"]}, self.fn("d"), deps=["b", "c"], out=r / "d"),
            Stage("report", None, self.fn("report"), deps=["d"], always=True),
        ]

    def run(self, force=()):
        self.calls = []
        out = StageRunner(self.root, force=list(force), log=lambda m: None).run(self.stages())
        return out


def test_first_run_runs_everything_second_reuses_all(tmp_path):
    f = Fake(tmp_path)
    out = f.run()
    assert f.calls == ["a", "b", "c", "d", "report"]
    assert out["d"]["value"] == "d(b(a()),c(a()))"
    out2 = f.run()
    assert f.calls == ["report"]           # only the always-run stage
    assert out2["d"] == out["d"]            # outputs come back from the markers
    marker = json.loads((tmp_path / "stages" / "d.json").read_text())
    assert marker["status"] == "done" and set(marker["upstream"]) == {"b", "c"}


def test_edit_redoes_the_stage_and_its_downstream_only(tmp_path):
    f = Fake(tmp_path)
    f.run()
    f.settings["b"] = 2
    f.run()
    assert f.calls == ["b", "d", "report"]  # c is a sibling: kept
    f.settings["a"] = 2
    f.run()
    assert f.calls == ["a", "b", "c", "d", "report"]


def test_hash_includes_upstream_hashes(tmp_path):
    f = Fake(tmp_path)
    r = StageRunner(tmp_path)
    h1 = {s: h for s, h, _ in r.plan(f.stages())}
    f.settings["a"] = 5
    h2 = {s: h for s, h, _ in r.plan(f.stages())}
    assert all(h1[s] != h2[s] for s in ("a", "b", "c", "d", "report"))
    f.settings["a"], f.settings["c"] = 1, 9
    h3 = {s: h for s, h, _ in r.plan(f.stages())}
    assert h3["a"] == h1["a"] and h3["b"] == h1["b"] and h3["c"] != h1["c"] and h3["d"] != h1["d"]


def test_force_redoes_one_stage_and_what_depends_on_it(tmp_path):
    f = Fake(tmp_path)
    f.run()
    f.run(force=["c"])
    assert f.calls == ["c", "d", "report"]
    f.run(force=["b", "c"])
    assert f.calls == ["b", "c", "d", "report"]
    f.run()
    assert f.calls == ["report"]
    f.run(force=["r*"])                      # globs
    assert f.calls == ["report"]
    with pytest.raises(ValueError, match="matches no stage"):
        f.run(force=["nope"])


def test_plan_without_running(tmp_path):
    f = Fake(tmp_path)
    r = StageRunner(tmp_path)
    assert [a for _, _, a in r.plan(f.stages())] == ["run"] * 5
    f.run()
    assert [a for _, _, a in StageRunner(tmp_path).plan(f.stages())] == ["cached"] * 4 + ["run"]
    f.settings["c"] = 3
    plan = dict((s, a) for s, _, a in StageRunner(tmp_path).plan(f.stages()))
    assert plan == {"a": "cached", "b": "cached", "c": "run", "d": "run", "report": "run"}
    plan = dict((s, a) for s, _, a in StageRunner(tmp_path, force=["a"]).plan(f.stages()))
    assert plan == {"a": "run", "b": "run", "c": "run", "d": "run", "report": "run"}
    assert not f.calls == []  # plan() itself ran nothing new
    assert json.loads((tmp_path / "stages" / "c.json").read_text())["hash"]


def test_killed_resumable_stage_resumes_others_restart(tmp_path):
    f = Fake(tmp_path)
    f.crash = "c"
    with pytest.raises(RuntimeError, match="killed in c"):
        f.run()
    assert json.loads((tmp_path / "stages" / "c.json").read_text())["status"] == "running"
    f.crash = None
    # the killed attempt wrote its last file 30 s after it started: that time counts
    marker = json.loads((tmp_path / "stages" / "c.json").read_text())
    import datetime
    import os
    t0 = datetime.datetime.fromisoformat(marker["started"]).timestamp()
    os.utime(tmp_path / "c" / "partial", (t0 + 30, t0 + 30))
    f.run()
    assert f.calls == ["c", "d", "report"] and f.resumed == ["c"]
    assert (tmp_path / "c" / "partial").exists()
    secs = json.loads((tmp_path / "stages" / "c.json").read_text())["seconds"]
    assert 30 <= secs < 40, secs

    # a non-resumable stage killed mid-way starts over in a fresh folder
    f.settings["b"] = 7
    f.crash = "b"
    with pytest.raises(RuntimeError):
        f.run()
    (tmp_path / "b" / "leftover").write_text("stale")
    f.crash, f.resumed = None, []
    f.run()
    assert f.calls == ["b", "d", "report"] and f.resumed == []
    assert not (tmp_path / "b" / "leftover").exists()


# ----------------------------------------------------------------------------- jobs > 1
def _timed_stages(root, log, sleep, concurrent=("b", "c"), crash=None):
    import threading
    import time as _t
    lock = threading.Lock()

    def fn(name):
        def run(ctx):
            with lock:
                log.append(("start", name, ctx.concurrent))
            _t.sleep(sleep.get(name, 0.0))
            if name == crash:
                raise RuntimeError(f"boom in {name}")
            with lock:
                log.append(("end", name, ctx.concurrent))
            return {"value": name}
        return run
    return [Stage("a", {}, fn("a"), out=root / "a"),
            Stage("b", {}, fn("b"), deps=["a"], out=root / "b", concurrent="b" in concurrent, cost=1),
            Stage("c", {}, fn("c"), deps=["a"], out=root / "c", concurrent="c" in concurrent, cost=2),
            Stage("d", {}, fn("d"), deps=["b", "c"], out=root / "d")]


def test_jobs_two_runs_concurrent_stages_side_by_side(tmp_path):
    log: list = []
    stages = _timed_stages(tmp_path, log, {"b": 0.3, "c": 0.3})
    out = StageRunner(tmp_path, log=lambda m: None, jobs=2).run(stages)
    assert set(out) == {"a", "b", "c", "d"}
    order = [(e, n) for e, n, _ in log]
    # b and c both start before either ends; a before, d after both
    assert order[0] == ("start", "a") and order[1] == ("end", "a")
    assert set(order[2:4]) == {("start", "c"), ("start", "b")}
    assert order[-2:] == [("start", "d"), ("end", "d")]
    assert all(conc for e, n, conc in log if n in "bc") and not any(conc for e, n, conc in log if n in "ad")
    # and a rerun reuses everything, also with jobs
    log.clear()
    StageRunner(tmp_path, log=lambda m: None, jobs=2).run(_timed_stages(tmp_path, log, {}))
    assert log == []


def test_jobs_two_never_runs_a_non_concurrent_stage_beside_another(tmp_path):
    log: list = []
    stages = _timed_stages(tmp_path, log, {"b": 0.3, "c": 0.1}, concurrent=("b",))
    StageRunner(tmp_path, log=lambda m: None, jobs=2).run(stages)
    active, worst = set(), 0
    for e, n, _ in log:
        active = active | {n} if e == "start" else active - {n}
        if "c" in active:
            worst = max(worst, len(active))
    assert worst == 1            # c (not concurrent) ran alone, after b ended


def test_jobs_two_failure_lets_the_running_stage_finish_then_raises(tmp_path):
    log: list = []
    stages = _timed_stages(tmp_path, log, {"b": 0.3, "c": 0.05}, crash="c")
    with pytest.raises(RuntimeError, match="boom in c"):
        StageRunner(tmp_path, log=lambda m: None, jobs=2).run(stages)
    assert ("end", "b", True) in log and not any(n == "d" for _, n, _ in log)
    assert json.loads((tmp_path / "stages" / "b.json").read_text())["status"] == "done"
    assert json.loads((tmp_path / "stages" / "c.json").read_text())["status"] == "running"
    log.clear()   # the rerun redoes c only, then d
    StageRunner(tmp_path, log=lambda m: None, jobs=2).run(_timed_stages(tmp_path, log, {}))
    assert [n for e, n, _ in log if e == "start"] == ["c", "d"]


def test_killed_stage_with_changed_settings_restarts(tmp_path):
    f = Fake(tmp_path)
    f.crash = "c"
    with pytest.raises(RuntimeError):
        f.run()
    f.crash, f.settings["c"] = None, 2
    f.run()
    assert "c" in f.calls and f.resumed == []


def test_missing_checkpoint_is_not_reused(tmp_path):
    ck = tmp_path / "ck"

    def make(ctx):
        ck.mkdir(exist_ok=True)
        calls.append(1)
        return {"checkpoint": str(ck)}

    calls: list[int] = []
    stages = [Stage("m", {"k": 1}, make)]
    StageRunner(tmp_path, log=lambda m: None).run(stages)
    StageRunner(tmp_path, log=lambda m: None).run(stages)
    assert len(calls) == 1
    ck.rmdir()
    StageRunner(tmp_path, log=lambda m: None).run(stages)
    assert len(calls) == 2


def test_bad_stage_order_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="do not come before"):
        StageRunner(tmp_path).run([Stage("b", {}, lambda c: {}, deps=["a"]), Stage("a", {}, lambda c: {})])


# ----------------------------------------------------------------------------- config and plan
def test_pipeline_yaml_loads_with_overrides():
    cfg = load_config(PipelineConfig, TINY, ["domains=[math]", "train.max_steps=2", "eval.n=8",
                                             "experts.domains={math/low: {sft: [train.lr=0.01]}}"])
    assert cfg.domains == ["math"] and cfg.train.max_steps == 2 and cfg.eval.n == 8
    assert cfg.experts.domains["math/low"].sft == ["train.lr=0.01"]
    assert cfg.mopd.recipe.endswith("pipeline.yaml") and cfg.baselines.seq_kd.enabled


def test_pipeline_yaml_errors_name_key_and_file(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(PipelineConfig, TINY, ["mopd.bogus=1"])
    assert "bogus" in str(e.value) and "tiny.yaml" in str(e.value)
    with pytest.raises(ConfigError, match="max_steps must be >= 1"):
        load_config(PipelineConfig, TINY, ["train.max_steps=0"])


def test_plan_for_math_wires_stages(tmp_path):
    """The plan resolves every stage's config up front: experts from the base into DIR,
    QAT on, teachers keyed domain/effort, the student's quant equal to the experts'."""
    cfg = load_config(PipelineConfig, TINY, ["domains=[math]", "train.max_steps=3",
                                             "experts.domains={math/high: {rl: [train.lr=0.001]}}",
                                             "baselines.mix_rl.enabled=true",       # off in tiny.yaml
                                             "baselines.warmup_mopd.enabled=true"])
    plan = build_plan(cfg, tmp_path / "run")
    names = [s.name for s in plan.stages]
    assert names == ["data", "base", "expert/math/low/sft", "expert/math/low/rl", "expert/math/high/sft",
                     "expert/math/high/rl", "mopd", "baseline/warmup", "baseline/warmup_mopd", "baseline/seq_kd",
                     "baseline/weight_avg", "baseline/mix_rl", "eval/base", "eval/teacher/math/low",
                     "eval/teacher/math/high", "eval/student", "eval/seq_kd", "eval/weight_avg", "eval/mix_rl",
                     "eval/warmup_mopd", "report"]
    root = str((tmp_path / "run").resolve())
    m = plan.mopd_cfg
    assert m.model.path == f"{root}/base/model"
    assert sorted(m.teachers) == ["math/high", "math/low"]
    assert m.teachers["math/low"].path == f"{root}/experts/math-low/rl/model"
    assert sorted(d.path for d in m.data.datasets) == [f"{root}/data/math-high", f"{root}/data/math-low"]
    assert m.quant.enabled and m.train.max_steps == 3
    assert m.mlflow.tracking_uri == f"sqlite:///{root}/mlflow.db"
    st = {s.name: s for s in plan.stages}
    assert st["expert/math/low/rl"].deps == ["expert/math/low/sft"]
    assert st["expert/math/high/rl"].settings["train"]["lr"] == 0.001
    assert st["expert/math/low/rl"].settings["train"]["lr"] != 0.001
    assert st["expert/math/low/rl"].settings["model"]["path"] == "$OUT/experts/math-low/sft/model"
    assert st["expert/math/low/sft"].settings["quant"]["enabled"] is True
    assert st["expert/math/low/rl"].settings["train"]["max_steps"] == 3
    assert "mlflow" not in st["mopd"].settings and "mlflow" not in st["base"].settings  # the store is no setting
    assert st["mopd"].resumable and set(st["mopd"].deps) >= {"expert/math/low/rl", "expert/math/high/rl"}
    assert [c.name for c in plan.columns] == ["math/low", "math/high"]
    assert st["eval/teacher/math/low"].settings[0]["name"] == "math/low" and len(st["eval/teacher/math/low"].settings) == 1
    assert all(a == "run" for _, _, a in StageRunner(plan.root).plan(plan.stages))

    # an edit of one key's recipe changes that key's hashes and what depends on them only
    h1 = {s: h for s, h, _ in StageRunner(plan.root).plan(plan.stages)}
    cfg2 = load_config(PipelineConfig, TINY, ["domains=[math]", "train.max_steps=3",
                                              "experts.domains={math/high: {rl: [train.lr=0.002]}}",
                                              "baselines.mix_rl.enabled=true", "baselines.warmup_mopd.enabled=true"])
    plan2 = build_plan(cfg2, tmp_path / "run")
    h2 = {s: h for s, h, _ in StageRunner(plan2.root).plan(plan2.stages)}
    changed = {s for s in h1 if h1[s] != h2[s]}
    assert changed == {"expert/math/high/rl", "mopd", "baseline/seq_kd", "baseline/weight_avg",
                       "baseline/warmup", "baseline/warmup_mopd", "eval/teacher/math/high", "eval/student",
                       "eval/seq_kd", "eval/weight_avg", "eval/warmup_mopd", "report"}
    # the same settings in another folder hash the same (paths in DIR are written as $OUT)
    plan3 = build_plan(cfg2, tmp_path / "elsewhere")
    h3 = {s: h for s, h, _ in StageRunner(plan3.root).plan(plan3.stages)}
    assert h3 == h2
    # ... and so does a run logged to another MLflow store
    cfg2.mlflow.tracking_uri = "sqlite:////tmp/other.db"
    plan4 = build_plan(cfg2, tmp_path / "run")
    assert {s: h for s, h, _ in StageRunner(plan4.root).plan(plan4.stages)} == h2


def test_plan_rejects_unknown_domains(tmp_path):
    cfg = load_config(PipelineConfig, TINY, ["domains=[nosuch]"])
    with pytest.raises(ConfigError, match="nosuch"):
        build_plan(cfg, tmp_path)
    cfg = load_config(PipelineConfig, TINY, ["domains=[math]", "experts.domains={math/medium: {}}"])
    with pytest.raises(ConfigError, match="math/medium"):
        build_plan(cfg, tmp_path)


def test_eval_columns_come_from_the_expert_recipes():
    """`mopd eval` columns: one per effort for math, settings from recipes/experts/math/rl-*.yaml."""
    from evals.run import columns_for, parse_domains, parse_models

    cols = columns_for(["math"], n=5, max_new_tokens={"math/high": 40})
    assert [(c.name, c.effort, c.n) for c in cols] == [("math/low", "low", 5), ("math/high", "high", 5)]
    low = load_config(ExpertConfig, REPO / "recipes/experts/math/rl-low.yaml")
    assert cols[0].max_new_tokens == low.eval.max_new_tokens and cols[1].max_new_tokens == 40
    assert cols[0].difficulty == low.data.difficulty and cols[0].seed == low.data.seed
    assert parse_models("a=/x, b=models:/math-low-expert@teacher") == {"a": "/x", "b": "models:/math-low-expert@teacher"}
    with pytest.raises(ValueError, match="name=path"):
        parse_models("nopath")
    assert "math" in parse_domains("all")
    with pytest.raises(ValueError, match="nosuch"):
        parse_domains("math,nosuch")


def _chat_plan(tmp_path, *overrides):
    recipes = tmp_path / "recipes"
    (recipes / "chat").mkdir(parents=True, exist_ok=True)
    common = ("domain: chat\nmodel: {path: runs/base/model}\neval: {max_new_tokens: 40}\n"
              "quant: {enabled: true, group_size: 32, convention: llm-compressor}\n")
    (recipes / "chat" / "sft.yaml").write_text(common + "stage: sft\n")
    (recipes / "chat" / "rl.yaml").write_text(common + "stage: rl\nrl: {reward_kwargs: {reward_model: somewhere}}\n")
    cfg = load_config(PipelineConfig, TINY, [f"experts.recipes={recipes}", "domains=[]", "experts.domains={}",
                                             "eval.n_per_domain={}", "experts.chat_rm.steps=5",
                                             *overrides])
    plan = build_plan(cfg, tmp_path / "run")
    return plan, {s.name: s for s in plan.stages}


def test_plan_with_chat_trains_the_reward_model_from_the_chat_sft_checkpoint(tmp_path):
    """By default the RM starts from the chat SFT checkpoint (InstructGPT-style): it runs
    after chat SFT, which therefore does not score itself; chat RL and every chat eval use it."""
    plan, st = _chat_plan(tmp_path)
    names = list(st)
    assert names.index("expert/chat/sft") < names.index("chat_rm") < names.index("expert/chat/rl")
    assert st["chat_rm"].deps == ["expert/chat/sft"]
    assert "chat_rm" not in st["expert/chat/sft"].deps
    assert st["expert/chat/sft"].settings["eval"]["score"] is False
    assert st["expert/chat/rl"].settings["eval"]["score"] is True
    assert "chat_rm" in st["expert/chat/rl"].deps
    assert "chat_rm" in st["eval/base"].deps and "chat_rm" in st["eval/student"].deps
    StageRunner(tmp_path / "run").check(plan.stages)   # a valid topological order


@pytest.mark.parametrize("init,deps", [("random", []), ("base", ["base"])])
def test_plan_with_chat_rm_from_random_or_base_trains_it_first(tmp_path, init, deps):
    plan, st = _chat_plan(tmp_path, f"experts.chat_rm.init={init}")
    names = list(st)
    assert names.index("chat_rm") < names.index("expert/chat/sft")
    assert st["chat_rm"].deps == deps
    assert "chat_rm" in st["expert/chat/sft"].deps and "chat_rm" in st["expert/chat/rl"].deps
    assert st["expert/chat/sft"].settings["eval"]["score"] is True


def test_plan_with_chat_wires_the_reward_model_everywhere(tmp_path):
    """The chat expert is trained and scored with the reward model of the chat_rm stage."""
    plan, st = _chat_plan(tmp_path)
    assert st["expert/chat/rl"].settings["rl"]["reward_kwargs"] == {"reward_model": "$OUT/chat_rm"}
    assert st["chat_rm"].settings["steps"] == 5
    root = str((tmp_path / "run").resolve())
    assert plan.columns[0].name == "chat" and plan.columns[0].reward_kwargs == {"reward_model": f"{root}/chat_rm"}
    assert plan.columns[0].max_new_tokens == 40
    assert list(plan.mopd_cfg.teachers) == ["chat"]


def test_jobs_two_prints_where_each_running_stage_is(tmp_path):
    import time as _t
    lines: list[str] = []

    def fn(ctx):
        ctx.log.parent.mkdir(parents=True, exist_ok=True)
        ctx.log.write_text("sft model:  3%|   | 12/400 [00:01<02:00, 3.2it/s]")
        _t.sleep(0.6)
        return {}
    r = StageRunner(tmp_path, log=lines.append, jobs=2)
    r.heartbeat_s = 0.2
    r.run([Stage("x", {}, fn, concurrent=True), Stage("y", {}, fn, concurrent=True)])
    beats = [ln for ln in lines if ln.startswith("  ...")]
    assert beats and "x " in beats[0] and "y " in beats[0] and "12/400" in beats[0]


def test_jobs_two_starts_the_longest_chain_first(tmp_path):
    """Three concurrent stages, two slots: the two with the costliest chains start first;
    r (cheap itself, but r2 waits on it) outranks m; when r ends, r2 (cost 5) outranks m
    (cost 4) for the free slot, so m starts last.

    No sleeps: the stages hand over with events, so the order asserted is the scheduler's
    and not the machine's speed (0.3 s sleeps raced a loaded CI machine). The first two
    stages to start wait for each other; big, the long one, ends only once a third has
    started, so the slot r frees is the one being decided."""
    import threading
    lock, log = threading.Lock(), []
    two_started, third_started = threading.Event(), threading.Event()

    def fn(name):
        def run(ctx):
            with lock:
                log.append(("start", name))
                starts = sum(1 for e in log if e[0] == "start")
            (two_started if starts == 2 else third_started if starts == 3 else threading.Event()).set()
            if starts <= 2:
                assert two_started.wait(60), "the second slot never started a stage"
            if name == "big":
                assert third_started.wait(60), "no stage started in the slot another freed"
            with lock:
                log.append(("end", name))
            return {}
        return run
    st = [Stage("big", {}, fn("big"), concurrent=True, cost=10),
          Stage("m", {}, fn("m"), concurrent=True, cost=4),
          Stage("r", {}, fn("r"), concurrent=True, cost=1),
          Stage("r2", {}, fn("r2"), deps=["r"], concurrent=True, cost=5)]
    StageRunner(tmp_path, log=lambda m: None, jobs=2).run(st)
    starts = [name for kind, name in log if kind == "start"]
    assert set(starts[:2]) == {"big", "r"}, log
    assert starts[2:] == ["r2", "m"], log


def test_plan_keeps_the_mopd_recipe_entries_of_its_domains_only(tmp_path):
    """The MOPD recipe's per-domain entries (data.mix, rollout.by_domain) cover every domain;
    a run over some domains keeps theirs, so it does not stop on a domain it left out."""
    ov = ["train.max_steps=3", "mopd.overrides=['rollout.by_domain={math: {temperature: 0.5}}']"]
    code = build_plan(load_config(PipelineConfig, TINY, ["domains=[code]", *ov]), tmp_path / "a").mopd_cfg
    assert code.rollout.by_domain == {} and set(code.data.mix) <= {"code"}
    math_ = build_plan(load_config(PipelineConfig, TINY, ["domains=[math]", *ov]), tmp_path / "b").mopd_cfg
    assert math_.rollout.by_domain["math"].temperature == 0.5


def test_eval_settings_of_a_left_out_domain_are_fine_a_typo_is_not(tmp_path):
    cfg = load_config(PipelineConfig, TINY, ["domains=[math]", "eval.n_per_domain={chat: 7, math/low: 9}"])
    plan = build_plan(cfg, tmp_path / "a")
    assert {c.name: c.n for c in plan.columns} == {"math/low": 9, "math/high": cfg.eval.n}
    with pytest.raises(ConfigError, match="'maths'"):
        build_plan(load_config(PipelineConfig, TINY, ["domains=[math]", "eval.n_per_domain={maths: 7}"]),
                   tmp_path / "b")


def test_stages_hand_the_parent_run_down_in_their_configs(tmp_path, monkeypatch):
    """The pipeline's parent MLflow run reaches a stage through its config's
    mlflow.parent_run_id (the runner hands it to the stage), never through the environment."""
    import pipeline.stages.experts as experts_stage
    import pipeline.stages.mopd as mopd_stage
    from pipeline.runner import StageContext

    seen = {}
    monkeypatch.setattr(experts_stage, "run_in_subprocess", lambda ctx, module, cfg: seen.update(
        expert=(module, cfg)) or {"checkpoint": "x"})
    monkeypatch.setattr(mopd_stage, "distill", lambda cfg, out: seen.update(mopd=cfg) or {
        "final": "f", "mlflow_run_id": "r", "history": []})
    plan = build_plan(load_config(PipelineConfig, TINY, ["domains=[math]", "train.max_steps=2"]), tmp_path / "run")
    st = {s.name: s for s in plan.stages}
    ctx = StageContext(name="expert/math/low/sft", out=tmp_path / "e", resume=False, inputs={}, hash="h",
                       seconds={}, concurrent=True, parent_run_id="parent-1")
    assert st["expert/math/low/sft"].fn(ctx)["checkpoint"] == "x"
    module, cfg = seen["expert"]
    assert module == "pipeline.expert" and cfg.mlflow.parent_run_id == "parent-1"
    assert cfg.mlflow.tracking_uri == plan.tracking_uri and cfg.mlflow.register is False
    st["mopd"].fn(StageContext(name="mopd", out=tmp_path / "m", resume=False, inputs={}, hash="h", seconds={},
                               parent_run_id="parent-2"))
    assert seen["mopd"].mlflow.parent_run_id == "parent-2" and seen["mopd"].train.resume is False
    assert plan.mopd_cfg.mlflow.parent_run_id is None      # the plan's own configs are left as they were


def test_plan_with_chat_hands_the_reward_model_to_a_mopd_chat_reward(tmp_path):
    """A MOPD recipe with a chat task reward gets the pipeline's reward model as its
    reward kwarg (and waits for it); without one, MOPD's config has no reward kwargs."""
    plan, st = _chat_plan(tmp_path, "mopd.overrides=['rewards={chat: \"rewards.chat:reward\"}', "
                                    "loss.task_reward_alpha=0.1]")
    root = str((tmp_path / "run").resolve())
    assert plan.mopd_cfg.reward_kwargs == {"chat": {"reward_model": f"{root}/chat_rm"}}
    assert "chat_rm" in st["mopd"].deps
    plan, st = _chat_plan(tmp_path)
    assert plan.mopd_cfg.reward_kwargs == {} and "chat_rm" not in st["mopd"].deps


def test_the_main_job_plans_with_every_domain(tmp_path):
    """The README's main job (the tiny recipe as it is: every single-turn domain under
    recipes/experts/ and coding_agent) plans: a new domain needs its weight in the MOPD
    recipe's data.mix, and this is where a missing one shows (it stopped the main job once)."""
    from experts.registry import all_domains, is_agent_domain

    plan = build_plan(load_config(PipelineConfig, TINY, []), tmp_path / "run")
    single = {d for d in all_domains() if not is_agent_domain(d)}
    assert {"kernel", "frontend"} <= single
    assert set(plan.mopd_cfg.data.mix) == single | {"coding_agent"}
    assert {k.split("/")[0] for k in plan.mopd_cfg.teachers} == single | {"coding_agent"}
