"""A reward worker process: JSON lines in, JSON lines out (reward_pool.py starts and feeds it).

In: argv[1], a JSON list of reward import paths (`module:function`) to load before answering;
then one call per stdin line: {"id", "spec", "response", "ground_truth", "meta"}.
Out, on stdout: {"ready": true} once loaded (or {"load_error": "..."} and exit 1), then one
line per call: {"id", "reward": float} or {"id", "error": "Type: message"} (plus
"user_error": true for a UserError: a misconfigured reward stops the run). Calls run one at a
time in the main thread; the pool kills this process when one runs past its limit. A reward's
own output (print, C libraries) goes to stderr: stdout is the protocol's.
"""

from __future__ import annotations

import json
import math
import os
import sys

MAX_ERROR_CHARS = 500


def _protocol_stream():
    """The real stdout for protocol lines; fd 1 (print, C writes) is pointed at stderr."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return out


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS]


def _answer(fns: dict, msg: dict) -> dict:
    from skyrl_mega.data.rewards import get_reward
    from skyrl_mega.errors import UserError, one_line

    try:
        spec = msg["spec"]
        if spec not in fns:
            fns[spec] = get_reward(spec)
        r = float(fns[spec](msg["response"], msg["ground_truth"], msg["meta"]))
    except UserError as e:
        return {"error": one_line(e)[:MAX_ERROR_CHARS], "user_error": True}
    except Exception as e:  # noqa: BLE001 - any failure of the reward costs the sample
        return {"error": _error(e)}
    if not math.isfinite(r):
        return {"error": f"the reward function returned {r}"}
    return {"reward": r}


def main(argv: list[str]) -> int:
    out = _protocol_stream()
    from skyrl_mega.data.rewards import get_reward

    fns = {}
    try:
        for spec in json.loads(argv[1]):
            fns[spec] = get_reward(spec)
    except Exception as e:  # noqa: BLE001 - reported to the pool, which stops the step
        out.write(json.dumps({"load_error": _error(e)}) + "\n")
        return 1
    out.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        msg = json.loads(line)
        out.write(json.dumps({"id": msg["id"], **_answer(fns, msg)}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
