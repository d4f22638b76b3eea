"""bench/sampler_server.py: bad settings are named before anything starts. Its arms run
the MOPD loop against a real vLLM server (minutes); the loop with the sampler server is
tested in tests/e2e/test_sampler_server.py, and the measured run is in docs/results."""
from __future__ import annotations

import pytest

from bench import sampler_server as B


@pytest.mark.parametrize("argv", [["--steps", "2"], ["--hidden", "100"], ["--repeats", "0"]])
def test_bad_settings_are_named_before_any_server_starts(tmp_path, capsys, argv):
    with pytest.raises(SystemExit):
        B.main(["--out", str(tmp_path / "o"), *argv])
    assert "need --steps >= 3" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.server
@pytest.mark.vllm
def test_the_three_arms_run_and_report(tmp_path):
    """A smoke run at toy size: a real sampler server, the colocated engine, the server and
    the server with async steps; the JSON has every arm's times and the push times."""
    import json

    pytest.importorskip("vllm")
    out = tmp_path / "b"
    assert B.main(["--out", str(out), "--hidden", "64", "--layers", "1", "--steps", "3", "--prompts-per-step", "2",
                   "--max-new-tokens", "4", "--repeats", "1", "--pushes", "1"]) == 0
    r = json.loads((out / "sampler_server.json").read_text())
    assert [x["arm"] for x in r["runs"]] == list(B.ARMS)
    for x in r["runs"]:
        assert len(x["step_s"]) == 2 and len(x["sync_s"]) == 2
    assert r["summary"]["mismatch_max"]["server"] < 1e-3      # the server held the trainer's weights
    assert len(r["push_s"]["server"]) == 1 and r["push_s"]["bytes"] > 0
