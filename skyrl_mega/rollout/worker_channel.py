"""A vLLM worker's own HTTP listener for the rounds of a co-located weight update.

In:  `WorkerChannel(handle, device)` inside a vLLM worker (the worker extension's
     `skyrl_open_channel`, rollout/vllm_plugin.py); then, from the trainer on the same host,
     POST /skyrl_weight_update with the JSON body {"call": "<the same JSON skyrl_weight_update takes>"}.
Out: 200 with the worker's answer as JSON (plus "via": "channel" and "got_at": when the request
     reached the listener, on this host's monotonic clock, before its body was read), or 500
     {"error": "..."} when the call raised (the trainer raises WeightSyncError with it).

Why: through vLLM's POST /collective_rpc a round travels trainer -> API server -> engine core ->
worker and back: 2-3.6 ms in and about 1 ms out on an H200 (BENCHMARKS.md), a fixed cost per
round that a colocated sync of a few tens of GB pays twice. Here it travels trainer -> worker.
The work is the same: the worker extension's skyrl_weight_update, which calls vLLM's own
start_weight_update / update_weights / finish_weight_update of the worker.
Only for co-located engines (127.0.0.1, CUDA IPC): the data is already on this GPU. Calls run one
at a time (the worker extension's lock), on the listener's threads with the worker's CUDA device current.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

logger = logging.getLogger("vllm.skyrl_plugin")

PATH = "/skyrl_weight_update"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # kept alive: the rounds of one sync share a connection
    # TCP_NODELAY, and each answer leaves in ONE write (_answer): a kept-alive answer written as
    # headers, then body, waits out the client's delayed ACK (Nagle): 40+ ms a round, measured
    disable_nagle_algorithm = True

    def do_POST(self):  # noqa: N802 (http.server's name)
        got_at = time.monotonic()  # the request line and headers are in: the round has arrived
        if self.path != PATH:
            return self._answer(404, {"error": f"unknown path {self.path}; POST {PATH}"})
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
            call = body["call"]
            if not isinstance(call, str):
                raise ValueError("'call' must be a JSON string")
        except (ValueError, KeyError) as e:
            return self._answer(400, {"error": f"bad request body: {e!r}"})
        try:
            out = self.server.skyrl_call(call)
        except Exception as e:  # the engine's error goes back to the trainer, as collective_rpc's would
            logger.exception("skyrl worker channel: %s failed", PATH)
            return self._answer(500, {"error": f"{type(e).__name__}: {e}"})
        self._answer(200, {**out, "via": "channel", "got_at": got_at})

    def _answer(self, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        head = (f"{self.protocol_version} {status} {self.responses[status][0]}\r\n"
                f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n")
        self.wfile.write(head.encode() + data)

    def log_message(self, fmt, *args):  # no access log in vLLM's output
        pass


class WorkerChannel:
    """The listener (daemon threads). `handle(call: str) -> dict` is the worker's skyrl_weight_update."""

    def __init__(self, handle: Callable[[str], dict], device=None, host: str = "127.0.0.1"):
        self._device = device

        def call(c: str) -> dict:
            self._use_device()
            return handle(c)  # serialised by the worker extension's own lock

        self._server = ThreadingHTTPServer((host, 0), _Handler)
        self._server.daemon_threads = True
        self._server.skyrl_call = call
        self.host, self.port = host, self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="skyrl-worker-channel", daemon=True)
        self._thread.start()

    def _use_device(self) -> None:
        """The CUDA device is per thread: the worker's, on every listener thread."""
        import torch

        if self._device is not None and torch.device(self._device).type == "cuda":
            torch.cuda.set_device(self._device)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
