"""Local torchrun launcher used by the CLI, the demo and the multi-process tests.

In: a python module (or script path), a rank count and arguments. Out: the finished process
(exit code checked), its output streamed to a log file; a timeout kills the whole group.
A rank that fails with a UserError (skyrl_mega/errors.py) leaves its one-line message in a file
named by $SKYRL_MEGA_ERROR_FILE; run_torchrun raises it here as a RankUserError, so the CLI
prints that line, not torchrun's report. torchrun itself runs as `python -m skyrl_mega.launcher`
(torch's launcher without its failure report and its traceback: a failing rank prints its own).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Sequence

from .errors import ERROR_FILE_ENV, EXIT_USER_ERROR, UserError, read_error_file
from .ports import free_port


class LaunchError(RuntimeError):
    """torchrun failed for a reason other than a UserError in a rank (its output says why)."""


class RankUserError(UserError):
    """A rank stopped on a UserError; the message is the rank's line."""


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
        sys.executable, "-m", "skyrl_mega.launcher", f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}", *entry, *args,
    ]


def run_torchrun(target: str, nproc: int, args: Sequence[str] = (), timeout: float = 600,
                 log_file: str | None = None, env: dict | None = None, check: bool = True,
                 stream: bool = False) -> int:
    """Runs torchrun to completion. Raises RankUserError with a rank's message when a rank
    stopped on a UserError, else LaunchError with the log tail when it fails.
    stream=True lets the ranks print straight to this terminal (the CLI)."""
    err_dir = tempfile.mkdtemp(prefix="skyrl_mega_err_")
    err_file = os.path.join(err_dir, "user_error")
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.setdefault("PYTHONWARNINGS", "ignore")
    full_env.update(env or {})
    full_env[ERROR_FILE_ENV] = err_file
    try:
        return _run(target, nproc, args, timeout, log_file, full_env, check, stream, err_file)
    finally:
        shutil.rmtree(err_dir, ignore_errors=True)


def _run(target, nproc, args, timeout, log_file, env, check, stream, err_file) -> int:
    out = open(log_file, "w") if log_file else (None if stream else subprocess.PIPE)
    proc = subprocess.Popen(torchrun_cmd(target, nproc, args), stdout=out, stderr=subprocess.STDOUT,
                            env=env, start_new_session=True, text=True)
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
        message = read_error_file(err_file)
        if message:
            raise RankUserError(message)
        text = open(log_file).read() if log_file else (stdout or "")
        raise LaunchError(f"torchrun {target} exited {proc.returncode}" + (f":\n{text[-4000:]}" if text else ""))
    return proc.returncode


def _torchrun(argv: list[str]) -> int:
    """torch.distributed.run without its failure report: a failed rank printed its own
    traceback, or left its one line for run_torchrun. Returns the exit code: EXIT_USER_ERROR
    when a rank stopped on a UserError, else the first failed rank's code."""
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    err_file = os.environ.get(ERROR_FILE_ENV)
    if err_file:  # after a rank's user error: no "failed (exitcode ...)" / "closing signal" lines
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(
            lambda record: not os.path.exists(err_file))
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        codes = [f.exitcode for f in e.failures.values()]
        return EXIT_USER_ERROR if EXIT_USER_ERROR in codes else next((c for c in codes if c > 0), 1)
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(_torchrun(sys.argv[1:]))
