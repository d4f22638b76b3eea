"""bench/mopd_vs_seqkd.py: bad input is named before any model loads (the benchmark itself
needs a finished pipeline folder and ~12 minutes; docs/results/2026-11-30-math-tool-use-interference.md)."""
from bench.mopd_vs_seqkd import main


def test_names_a_folder_that_is_no_pipeline(tmp_path, capsys):
    assert main(["--pipeline", str(tmp_path / "nosuch"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "not a finished pipeline folder" in err and "mopd/config.yaml" in err


def test_refuses_an_out_folder_with_a_run(tmp_path, capsys):
    root = tmp_path / "p"
    for p in ["mopd/config.yaml", "pipeline.yaml"]:
        (root / p).parent.mkdir(parents=True, exist_ok=True)
        (root / p).write_text("{}")
    (root / "base" / "model").mkdir(parents=True)
    (tmp_path / "o" / "mopd").mkdir(parents=True)
    assert main(["--pipeline", str(root), "--out", str(tmp_path / "o")]) == 2
    assert "choose a new --out" in capsys.readouterr().err
