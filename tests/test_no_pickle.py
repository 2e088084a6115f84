"""No pickle across processes: the typed exchanges that replaced it, and a scan of the code.

- collectives.all_gather_json (the planner's and the peer gather's metadata exchange) over two
  gloo ranks: every rank gets every rank's object, whatever its size;
- skyrl_mega/ and bridges/ use no pickle module and none of torch.distributed's pickling
  object collectives (names in code, not in comments or docstrings).
"""

import io
import json
import os
import tokenize

import pytest

from skyrl_mega.launcher import run_torchrun

from .conftest import REPO

FORBIDDEN = {"pickle", "cPickle", "cloudpickle", "dill", "all_gather_object", "gather_object",
             "broadcast_object_list", "scatter_object_list", "send_object_list", "recv_object_list"}


def _names(path: str) -> set[str]:
    with open(path, "rb") as f:
        src = f.read()
    return {t.string for t in tokenize.tokenize(io.BytesIO(src).readline) if t.type == tokenize.NAME}


def test_library_code_names_no_pickling():
    found = {}
    for top in ("skyrl_mega", "bridges"):
        for root, _, files in os.walk(os.path.join(REPO, top)):
            for fn in files:
                if fn.endswith(".py"):
                    path = os.path.join(root, fn)
                    bad = _names(path) & FORBIDDEN
                    if bad:
                        found[os.path.relpath(path, REPO)] = sorted(bad)
    assert found == {}


@pytest.mark.multiprocess
def test_all_gather_json_gives_every_rank_every_object(tmp_path):
    from tests.workers.json_gather_worker import mine

    run_torchrun(os.path.join(REPO, "tests/workers/json_gather_worker.py"), 2, [str(tmp_path)], timeout=180,
                 log_file=str(tmp_path / "log.txt"))
    expected = [json.loads(json.dumps(mine(r))) for r in range(2)]
    for r in range(2):
        got = json.load(open(tmp_path / f"rank{r}.json"))
        assert got["world"] == expected
        assert got["sub"] == [{"sub": 0}, {"sub": 1}]
