"""Run one server process as a job step's task, and take its whole process group with it.

In: argv and env of the server (vLLM's API server: it spawns EngineCore and worker processes).
Out: the server's exit code (128 + signal when killed). The server runs in a process group of
its own; when it ends, for any reason (a crash, SIGKILL), whatever is left of the group is
killed. Without this, a killed API server leaves EngineCore and its workers running, reparented
to init, where SLURM's proctrack/linuxproc no longer sees them: the step never ends and the
processes outlive the job. SIGTERM / SIGINT to this process go to the group; if this process
itself dies, the server gets SIGTERM (parent-death signal).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from .procs import set_parent_death_signal


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_supervised(argv: list[str], env: dict, name: str = "server") -> int:
    proc = subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=set_parent_death_signal)

    def forward(signum, _frame):
        _kill_group(proc.pid, signum)

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, forward)
    rc = proc.wait()
    _kill_group(proc.pid, signal.SIGKILL)  # EngineCore, workers: nothing outlives the server
    code = 128 - rc if rc < 0 else rc
    if rc != 0:
        how = f"killed by signal {-rc}" if rc < 0 else f"exit {rc}"
        print(f"skyrl-mega serve: the {name} ended ({how}); its remaining processes were stopped",
              file=sys.stderr, flush=True)
    return code
