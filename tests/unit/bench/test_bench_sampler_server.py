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
