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


def test_every_stage_against_the_previous_measurement(tmp_path, capsys):
    before, now = tmp_path / "before", tmp_path / "now"
    _fake_run(before, 1800.0)
    assert main([str(before), "--previous", "none", "--save", str(tmp_path / "t.json")]) == 0
    saved = json.loads((tmp_path / "t.json").read_text())
    assert saved["stage_seconds"] == {"b": 1200.0, "a": 600.0} and saved["wall_seconds"] == 1800.0
    capsys.readouterr()
    _fake_run(now, 900.0)
    (now / "report.json").write_text(json.dumps({"stage_seconds": {"a": 300.0, "c": 100.0}, "wall_seconds": 900.0}))
    for prev in (str(tmp_path / "t.json"), str(before)):
        assert main([str(now), "--previous", prev]) == 0
        out = capsys.readouterr().out
        rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()}
        assert rows["a"][-1] == "x0.50" and rows["c"][-1] == "new" and rows["b"][-1] == "gone"
        assert "(x0.50)" in out


def test_a_bad_previous_is_named(tmp_path, capsys):
    _fake_run(tmp_path, 100.0)
    (tmp_path / "bad.json").write_text("{\"wall\": 1}")
    assert main([str(tmp_path), "--previous", str(tmp_path / "bad.json")]) == 2
    assert "bad.json" in capsys.readouterr().err
    assert main([str(tmp_path), "--previous", str(tmp_path / "missing")]) == 2


def test_partial_reads_the_finished_stages_of_a_run_without_its_report(tmp_path, capsys):
    _fake_run(tmp_path, 1800.0)
    (tmp_path / "report.json").unlink()                      # still running, or stopped
    assert main([str(tmp_path), "--previous", "none"]) == 2  # without --partial: named, as before
    capsys.readouterr()
    assert main([str(tmp_path), "--previous", "none", "--partial", "--save", str(tmp_path / "p.json")]) == 1
    assert "partial" in capsys.readouterr().out
    saved = json.loads((tmp_path / "p.json").read_text())
    assert saved["partial"] is True and set(saved["stage_seconds"]) == {"a", "b"}
    assert set(saved["stage_hashes"]) == {"a", "b"}           # what --dry-run estimates from
