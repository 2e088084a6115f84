"""Reward calls in worker processes, each call with a time limit: a reward function that raises,
hangs or crashes costs its sample (reward 0, counted), never the step.

In: RewardCalls (reward name, response text, ground truth, meta), the number of workers and
`timeout_s`, the limit of one call. Out: RewardResults: one reward per call, how many calls
failed (raised, returned a non-finite value, or their worker died) and how many ran past the
limit. The first failure and the first timeout are logged once per pool, with the reward's
message; later ones are only counted (the trainer's reward/errors and reward/timeouts).

Why processes, not threads: a Python thread cannot be stopped, and a runaway reward (a sympy
simplification, a big-integer power: what math-verify's own timeout guards against, with
SIGALRM, which works only in a main thread) holds the GIL, so a stuck thread would slow or
stall the controller for good. A worker whose call runs past its deadline is killed with its
process group and a fresh one takes its place; a deadline starts when its call reaches a
started worker. Calls and answers cross as JSON lines (reward_worker.py; no pickle): ground
truth and meta go as JSON (values JSON lacks as their str()). A worker imports each reward by
its path (rewards.reward_spec), so one registered with @register_reward must live in an
importable module. Workers start on `start()` (which waits until they loaded the configured
rewards) or on the first calls, serve every later step, and go with this process (atexit, and
a parent-death signal on Linux).
What stops the step: a UserError raised by a reward (a misconfigured reward: its one line), and
a worker that cannot load the rewards or start (RewardWorkerError).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from ..errors import UserError
from ..rollout.procs import spawn_process, set_parent_death_signal
from .rewards import reward_spec

WORKER_ENV = "SKYRL_MEGA_REWARD_WORKER"  # set in every worker process


@dataclass
class RewardCall:
    reward: str  # a registered name or `module:function`
    response: str
    ground_truth: Any = None
    meta: dict = field(default_factory=dict)


@dataclass
class RewardResults:
    rewards: list[float]
    errors: int = 0  # raised, returned a non-finite value, or the worker died
    timeouts: int = 0  # ran past the limit


class RewardWorkerError(RuntimeError):
    """The pool cannot run its workers: one could not load the rewards, or did not start."""


def _jsonable(value):
    return value.tolist() if hasattr(value, "tolist") else str(value)


class _Worker:
    """One worker process (its own process group) and the thread that queues its answer lines."""

    def __init__(self, specs: list[str], answers: queue.Queue, start_timeout_s: float):
        env = {**os.environ, WORKER_ENV: "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = spawn_process([sys.executable, "-m", "skyrl_mega.data.reward_worker", json.dumps(specs)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=env,
                                  start_new_session=True, preexec_fn=set_parent_death_signal)
        self.state = "starting"  # starting | idle | busy
        self.call: tuple[int, str] | None = None  # (index in the batch, reward name) in flight
        self.deadline = time.monotonic() + start_timeout_s  # of its start, then of its call
        threading.Thread(target=self._read, args=(answers,), daemon=True, name="reward-worker-reader").start()

    def _read(self, answers: queue.Queue) -> None:
        with self.proc.stdout:
            for line in self.proc.stdout:
                answers.put((self, line))
        answers.put((self, None))  # end of output: the process is gone

    def send(self, line: str, index: int, name: str, timeout_s: float) -> bool:
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except OSError:  # it died: the caller drops it
            return False
        self.state, self.call, self.deadline = "busy", (index, name), time.monotonic() + timeout_s
        return True

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # unkillable (uninterruptible I/O): left to the OS
            pass


def _kill_all(workers: list[_Worker]) -> None:
    for w in list(workers):
        w.kill()
    workers.clear()


class RewardPool:
    def __init__(self, rewards: Iterable[str] = (), *, workers: int = 4, timeout_s: float = 10.0,
                 start_timeout_s: float = 120.0, log: Callable[[str], None] = print):
        """`rewards`: the names every worker loads before its first call (others load on demand)."""
        self.specs = sorted({self._spec(name) for name in rewards})
        self.max_workers, self.timeout_s, self.start_timeout_s, self.log = workers, timeout_s, start_timeout_s, log
        self._answers: queue.Queue = queue.Queue()
        self._workers: list[_Worker] = []
        self._logged: set[str] = set()
        self._close = weakref.finalize(self, _kill_all, self._workers)  # also at interpreter exit

    @staticmethod
    def _spec(name: str) -> str:
        try:
            return reward_spec(name)
        except ValueError as e:
            raise UserError(str(e)) from None

    def start(self) -> None:
        """Starts every worker and waits until each has loaded the rewards."""
        self._grow(self.max_workers)
        while any(w.state == "starting" for w in self._workers):
            self._wait(RewardResults([]))
            self._expire(RewardResults([]))

    def close(self) -> None:
        self._close()

    def score(self, calls: list[RewardCall]) -> RewardResults:
        res = RewardResults([0.0] * len(calls))
        lines = [self._line(i, c, res) for i, c in enumerate(calls)]
        pending = deque(i for i, line in enumerate(lines) if line is not None)
        try:
            while pending or self._busy():
                self._grow(len(pending) + len(self._busy()))
                self._dispatch(pending, lines, calls)
                self._wait(res)
                self._expire(res)
        except BaseException:  # a step-stopping error: no call of this batch stays in flight
            for w in self._busy():
                self._drop(w)
            raise
        return res

    # -- one batch -----------------------------------------------------------------------------
    def _line(self, index: int, call: RewardCall, res: RewardResults) -> str | None:
        spec = self._spec(call.reward)
        try:
            return json.dumps({"id": index, "spec": spec, "response": call.response,
                               "ground_truth": call.ground_truth, "meta": call.meta}, default=_jsonable)
        except (TypeError, ValueError) as e:  # e.g. a circular meta
            self._failed(res, call.reward, f"its inputs are not JSON: {e}")
            return None

    def _busy(self) -> list[_Worker]:
        return [w for w in self._workers if w.state == "busy"]

    def _grow(self, wanted: int) -> None:
        while len(self._workers) < min(wanted, self.max_workers):
            self._workers.append(_Worker(self.specs, self._answers, self.start_timeout_s))

    def _dispatch(self, pending: deque, lines: list, calls: list[RewardCall]) -> None:
        for w in list(self._workers):
            if w.state == "idle" and pending:
                i = pending.popleft()
                if not w.send(lines[i], i, calls[i].reward, self.timeout_s):
                    pending.appendleft(i)
                    self._drop(w)

    def _wait(self, res: RewardResults) -> None:
        """Handles the next answer, or returns at the nearest deadline."""
        deadlines = [w.deadline for w in self._workers if w.state in ("starting", "busy")]
        if not deadlines:
            return
        try:
            w, line = self._answers.get(timeout=max(0.0, min(deadlines) - time.monotonic()))
        except queue.Empty:
            return
        if w in self._workers:  # else: a worker dropped before (killed at its deadline)
            self._on_line(w, line, res)

    def _on_line(self, w: _Worker, line: str | None, res: RewardResults) -> None:
        if line is None:
            return self._on_exit(w, res)
        msg = json.loads(line)
        if "load_error" in msg:
            raise RewardWorkerError(f"a reward worker cannot load the rewards {self.specs}: {msg['load_error']}")
        if msg.get("ready"):
            w.state = "idle"
            return
        (index, name), w.call, w.state = w.call, None, "idle"
        if "reward" in msg:
            res.rewards[index] = float(msg["reward"])
        elif msg.get("user_error"):
            raise UserError(msg["error"])
        else:
            self._failed(res, name, msg["error"])

    def _on_exit(self, w: _Worker, res: RewardResults) -> None:
        state, call = w.state, w.call
        self._drop(w)
        if state == "starting":
            raise RewardWorkerError(f"a reward worker exited with code {w.proc.returncode} while starting "
                                    "(its output is above)")
        if call is not None:
            self._failed(res, call[1], f"its reward worker exited with code {w.proc.returncode}")

    def _expire(self, res: RewardResults) -> None:
        now = time.monotonic()
        for w in list(self._workers):
            if w.state == "idle" or w.deadline > now:
                continue
            if w.state == "starting":
                raise RewardWorkerError(f"a reward worker did not start within {self.start_timeout_s:g}s")
            name = w.call[1]
            self._drop(w)
            res.timeouts += 1
            self._log_once("timeout", f"reward {name!r} ran past its {self.timeout_s:g}s limit on a sample "
                                      "(data.reward_timeout_s): it scores 0 and a fresh worker replaces the "
                                      "stopped one; later timeouts are only counted (reward/timeouts)")

    def _failed(self, res: RewardResults, name: str, error: str) -> None:
        res.errors += 1
        self._log_once("error", f"reward {name!r} failed on a sample, which scores 0: {error}; "
                                "later failures are only counted (reward/errors)")

    def _log_once(self, kind: str, message: str) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            self.log(message)

    def _drop(self, w: _Worker) -> None:
        w.kill()
        self._workers.remove(w)
