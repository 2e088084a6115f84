"""Local torchrun launcher used by the CLI, the demo and the multi-process tests.

In: a python module (or script path), a rank count and arguments. Out: the finished process
(exit code checked), its output streamed to a log file; a timeout kills the whole group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Sequence

from .ports import free_port


class LaunchError(RuntimeError):
    pass


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signals a process, its process group and every descendant (torchrun starts its ranks in
    sessions of their own, so killing torchrun's group alone leaves the ranks running)."""
    import psutil

    try:
        procs = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        procs = []
    for target in (pid, *[p.pid for p in procs]):
        try:
            os.kill(target, sig)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def torchrun_cmd(target: str, nproc: int, args: Sequence[str] = ()) -> list[str]:
    entry = ["-m", target] if not target.endswith(".py") else [target]
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}", *entry, *args,
    ]


def run_torchrun(target: str, nproc: int, args: Sequence[str] = (), timeout: float = 600,
                 log_file: str | None = None, env: dict | None = None, check: bool = True,
                 stream: bool = False) -> int:
    """Runs torchrun to completion. Raises LaunchError with the log tail when it fails.
    stream=True lets the ranks print straight to this terminal (the CLI)."""
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.setdefault("PYTHONWARNINGS", "ignore")
    full_env.update(env or {})
    out = open(log_file, "w") if log_file else (None if stream else subprocess.PIPE)
    proc = subprocess.Popen(torchrun_cmd(target, nproc, args), stdout=out, stderr=subprocess.STDOUT,
                            env=full_env, start_new_session=True, text=True)
    try:
        stdout, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.wait()
        raise LaunchError(f"torchrun {target} timed out after {timeout}s") from None
    except KeyboardInterrupt:  # torchrun forwards SIGTERM to the ranks, which stop their engines
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            proc.wait()
        raise
    finally:
        if log_file:
            out.close()
    if check and proc.returncode != 0:
        text = open(log_file).read() if log_file else (stdout or "")
        raise LaunchError(f"torchrun {target} exited {proc.returncode}:\n{text[-4000:]}")
    return proc.returncode
