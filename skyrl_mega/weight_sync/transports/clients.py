"""Control-plane clients: vLLM's four weight-transfer calls, to every engine of a transport.

    EngineClient       what a transport needs from one group of receivers (the interface)
    HttpEngineClient   every vLLM server directly (never the router), through vLLM's own
                       endpoints (VLLM_SERVER_DEV_MODE=1): POST /init_weight_transfer_engine
                       {"init_info"}, /start_weight_update, /update_weights {"update_info"},
                       /finish_weight_update {"weight_version"}; GET /get_world_size gives each
                       server's worker count, so each server gets its own rank offset in the
                       transfer group.
Every HTTP method fans out to all servers and raises WeightSyncError naming each that failed.
Bodies are JSON; nothing else crosses the process boundary.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from ...rollout.control import EngineControl, http_json
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
    def __init__(self, control: EngineControl, timeout_s: float = 600.0):
        self.control = control
        self.timeout_s = timeout_s
        self._sizes: list[int] | None = None

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

    def _each(self, method: str, path: str, bodies: list | None = None, timeout_s: float | None = None) -> dict:
        t = timeout_s or self.timeout_s
        errors, out = {}, {}
        with ThreadPoolExecutor(max_workers=len(self.urls)) as pool:
            futs = {u: pool.submit(http_json, method, u + path, bodies[i] if bodies else None, t)
                    for i, u in enumerate(self.urls)}
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
        return self._each("POST", "/init_weight_transfer_engine", bodies)

    def start(self) -> Any:
        return self._each("POST", "/start_weight_update", timeout_s=120)

    def update(self, update_info: dict) -> Any:
        return self._each("POST", "/update_weights", [{"update_info": update_info}] * len(self.urls))

    def finish(self, version) -> Any:
        body = {"weight_version": None if version is None else str(version)}
        out = self._each("POST", "/finish_weight_update", [body] * len(self.urls))
        if version is not None:
            self.control.record_finished_version(version)
        return out

    def versions(self, finish_reply=None) -> dict:
        return self.control.weight_versions()

    def reset(self) -> None:
        self._sizes = None  # a restarted server may have another worker count

    def describe(self) -> str:
        return f"{len(self.urls)} vLLM server(s)"
