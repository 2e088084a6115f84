"""The weight sync's control plane on the trainer side: control.KeptAliveJson (its JSON calls
over one kept-alive HTTP connection) and the engines' timeline read from their answers.

Against a real HTTP/1.1 server on localhost (http.server), which counts the TCP connections
it accepted and can be told to answer 500 or to hold a request until released."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from skyrl_mega.rollout.control import KeptAliveJson
from skyrl_mega.rollout.errors import RolloutConnectionError, RolloutHTTPError


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive unless told otherwise

    def setup(self):
        super().setup()
        with self.server.lock:
            self.server.connections += 1

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if body.get("hold"):
            self.server.held.set()
            self.server.release.wait(30)
        status = 500 if body.get("fail") else 200
        raw = json.dumps({"echo": body}).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *a):
        pass


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    srv.connections, srv.lock = 0, threading.Lock()
    srv.held, srv.release = threading.Event(), threading.Event()
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv, f"http://127.0.0.1:{srv.server_address[1]}"
    srv.release.set()
    srv.shutdown()
    srv.server_close()


def test_calls_share_one_connection_and_an_idle_one_is_replaced(server):
    srv, url = server
    c = KeptAliveJson(url, idle_s=600)
    assert [c.post("/x", {"i": i}, 10)["echo"]["i"] for i in range(5)] == list(range(5))
    assert srv.connections == 1
    c.idle_s = 0  # every connection counts as idle: a fresh one per call
    c.post("/x", {}, 10)
    c.post("/x", {}, 10)
    assert srv.connections == 3
    c.close()


def test_an_error_answer_raises_and_the_next_call_reconnects(server):
    srv, url = server
    c = KeptAliveJson(url, idle_s=600)
    c.post("/x", {}, 10)
    with pytest.raises(RolloutHTTPError) as e:
        c.post("/x", {"fail": True}, 10)
    assert e.value.status == 500
    assert c.post("/x", {"after": 1}, 10)["echo"] == {"after": 1}
    assert srv.connections == 2


def test_a_call_beside_one_in_flight_gets_its_own_connection(server):
    srv, url = server
    c = KeptAliveJson(url, idle_s=600)
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("held", c.post("/x", {"hold": True}, 30)))
    t.start()
    assert srv.held.wait(30)
    assert c.post("/x", {"beside": 1}, 10)["echo"] == {"beside": 1}  # did not wait for the held one
    srv.release.set()
    t.join(30)
    assert got["held"]["echo"] == {"hold": True}
    assert srv.connections == 2


def test_a_server_that_is_gone_is_a_connection_error():
    c = KeptAliveJson("http://127.0.0.1:9", idle_s=600)  # the discard port: nothing listens
    with pytest.raises(RolloutConnectionError, match="127.0.0.1:9/x"):
        c.post("/x", {}, 5)
    with pytest.raises(ValueError, match="http://host:port"):
        KeptAliveJson("unix:///tmp/sock")


def test_engine_timeline_read_from_fan_out_replies():
    """The transports read the workers' own timestamps and copy times out of fan-out replies
    ({url: [worker answer, ...]} per client, as HttpEngineClient returns them)."""
    from skyrl_mega.weight_sync.transports.transfer_api import (engine_copy_ms, engine_got_at, engine_map_check_ms,
                                                                engine_spans)

    reply = [{"http://a": [{"weight_version": "3", "at": [10.0, 10.5], "copy_ms": [4.0, 1.5], "map_check_ms": 0.4},
                           {"weight_version": "3", "at": [10.1, 10.7], "copy_ms": [5.0], "map_check_ms": 0.9}]},
             {"receiver": {"version": 3}}]  # a client that reports no timeline
    assert engine_spans(reply) == [(10.0, 10.5), (10.1, 10.7)]
    assert engine_copy_ms(reply) == 5.5 and engine_map_check_ms(reply) == 0.9  # the slowest worker
    assert engine_map_check_ms([{"u": [{"at": [1.0, 2.0]}]}]) is None
    assert engine_spans([{"u": []}]) == [] and engine_copy_ms([{"u": [{"at": [1.0, 2.0]}]}]) is None
    # the listener's arrival stamp (worker channel only): the earliest worker's
    assert engine_got_at(reply) is None
    assert engine_got_at([{"http://a": [{"at": [10.2, 10.5], "got_at": 10.15, "via": "channel"},
                                        {"at": [10.1, 10.7], "got_at": 10.05, "via": "channel"}]}]) == 10.05
