"""bench/pipeline_time.py reads a finished pipeline folder (no training here)."""
import json

from bench.pipeline_time import main, summarize
from pipeline.runner import Stage, StageRunner


def _fake_run(tmp_path, wall):
    stages = [Stage("a", {}, lambda ctx: {}), Stage("b", {}, lambda ctx: {}, deps=["a"])]
    StageRunner(tmp_path, log=lambda m: None).run(stages)
    (tmp_path / "report.json").write_text(json.dumps(
        {"stage_seconds": {"a": 600.0, "b": 1200.0}, "wall_seconds": wall}))


def test_markers_record_start_and_finish(tmp_path):
    _fake_run(tmp_path, 1800.0)
    m = json.loads((tmp_path / "stages" / "b.json").read_text())
    assert m["status"] == "done" and m["started"] <= m["finished"]


def test_over_and_within_target(tmp_path, capsys):
    _fake_run(tmp_path, 1800.0)
    s = summarize(tmp_path, target_min=25)
    assert s["stages"][0] == ("b", 1200.0) and s["stage_seconds_sum"] == 1800.0
    assert not s["within_target"] and s["first_start_to_last_finish_s"] is not None
    assert main([str(tmp_path), "--target-min", "25"]) == 1
    assert "OVER" in capsys.readouterr().out
    assert main([str(tmp_path), "--target-min", "31"]) == 0


def test_missing_report_is_named(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "report.json" in capsys.readouterr().err
