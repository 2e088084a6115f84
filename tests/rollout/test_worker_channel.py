"""The engine worker's own listener for weight-update rounds (rollout/worker_channel.py), on its
own: answers, errors and a kept-alive connection, with the trainer's client (KeptAliveJson).
The listener inside a real vLLM server is covered by tests/test_rl_loop.py (cuda_ipc on CPU)."""

import json

import pytest

from skyrl_mega.rollout.control import KeptAliveJson
from skyrl_mega.rollout.errors import RolloutHTTPError
from skyrl_mega.rollout.worker_channel import WorkerChannel


def test_channel_answers_the_handlers_result_and_its_errors():
    seen = []

    def handle(call: str) -> dict:
        seen.append(json.loads(call))
        if json.loads(call).get("fail"):
            raise RuntimeError("update 7: checksum mismatch over CUDA IPC for ['w']")
        return {"weight_version": "7", "at": [1.0, 2.0]}

    ch = WorkerChannel(handle)
    try:
        assert ch.url.startswith("http://127.0.0.1:")
        c = KeptAliveJson(ch.url)
        for i in range(3):  # the rounds of one sync on one kept-alive connection
            out = c.post("/skyrl_weight_update", {"call": json.dumps({"round": i})}, 10)
            assert out == {"weight_version": "7", "at": [1.0, 2.0], "via": "channel"}
        assert [s["round"] for s in seen] == [0, 1, 2]
        with pytest.raises(RolloutHTTPError, match="checksum mismatch over CUDA IPC") as e:
            c.post("/skyrl_weight_update", {"call": json.dumps({"fail": True})}, 10)
        assert e.value.status == 500
        with pytest.raises(RolloutHTTPError) as e:
            c.post("/skyrl_weight_update", {"call": {"not": "a string"}}, 10)
        assert e.value.status == 400
        with pytest.raises(RolloutHTTPError) as e:
            c.post("/elsewhere", {"call": "{}"}, 10)
        assert e.value.status == 404
        assert len(seen) == 4  # the bad requests never reached the handler
        c.close()
    finally:
        ch.close()
