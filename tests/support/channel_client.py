"""ChannelClient: the trainer's control-plane client for standalone receivers (tests/support/receiver.py).

Messages travel over the trainer's TCPStore (the transport binds a connection of its own):
`skyrl_ws_ctl/<seq>` = JSON {"method", "args"}, every receiver answers
`skyrl_ws_ack/<seq>/<index>` = JSON {"ok", "result" | "error"}. A call waits for every
receiver and raises WeightSyncError naming each that failed.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

from skyrl_mega.rollout.errors import WeightSyncError
from skyrl_mega.weight_sync.transports.clients import EngineClient


class ChannelClient(EngineClient):
    """Standalone receivers started with `python -m tests.support.receiver --index i`."""

    def __init__(self, num_receivers: int, timeout_s: float = 600.0):
        self.n = int(num_receivers)
        self.timeout_s = timeout_s
        self.store = None
        self.seq = 0
        self.last: dict = {}

    def bind(self, connect) -> None:
        self.store = connect()

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

    def close(self) -> None:
        self.shutdown()

    def describe(self) -> str:
        return f"{self.n} standalone receiver(s)"
