"""core/ranks.py without a launch: the launcher's variables answer before the process
group is up; the global batch splits over the ranks or is refused by name. (Under a real
launch: tests/e2e/test_launch.py.)"""
from __future__ import annotations

import pytest

from core import ranks


@pytest.fixture
def no_state(monkeypatch):
    # a PartialState set up by an earlier test in this process answers for itself (1 process)
    monkeypatch.setattr(ranks, "_initialized", lambda: False)


def test_alone_this_is_rank_0_of_1(monkeypatch, no_state):
    for v in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE"):
        monkeypatch.delenv(v, raising=False)
    assert (ranks.rank(), ranks.world_size(), ranks.is_main(), ranks.launched()) == (0, 1, True, False)
    assert ranks.gather({"a": 1}) == [{"a": 1}]


def test_the_launchers_variables_answer_before_the_group_is_up(monkeypatch, no_state):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert (ranks.rank(), ranks.world_size(), ranks.is_main(), ranks.launched()) == (1, 2, False, True)


def test_the_global_batch_splits_or_is_refused(monkeypatch, no_state):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert ranks.per_rank(8, "train.batch_size") == 4
    with pytest.raises(ValueError, match=r"train.batch_size = 5 does not split over 2 processes"):
        ranks.per_rank(5, "train.batch_size")


def test_an_expected_error_is_printed_by_rank_0(monkeypatch, no_state, capsys):
    """Rank 0 says it at once; another rank waits (to be stopped by the launcher when rank
    0 fails too) and only then says it, named; Ctrl-C is rank 0's to say."""
    from core import exitcodes

    waits = []
    monkeypatch.setattr(exitcodes.time, "sleep", waits.append)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert exitcodes.report(ValueError("bad key"), "mopd") == exitcodes.USAGE
    assert capsys.readouterr().err.strip() == "[rank 1] mopd: error: bad key"
    assert waits == [exitcodes.OTHER_RANKS_WAIT_S]
    assert exitcodes.report(KeyboardInterrupt(), "mopd") == exitcodes.INTERRUPTED
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert exitcodes.report(ValueError("bad key"), "mopd") == exitcodes.USAGE
    assert capsys.readouterr().err.strip() == "mopd: error: bad key"
