"""Child processes that leave no orphans: own process group, logs to a file, SIGTERM then SIGKILL.

Every child (a vLLM API server with its EngineCore and Worker processes, or a vllm-router)
starts in a new session, so its process-group id equals its pid and one `killpg` reaches
the whole tree, also after the leader died and left its children behind. On Linux each
child additionally gets PR_SET_PDEATHSIG=SIGTERM, so it is told to shut down even when
this Python process is SIGKILLed (the one case atexit cannot cover). Every live child is
registered for an atexit sweep, and a SIGTERM sent to this process is turned into
SystemExit (when nobody installed a handler before) so that the sweep runs then too.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Mapping, Sequence

from .errors import ServerStartError

_LIVE: "weakref.WeakSet[ChildProcess]" = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()
_HOOKS_INSTALLED = False

try:
    _LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:  # not glibc Linux: no parent-death signal
    _LIBC = None
_PR_SET_PDEATHSIG = 1


def set_parent_death_signal() -> None:  # runs in the child between fork and exec
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


# PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not the process.
# Children are therefore forked from the main thread or from one spawner thread that lives
# as long as the process, never from a short-lived worker thread (asyncio.to_thread, ...).
_SPAWNER: ThreadPoolExecutor | None = None
_SPAWNER_LOCK = threading.Lock()


def spawn_process(argv, **kwargs) -> subprocess.Popen:
    """subprocess.Popen from the main thread or the one lasting spawner thread, so that a child
    started with preexec_fn=set_parent_death_signal dies with this process, not with a thread."""
    global _SPAWNER
    if threading.current_thread() is threading.main_thread():
        return subprocess.Popen(argv, **kwargs)
    with _SPAWNER_LOCK:
        if _SPAWNER is None:
            _SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="skyrl-spawner")
    return _SPAWNER.submit(subprocess.Popen, argv, **kwargs).result()


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """HTTP status of a GET, or None when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError, ValueError):
        return None


class ChildProcess:
    """One child process tree in its own process group, stdout+stderr appended to `log_path`."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: str,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        kill_on_parent_death: bool = True,
    ):
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.kill_on_parent_death = kill_on_parent_death
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if self.alive():
            raise RuntimeError(f"{self.name} is already running (pid {self.proc.pid})")
        _install_exit_hooks()
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        with open(self.log_path, "ab", buffering=0) as log:
            log.write(
                f"\n===== skyrl-mega: start #{self.starts + 1} of {self.name} at "
                f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(self.argv)}\n".encode()
            )
            self.proc = spawn_process(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
                preexec_fn=set_parent_death_signal if self.kill_on_parent_death else None,
            )
        self.starts += 1
        with _LIVE_LOCK:
            _LIVE.add(self)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def poll(self) -> int | None:
        """The exit code once the group leader exited, else None (also None before start)."""
        return self.proc.poll() if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill_group(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the whole group, wait up to grace_s, then SIGKILL whatever is left."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.kill_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        # The leader may be gone while children of its group live on: always sweep the group.
        self.kill_group(signal.SIGKILL)
        try:
            self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            pass
        _wait_group_gone(self.proc.pid, timeout_s=5.0)
        with _LIVE_LOCK:
            _LIVE.discard(self)
        return self.proc.returncode

    # -- diagnostics -----------------------------------------------------------------------
    def log_tail(self, max_bytes: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - max_bytes))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return "(no log)"


def wait_healthy(
    url: str,
    timeout_s: float,
    child: ChildProcess | None = None,
    interval_s: float = 0.5,
    what: str = "server",
    is_ok: Callable[[int | None], bool] = lambda status: status == 200,
) -> float:
    """Polls GET `url` until it answers 200; returns the seconds waited.

    Raises ServerStartError (with the log tail) when the child exits first or the timeout passes.
    """
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    while True:
        if child is not None and child.poll() is not None:
            raise ServerStartError(
                f"{what} exited with code {child.poll()} before {url} was healthy; "
                f"log {child.log_path}:\n{child.log_tail()}"
            )
        if is_ok(http_status(url, timeout=min(5.0, max(0.5, deadline - time.monotonic())))):
            return time.monotonic() - t0
        if time.monotonic() >= deadline:
            tail = child.log_tail() if child is not None else ""
            raise ServerStartError(f"{what} at {url} not healthy after {timeout_s:.0f}s\n{tail}")
        time.sleep(interval_s)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while group_alive(pgid) and time.monotonic() < deadline:
        # Zombies still count as group members until reaped by their parent (init here).
        time.sleep(0.05)


def stop_all(grace_s: float = 10.0) -> None:
    """Stops every live ChildProcess of this Python process (atexit does this too)."""
    with _LIVE_LOCK:
        children = list(_LIVE)
    for child in children:
        try:
            child.kill_group(signal.SIGTERM)
        except Exception:
            pass
    for child in children:
        try:
            child.stop(grace_s=grace_s)
        except Exception:
            pass


def _on_sigterm(signum, frame):  # pragma: no cover - exercised by process tests
    raise SystemExit(128 + signum)


def _install_exit_hooks() -> None:
    global _HOOKS_INSTALLED
    if _HOOKS_INSTALLED:
        return
    _HOOKS_INSTALLED = True
    atexit.register(stop_all)
    if threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, _on_sigterm)
