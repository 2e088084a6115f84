"""rollout/supervise.py: when the supervised server dies (SIGKILL), what it spawned goes too
(the two-node engine-kill test's leftover EngineCore, in small)."""

import os
import signal
import subprocess
import sys
import time


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def _wait_for(pred, timeout_s: float = 20.0) -> bool:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


def test_a_killed_server_takes_its_children_along(tmp_path):
    pids = tmp_path / "pids"
    # the "server": starts a grandchild (as vLLM's API server starts EngineCore), then waits
    server = f"sleep 300 & echo $$ $! > {pids}.tmp && mv {pids}.tmp {pids}; wait"
    code = ("import sys; from skyrl_mega.rollout.supervise import run_supervised; "
            f"sys.exit(run_supervised(['bash', '-c', {server!r}], dict(__import__('os').environ), name='test server'))")
    err = open(tmp_path / "stderr", "w")  # a file: a surviving child would hold a pipe open
    sup = subprocess.Popen([sys.executable, "-c", code], stderr=err)
    assert _wait_for(pids.exists), "the server did not start"
    server_pid, child_pid = map(int, pids.read_text().split())
    os.kill(server_pid, signal.SIGKILL)
    assert sup.wait(timeout=20) == 128 + signal.SIGKILL
    assert "the test server ended (killed by signal 9); its remaining processes were stopped" in (tmp_path / "stderr").read_text()
    assert _wait_for(lambda: not _alive(child_pid)), "the server's child outlived it"
