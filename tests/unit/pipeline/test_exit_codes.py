"""Every documented exit code (core/exitcodes.py, the README's command section) through
the `mopd` entry point, in-process: 0 done, 1 unexpected, 2 bad command line or recipe,
3 a dependency unreachable (a teacher server, the MLflow store), 130 Ctrl-C; a fatal
error is printed on its own line, never glued to a progress bar."""
from __future__ import annotations

import dataclasses
import json

import pytest

from core import exitcodes
from pipeline.cli import main


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:   # argparse, and a training loop stopped by a signal, exit this way
        return e.code


@pytest.fixture
def recipe(tmp_path, tiny_student_dir, tiny_teacher_dir):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": [{"role": "user", "content": f"hi {i}"}], "domain": "a"})
                              for i in range(4)) + "\n")

    def make(teacher: str = f"{{path: {tiny_teacher_dir}}}") -> str:
        r = tmp_path / "run.yaml"
        r.write_text(f"model: {{path: {tiny_student_dir}}}\ndata: {{datasets: [{{path: {data}}}]}}\n"
                     f"teachers: {{a: {teacher}}}\nrollout: {{backend: hf, max_new_tokens: 4}}\n"
                     f"train: {{max_steps: 1, prompts_per_step: 2}}\n")
        return str(r)
    return make


def test_the_codes_are_the_documented_ones():
    assert (exitcodes.OK, exitcodes.ERROR, exitcodes.USAGE, exitcodes.UNREACHABLE,
            exitcodes.INTERRUPTED) == (0, 1, 2, 3, 130)


def test_0_done(capsys):
    assert _code(["distill", "--help-config"]) == 0
    assert "train.lr" in capsys.readouterr().out


def test_2_bad_command_line_and_bad_recipe(tmp_path, recipe, capsys):
    assert _code(["distill", "--no-such-flag"]) == 2
    assert _code(["distill", "--config", recipe(), "--out", str(tmp_path / "o"), "train.nosuch=1"]) == 2
    assert "mopd: error: " in capsys.readouterr().err


def test_3_teacher_server_unreachable(tmp_path, recipe, capsys):
    dead = f"http://127.0.0.1:{free_port()}"
    r = recipe(f"{{backend: server, model: a-expert, urls: ['{dead}'], max_retries: 1, backoff_s: 0.05}}")
    assert _code(["distill", "--config", r, "--out", str(tmp_path / "o")]) == 3
    err = capsys.readouterr().err
    assert f"mopd: error: teacher 'a' is unreachable" in err and dead in err


def test_3_tracking_store_unreachable(tmp_path, recipe, monkeypatch, capsys):
    # no retry settings needed: the store is probed once, before MLflow's client retries for minutes
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    assert _code(["distill", "--config", recipe(), "--out", str(tmp_path / "o")]) == 3
    assert "mopd: error: the MLflow tracking server at http://127.0.0.1:" in capsys.readouterr().err


def _failing_run(exc: BaseException):
    """A `mopd.distill.run` that draws a progress bar, then fails with `exc`."""
    def run(cfg, out, **kw):
        from tqdm.auto import tqdm

        bar = tqdm(total=10, desc="mopd", disable=False)
        bar.update(3)
        raise exc
    return run


def test_1_unexpected_error_after_the_bar_is_closed(tmp_path, recipe, monkeypatch, capsys):
    import mopd.distill

    monkeypatch.setattr(mopd.distill, "run", _failing_run(RuntimeError("boom")))
    assert _code(["distill", "--config", recipe(), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "\nmopd: error: RuntimeError: boom\n" in err
    assert "mopd:  30%" in err    # the bar was drawn, and closed before the traceback


def test_2_error_is_on_its_own_line_after_a_progress_bar(tmp_path, recipe, monkeypatch, capsys):
    import mopd.distill

    monkeypatch.setattr(mopd.distill, "run", _failing_run(ValueError("bad row 3")))
    assert _code(["distill", "--config", recipe(), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "3/10" in err and "\nmopd: error: bad row 3\n" in err


def test_130_interrupted(tmp_path, recipe, monkeypatch, capsys):
    import mopd.distill

    monkeypatch.setattr(mopd.distill, "run", _failing_run(KeyboardInterrupt()))
    assert _code(["distill", "--config", recipe(), "--out", str(tmp_path / "o")]) == 130
    assert "mopd: interrupted" in capsys.readouterr().err


@dataclasses.dataclass
class _Cfg:
    x: int = 1


def test_a_stage_that_lost_a_dependency_makes_the_pipeline_exit_3(tmp_path, monkeypatch):
    """A pipeline stage runs in its own process: its exit code 3 stays 3."""
    from pipeline.runner import StageContext, StageUnreachable, run_in_subprocess

    mod = tmp_path / "stage_lost_server.py"
    mod.write_text("import sys\nsys.exit(3)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    ctx = StageContext(name="mopd", out=tmp_path / "s", resume=False, inputs={}, hash="h", seconds={},
                       log=tmp_path / "s.log")
    with pytest.raises(StageUnreachable) as e:
        run_in_subprocess(ctx, "stage_lost_server", _Cfg())
    assert exitcodes.code_for(e.value) == 3
