"""`mopd pipeline --dry-run` estimates each stage's time from the newest saved record of a
stage with the same settings (pipeline/estimate.py), and the total; a stage with no record
says so. Synthetic records: stage markers of an earlier run folder beside the new one, and
a `bench.pipeline_time --save` record."""
from __future__ import annotations

import json
from pathlib import Path

import pipeline.estimate
from bench.pipeline_time import main as pipeline_time
from pipeline.cli import main as cli_main
from pipeline.runner import Stage, StageRunner

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "recipes" / "pipeline" / "tiny.yaml"


def _dry_run(out: Path, capsys) -> dict[str, str]:
    """The CLI's dry run; stage -> its estimate line (and "total" -> the total line)."""
    assert cli_main(["pipeline", "--config", str(TINY), "--out", str(out), "--dry-run", "domains=[math]"]) == 0
    err = capsys.readouterr().err
    lines = err.split("estimated time per stage", 1)[1].splitlines()[1:]
    rows = {ln.split()[0]: ln for ln in lines if ln.startswith("  ") and not ln.strip().startswith("estimated")}
    rows["total"] = next(ln for ln in lines if "estimated total" in ln)
    rows["hashes"] = err
    return rows


def _hash(err: str, stage: str) -> str:
    """The stage's hash from the plan table the dry run printed."""
    row = next(ln for ln in err.splitlines() if ln.split("│")[1:2] and ln.split("│")[1].strip() == stage)
    return row.split("│")[2].strip()


def _marker(folder: Path, stage: str, h: str, seconds: float, finished: str):
    p = folder / "stages" / (stage.replace("/", "__") + ".json")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"name": stage, "hash": h, "status": "done", "seconds": seconds,
                             "finished": finished, "outputs": {}}))


def test_dry_run_estimates_each_stage_from_the_newest_record_of_its_settings(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(pipeline.estimate, "RESULTS", tmp_path / "results")   # not the repo's records
    runs = tmp_path / "runs"
    first = _dry_run(runs / "new", capsys)
    assert "no record for these settings" in first["base"]
    assert "estimated total: 0 s" in first["total"] and "not counted" in first["total"]
    err = first["hashes"]
    h_base, h_sft = _hash(err, "base"), _hash(err, "expert/math/low/sft")
    # an older and a newer record of base's settings; sft's only under other settings
    _marker(runs / "older", "base", h_base, 999.0, "2026-11-01T10:00:00")
    _marker(runs / "earlier", "base", h_base, 120.5, "2026-12-01T10:00:00")
    _marker(runs / "earlier", "expert/math/low/sft", "0" * 16, 77.0, "2026-12-01T10:00:00")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "2026-12-03-pipeline-time.json").write_text(json.dumps(
        {"date": "2026-12-03", "stage_seconds": {"expert/math/low/sft": 30.25, "data": 4.0},
         "stage_hashes": {"expert/math/low/sft": h_sft, "data": "f" * 16}, "wall_seconds": 40.0}))
    rows = _dry_run(runs / "new", capsys)
    assert "120.5 s" in rows["base"] and "earlier" in rows["base"] and "999" not in rows["base"]
    assert "30.2 s" in rows["expert/math/low/sft"] and "pipeline-time.json" in rows["expert/math/low/sft"]
    assert "no record for these settings" in rows["data"]          # a record, but of other settings
    n = sum(1 for k in rows if k not in ("total", "hashes"))
    assert f"estimated total: 151 s (2.5 min) for 2 of {n} stages" in rows["total"], rows["total"]


def test_a_reused_stage_costs_nothing_and_a_saved_bench_record_carries_the_hashes(tmp_path, capsys):
    """`bench.pipeline_time --save` records each stage's hash, so a dry run elsewhere
    finds the stage by its settings; in its own folder the finished stage is reused."""
    stages = [Stage("a", {"n": 1}, lambda ctx: {}), Stage("b", {"n": 2}, lambda ctx: {}, deps=["a"])]
    run = tmp_path / "run"
    StageRunner(run, log=lambda m: None).run(stages)
    (run / "report.json").write_text(json.dumps({"stage_seconds": {"a": 600.0, "b": 1200.0}, "wall_seconds": 1800}))
    saved = tmp_path / "results" / "2026-12-05-pipeline-time.json"
    assert pipeline_time([str(run), "--previous", "none", "--save", str(saved)]) == 0
    capsys.readouterr()
    rows = StageRunner(run).plan(stages)
    assert set(json.loads(saved.read_text())["stage_hashes"].items()) == {(s, h) for s, h, _ in rows}
    elsewhere = pipeline.estimate.find_records(tmp_path / "other" / "new", results=tmp_path / "results")
    est = pipeline.estimate.estimate([(s, h, "run") for s, h, _ in rows], elsewhere)
    assert [e["estimate_s"] for e in est] == [600.0, 1200.0]
    here = pipeline.estimate.estimate(rows, pipeline.estimate.find_records(run, results=tmp_path / "results"))
    assert [(e["action"], e["estimate_s"]) for e in here] == [("cached", 0.0), ("cached", 0.0)]
    assert "estimated total: 1800 s (30.0 min) for 2 of 2 stages" in "\n".join(pipeline.estimate.describe(est))
