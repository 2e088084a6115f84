"""Control-plane clients: vLLM's four weight-transfer calls, to every engine of a transport.

    EngineClient       what a transport needs from one group of receivers (the interface)
    HttpEngineClient   every vLLM server directly (never the router), VLLM_SERVER_DEV_MODE=1:
                       POST /init_weight_transfer_engine {"init_info"} (vLLM's endpoint), then
                       per update vLLM's worker calls start_weight_update / update_weights /
                       finish_weight_update through ONE POST /collective_rpc per round
                       ("skyrl_weight_update" of the worker extension, rollout/vllm_plugin.py):
                       the start rides on the first round, and the commit's answer carries the
                       served version (vLLM's own endpoints would cost a round trip each, and
                       0.26 keeps no version). GET /get_world_size gives each server's worker
                       count, so each server gets its own rank offset in the transfer group.
                       channel=True (co-located CUDA IPC): after init each one-worker server's
                       worker opens a listener of its own (skyrl_open_channel,
                       rollout/worker_channel.py) and the rounds go there directly, skipping
                       the API server and engine core hops; servers of several workers keep
                       /collective_rpc.
Every HTTP method fans out to all servers and raises WeightSyncError naming each that failed.
Bodies are JSON; nothing else crosses the process boundary.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from ...rollout.control import EngineControl, KeptAliveJson, http_json
from ...rollout.errors import WeightSyncError


class EngineClient:
    """One group of receivers that answers init / start / update / finish (vLLM's weight-transfer
    calls). `bind(connect)`: the transport's TCPStore, for clients whose messages travel through
    it (`connect()` opens a connection of the client's own); HTTP clients ignore it."""

    def num_ranks(self) -> int:
        """How many ranks these receivers take in the transfer group."""
        raise NotImplementedError

    def bind(self, connect: Callable[[], Any]) -> None:
        pass

    def init(self, init_info: dict, rank_offset: int) -> Any:
        raise NotImplementedError

    def start(self) -> Any:
        raise NotImplementedError

    def update(self, update_info: dict) -> Any:
        raise NotImplementedError

    def finish(self, version) -> Any:
        raise NotImplementedError

    def update_and_finish(self, update_info: dict, version) -> Any:
        """A last round, then the commit of `version`; answers as finish() does. Clients that
        can do both in one round trip override it."""
        self.update(update_info)
        return self.finish(version)

    def versions(self, finish_reply=None) -> dict:
        """{receiver: committed weight version} (from `finish_reply` where it has them)."""
        raise NotImplementedError

    def reset(self) -> None:
        """An engine was restarted: forget what was learnt about the engines."""

    def describe(self) -> str:
        return type(self).__name__

    def close(self) -> None:
        pass


class HttpEngineClient(EngineClient):
    def __init__(self, control: EngineControl, timeout_s: float = 600.0, channel: bool = False):
        self.control = control
        self.timeout_s = timeout_s
        self.channel = channel
        self._channels: dict[str, KeptAliveJson] = {}  # server url -> its worker's own listener
        self._sizes: list[int] | None = None
        self._start_pending = False
        self._conns: dict[str, KeptAliveJson] = {}  # url -> its kept-alive connection (_call)
        self._pool: ThreadPoolExecutor | None = None  # fan-out over several servers

    @property
    def urls(self) -> list[str]:
        return self.control.urls

    def world_sizes(self) -> list[int]:
        if self._sizes is None:
            self._sizes = [int(http_json("GET", u + "/get_world_size?include_dp=true", timeout_s=30)["world_size"])
                           for u in self.urls]
        return self._sizes

    def num_ranks(self) -> int:
        return sum(self.world_sizes())

    def _each(self, method: str, path: str, bodies: list | None = None, timeout_s: float | None = None,
              send: Callable[[str, Any], Any] | None = None) -> dict:
        """The same call to every server at once (`send(url, body)`; default one http_json
        request each): {url: answer}, or WeightSyncError naming every server that failed."""
        t = timeout_s or self.timeout_s
        send = send or (lambda u, b: http_json(method, u + path, b, t))
        body = dict(enumerate(bodies or []))
        errors, out = {}, {}
        if len(self.urls) == 1:  # the common case: no thread hand-off
            try:
                out[self.urls[0]] = send(self.urls[0], body.get(0))
            except Exception as e:
                errors[self.urls[0]] = e
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=len(self.urls))
            futs = {u: self._pool.submit(send, u, body.get(i)) for i, u in enumerate(self.urls)}
            for u, f in futs.items():
                try:
                    out[u] = f.result()
                except Exception as e:
                    errors[u] = e
        if errors:
            raise WeightSyncError(f"{path} failed on {len(errors)}/{len(self.urls)} engine(s): "
                                  + "; ".join(f"{u}: {e}" for u, e in errors.items()))
        return out

    def init(self, init_info: dict, rank_offset: int) -> Any:
        bodies, off = [], rank_offset
        for n in self.world_sizes():
            bodies.append({"init_info": {**init_info, "rank_offset": off}})
            off += n
        out = self._each("POST", "/init_weight_transfer_engine", bodies)
        if self.channel and not self._channels and all(n == 1 for n in self.world_sizes()):
            opened = self._each("POST", "/collective_rpc", [{"method": "skyrl_open_channel",
                                                             "timeout": self.timeout_s}] * len(self.urls))
            self._channels = {u: KeptAliveJson(r["results"][0]["url"]) for u, r in opened.items()}
        return out

    # start / update / finish go through the worker extension's skyrl_weight_update (module
    # doc): the start rides on the first round, the commit answers the served version
    def start(self) -> Any:
        self._start_pending = True
        return None

    def _call(self, call: dict) -> dict:
        """One skyrl_weight_update round trip to every server, over kept-alive connections."""
        if self._start_pending:
            call = {"start": True, **call}
        self._start_pending = False  # sent (whatever the answer: a failed start fails the update)
        if self._channels:  # each worker's own listener: same call, no API server / engine core hops
            body = {"call": json.dumps(call)}
            out = self._each("POST", "/skyrl_weight_update", [body] * len(self.urls),
                             send=lambda u, b: self._channels[u].post("/skyrl_weight_update", b, self.timeout_s))
            return {u: [r] for u, r in out.items()}
        body = {"method": "skyrl_weight_update", "kwargs": {"call": json.dumps(call)}, "timeout": self.timeout_s}
        for u in self.urls:
            if u not in self._conns:
                self._conns[u] = KeptAliveJson(u)
        out = self._each("POST", "/collective_rpc", [body] * len(self.urls),
                         send=lambda u, b: self._conns[u].post("/collective_rpc", b, self.timeout_s))
        return {u: (r or {}).get("results") or [] for u, r in out.items()}

    def update(self, update_info: dict) -> Any:
        return self._call({"update_info": update_info})

    def finish(self, version) -> Any:
        if self._start_pending and version is None:  # aborted before anything reached the engines
            self._start_pending = False
            return {}
        out = self._call({"finish": True, "version": None if version is None else str(version)})
        if version is not None:
            self.control.record_finished_version(version)
        return out

    def update_and_finish(self, update_info: dict, version) -> Any:
        out = self._call({"update_info": update_info, "finish": True, "version": str(version)})
        self.control.record_finished_version(version)
        return out

    def versions(self, finish_reply=None) -> dict:
        if finish_reply and not self.control.caps.has("/weight_info"):
            got = {}
            for u, workers in finish_reply.items():
                vs = sorted({str(w.get("weight_version")) for w in workers})
                got[u] = vs[0] if len(vs) == 1 else vs  # workers that disagree fail the check
            return got
        return self.control.weight_versions()

    def reset(self) -> None:
        self._sizes = None  # a restarted server may have another worker count
        self.close()

    def close(self) -> None:
        for c in [*self._conns.values(), *self._channels.values()]:
            c.close()
        self._conns, self._channels = {}, {}
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def describe(self) -> str:
        return f"{len(self.urls)} vLLM server(s)"
