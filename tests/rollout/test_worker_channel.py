"""The engine worker's own listener for weight-update rounds (rollout/worker_channel.py), on its
own: answers, errors and a kept-alive connection, with the trainer's client (KeptAliveJson).
The listener inside a real vLLM server is covered by tests/test_rl_loop.py (cuda_ipc on CPU)."""

import json
import time

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
        return {"weight_version": "7", "at": [time.monotonic(), time.monotonic()]}

    ch = WorkerChannel(handle)
    try:
        assert ch.url.startswith("http://127.0.0.1:")
        c = KeptAliveJson(ch.url)
        for i in range(3):  # the rounds of one sync on one kept-alive connection
            before = time.monotonic()
            out = c.post("/skyrl_weight_update", {"call": json.dumps({"round": i})}, 10)
            assert set(out) == {"weight_version", "at", "via", "got_at"} and out["weight_version"] == "7"
            assert out["via"] == "channel"
            # the listener stamps the round's arrival (this host's monotonic clock) before the call
            assert before <= out["got_at"] <= out["at"][0] <= out["at"][1] <= time.monotonic()
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


def test_each_answer_leaves_in_one_write_with_nagle_off(monkeypatch):
    """An answer on a kept-alive connection written as headers, then body, waits out the client's
    delayed ACK (Nagle's algorithm): 44 ms a round on loopback, 40 ms a round on the H200, before
    this was fixed. The listener's sockets have TCP_NODELAY and each answer is one write."""
    import socket
    import socketserver

    writes = []
    real_write = socketserver._SocketWriter.write

    def write(self, b):
        writes.append((bytes(b), self._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)))
        return real_write(self, b)

    monkeypatch.setattr(socketserver._SocketWriter, "write", write)

    def handle(call: str) -> dict:
        if json.loads(call).get("fail"):
            raise RuntimeError("bad round")
        return {"weight_version": "3"}

    ch = WorkerChannel(handle)
    c = KeptAliveJson(ch.url)
    try:
        for i in range(3):
            assert c.post("/skyrl_weight_update", {"call": json.dumps({"round": i})}, 10)["weight_version"] == "3"
        with pytest.raises(RolloutHTTPError, match="bad round"):
            c.post("/skyrl_weight_update", {"call": json.dumps({"fail": True})}, 10)
    finally:
        c.close()
        ch.close()
    assert len(writes) == 4, [w for w, _ in writes]
    for (data, nodelay), status in zip(writes, [200, 200, 200, 500]):
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(f"HTTP/1.1 {status} ".encode()), head
        assert f"content-length: {len(body)}".encode() in head.lower()
        assert json.loads(body)
        assert nodelay, "TCP_NODELAY is off on the listener's socket"
