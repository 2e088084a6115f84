"""Control-plane clients: vLLM's four weight-transfer calls, to engines or to standalone receivers.

- HttpEngineClient: every vLLM server directly (never the router), through vLLM's own
  endpoints (VLLM_SERVER_DEV_MODE=1): POST /init_weight_transfer_engine {"init_info"},
  /start_weight_update, /update_weights {"update_info"}, /finish_weight_update
  {"weight_version"}; GET /get_world_size gives each server's worker count, so each server
  gets its own rank offset in the transfer group.
- ChannelClient: standalone receivers (receiver.py) over the trainer's TCPStore: message
  `skyrl_ws_ctl/<seq>` = JSON {"method", "args"}, every receiver answers
  `skyrl_ws_ack/<seq>/<index>` = JSON {"ok", "result" | "error"}.
Every method fans out to all targets and raises WeightSyncError naming each that failed.
"""

from __future__ import annotations

import datetime
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..rollout.control import EngineControl, http_json
from ..rollout.errors import WeightSyncError


class HttpEngineClient:
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
        return self._each("POST", "/finish_weight_update", [body] * len(self.urls))

    def versions(self, finish_reply=None) -> dict:
        return self.control.weight_versions()

    def describe(self) -> str:
        return f"{len(self.urls)} vLLM server(s)"


class ChannelClient:
    """Standalone receivers started with `python -m skyrl_mega.weight_sync.receiver --index i`."""

    def __init__(self, num_receivers: int, timeout_s: float = 600.0):
        self.n = int(num_receivers)
        self.timeout_s = timeout_s
        self.store = None
        self.seq = 0
        self.last: dict = {}

    def bind(self, store) -> None:
        self.store = store

    def num_ranks(self) -> int:
        return self.n

    def call(self, method: str, args: dict | None = None, timeout_s: float | None = None) -> list:
        if self.store is None:
            raise WeightSyncError("ChannelClient is not bound to a store (the transport binds it at init)")
        seq = self.seq
        self.seq += 1
        self.store.set(f"skyrl_ws_ctl/{seq}", json.dumps({"method": method, "args": args or {}}, default=str))
        keys = [f"skyrl_ws_ack/{seq}/{i}" for i in range(self.n)]
        try:
            self.store.wait(keys, datetime.timedelta(seconds=timeout_s or self.timeout_s))
        except Exception as e:
            raise WeightSyncError(f"receivers did not answer {method} in time: {e}") from e
        replies = [json.loads(self.store.get(k)) for k in keys]
        bad = {i: r.get("error") for i, r in enumerate(replies) if not r.get("ok")}
        if bad:
            raise WeightSyncError(f"{method} failed on receiver(s) {bad}")
        self.last[method] = [r.get("result") for r in replies]
        return self.last[method]

    def init(self, init_info: dict, rank_offset: int) -> Any:
        return self.call("init_weight_transfer_engine", {"init_info": {**init_info, "rank_offset": rank_offset}})

    def start(self) -> Any:
        return self.call("start_weight_update")

    def update(self, update_info: dict) -> Any:
        return self.call("update_weights", {"update_info": update_info})

    def finish(self, version) -> Any:
        return self.call("finish_weight_update", {"weight_version": version})

    def versions(self, finish_reply: list | None = None) -> dict:
        """Each receiver's committed version (from finish's reply when given: no extra round trip)."""
        reports = finish_reply if finish_reply is not None else self.call("report")
        return {f"receiver{i}": r["version"] for i, r in enumerate(reports)}

    def shutdown(self) -> None:
        if self.store is not None:
            self.call("shutdown", timeout_s=30)

    def describe(self) -> str:
        return f"{self.n} standalone receiver(s)"
