"""Errors the user can fix, and how they leave a process: one line and exit code 2, no traceback.

In: a `UserError` (ConfigError, CheckpointError, ... derive from it) raised in the launching
process or in a torchrun rank. Out:
  - in the launching process (the CLI): `skyrl-mega: <message>` on stderr, exit code 2;
  - in a rank, `run_rank(main, argv)` catches it. Under the launcher (which names a file in
    $SKYRL_MEGA_ERROR_FILE) the first rank that fails writes its message there and every
    later one stays quiet; the launcher reads the file and raises the error again in the
    launching process, which prints it once. Under a bare torchrun the rank prints the line.
    The rank exits with EXIT_USER_ERROR.
A PeerFailed (this rank stops because another failed) is one line, or nothing when a user error
was already reported. Any other exception keeps its traceback (printed once, by the rank that
raised it), unless it follows another rank's reported user error (then it is that error's
consequence: a peer gone).
"""

from __future__ import annotations

import os
import sys

EXIT_USER_ERROR = 2
ERROR_FILE_ENV = "SKYRL_MEGA_ERROR_FILE"


class UserError(Exception):
    """A mistake the user can fix; the message says what, where and how to fix it."""


class PeerFailed(Exception):
    """This rank stops because another rank failed; the message names that rank and its error.
    Reported as one line: the failing rank reports its own error (with its traceback when it is
    not a UserError)."""


def one_line(e: BaseException) -> str:
    """The message on one line (a multi-line message's lines joined with '; ')."""
    parts = [p.strip().lstrip("- ").strip() for p in str(e).splitlines()]
    parts = [p for p in parts if p]
    if len(parts) > 1 and parts[0].endswith(":"):  # "invalid config:\n  - a\n  - b" -> "invalid config: a; b"
        return f"{parts[0]} {'; '.join(parts[1:])}"
    return "; ".join(parts)


def report_now(e: BaseException) -> None:
    """Prints e's traceback at once and marks it reported (run_rank then exits without printing
    it again): for an error other ranks are about to stop on, before torchrun ends this rank."""
    import traceback

    traceback.print_exception(e, file=sys.stderr)
    sys.stderr.flush()
    e._skyrl_reported = True  # type: ignore[attr-defined]


def claim_error_file(message: str) -> bool:
    """Writes `message` to $SKYRL_MEGA_ERROR_FILE unless an earlier rank wrote its own there.
    True when the launcher will report an error; False when not under the launcher."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return False
    try:  # the launcher reads it after every rank has exited
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return True  # another rank failed first: it reports
    with os.fdopen(fd, "w") as f:
        f.write(message)
    return True


def read_error_file(path: str) -> str | None:
    """The message a rank left in `path`, or None."""
    try:
        with open(path) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def run_rank(main, argv: list[str]) -> int:
    """A torchrun rank's entry point: runs main(argv); a UserError becomes one reported line
    and EXIT_USER_ERROR. Returns the exit code (0 when main returned)."""
    try:
        main(argv)
    except UserError as e:
        line = one_line(e)
        if not claim_error_file(line):
            print(f"skyrl-mega: {line}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except PeerFailed as e:
        if not os.environ.get(ERROR_FILE_ENV) or not os.path.exists(os.environ[ERROR_FILE_ENV]):
            print(f"skyrl-mega: stopping: {one_line(e)}", file=sys.stderr, flush=True)
        return 1
    except Exception as e:
        if getattr(e, "_skyrl_reported", False):
            return 1
        path = os.environ.get(ERROR_FILE_ENV)
        if path and os.path.exists(path):  # a consequence of another rank's user error (a peer gone)
            return 1
        raise
    return 0
