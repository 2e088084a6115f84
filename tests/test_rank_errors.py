"""How errors leave torchrun ranks started by the launcher (skyrl_mega/errors.py, launcher.py):

- a UserError on rank 1 only (rank 0 waits in a barrier whose peer is gone) comes back as
  RankUserError carrying rank 1's line; the log holds no traceback and no torchrun report;
- an unexpected error keeps its traceback, printed once (not again by torchrun or the launcher).
"""

import os

import pytest

from skyrl_mega.launcher import LaunchError, RankUserError, run_torchrun

from .conftest import REPO

pytestmark = pytest.mark.multiprocess
WORKER = os.path.join(REPO, "tests/workers/fail_worker.py")


def test_user_error_on_one_rank_is_that_ranks_one_line(tmp_path):
    log = tmp_path / "user.log"
    with pytest.raises(RankUserError) as e:
        run_torchrun(WORKER, 2, ["user", "1"], timeout=120, log_file=str(log))
    assert str(e.value) == "rank 1: the input is wrong: fix it"
    text = open(log).read()
    assert "Traceback" not in text and "failed (exitcode" not in text and "ChildFailedError" not in text, text


def test_unexpected_error_keeps_one_traceback(tmp_path):
    log = tmp_path / "crash.log"
    with pytest.raises(LaunchError) as e:
        run_torchrun(WORKER, 1, ["crash", "0"], timeout=120, log_file=str(log))
    text = open(log).read()
    assert text.count("Traceback (most recent call last)") == 1, text
    assert "RuntimeError: rank 0 crashed" in text and "ChildFailedError" not in text, text
    assert str(e.value).startswith(f"torchrun {WORKER} exited 1:")
